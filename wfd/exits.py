"""Exit rules on tensors: what each decoded position's rule remembers between checks, and the
quantity each check measures (costmodel.exits says what the rules are and decides with them).

The decoder keeps one ``ExitTracker`` per run. A position starts afresh each time it enters
(a flushed position re-enters with a new prefix); a check measures every checked position at
once, from the readouts (kl, entropy-diff, argmax-stable) or the states (latent-diff, gate).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from costmodel.exits import ENTROPY_START, ExitRule

from .sampling import GenerationError


def check_rule(rule: ExitRule, model: nn.Module, depth: int) -> None:
    """A rule this model and depth can run, or a GenerationError in one line."""
    if rule.name == "gate" and not hasattr(model, "exit_lambda"):
        raise GenerationError(f"the gate rule needs a model with an exit gate; "
                              f"{model.family} has none")
    try:
        rule.for_plan(False, depth)  # a minimum depth or a forced depth past R
    except ValueError as exc:
        raise GenerationError(str(exc)) from None


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def kl(previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """KL(previous || current) per row, from log-probabilities."""
    return (previous.exp() * (previous - current)).sum(-1)


def uniform_like(current: torch.Tensor) -> torch.Tensor:
    """The uniform distribution's log-probabilities, a row for each of ``current``'s: the start
    the kl rule compares its first check with."""
    return torch.full_like(current, -math.log(current.shape[-1]))


def entropy(current: torch.Tensor) -> torch.Tensor:
    return -(current.exp() * current).sum(-1)


def relative_change(state: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    state, previous = state.float(), previous.float()
    return (state - previous).norm(dim=-1) / state.norm(dim=-1)


class ExitTracker:
    """Per position in flight: the rule's memory (the last checked readout's log-probabilities
    or entropy or argmax and its streak, the last checked state, the gate's survival)."""

    def __init__(self, rule: ExitRule, model: nn.Module):
        self.rule, self.model = rule, model
        self.memory: dict[int, object] = {}
        self.exit_depths: dict[int, int] = {}  # position -> depth of its latest exit
        # position -> the depth the rule fired at, per entry (None: it did not)
        self.fired: dict[int, list[int | None]] = {}

    def enter(self, positions: list[int], initial_states: torch.Tensor) -> None:
        """Positions entering at depth 0 with their initial states."""
        for p, h0 in zip(positions, initial_states, strict=True):
            self.memory[p] = {"latent-diff": h0.clone(), "gate": 1.0}.get(self.rule.name)
            self.exit_depths.pop(p, None)
            self.fired.setdefault(p, []).append(None)

    def forget(self, position: int) -> None:
        """A committed position's memory is not needed again (it re-enters only if flushed,
        which ``enter`` starts afresh)."""
        self.memory.pop(position, None)

    def check(self, positions: tuple[int, ...], depths: tuple[int, ...],
              states: torch.Tensor, readouts: list[torch.Tensor],
              hazards: list[float] | None = None) -> set[int]:
        """The positions the rule exits at these depths, given their states (rows of
        ``states``) and latest readouts (``readouts``, one per position when the rule reads
        them); the gate's hazards at ``states`` when the caller has them."""
        fired = check_rows([(self, p) for p in positions], depths, states, readouts, hazards)
        return {p for p, f in zip(positions, fired, strict=True) if f}


def check_rows(rows: list[tuple[ExitTracker, int]], depths, states: torch.Tensor,
               readouts: list, hazards: list[float] | None = None) -> list[bool]:
    """Whether each row (a tracker and one of its positions, every tracker with the same rule:
    several sequences' checks measured at once) exits at its depth, given the rows' states and
    latest readouts; the gate's hazards at ``states`` when the caller has them. Each tracker
    remembers what its rule needs and records its exits."""
    if not rows:
        return []
    rule = rows[0][0].rule
    first, fired = rule.min_depth, [False] * len(rows)
    if rule.name == "forced":  # timing: the drawn depths, whatever the model computes
        return _decide(rule, rows, depths, range(len(rows)), [
            r == rule.depth_at(p) for (_, p), r in zip(rows, depths, strict=True)], fired)
    if rule.name == "gate":  # every step's hazard counts, checked or not
        if hazards is None:
            hazards = rows[0][0].model.exit_lambda(states).tolist()
        values = []
        for (tracker, p), h in zip(rows, hazards, strict=True):
            tracker.memory[p] *= 1.0 - h
            values.append(1.0 - tracker.memory[p])
        return _decide(rule, rows, depths, range(len(rows)), values, fired)
    checked = [i for i, r in enumerate(depths) if r >= first]
    if not checked:
        return fired
    owners = [rows[i] for i in checked]
    if rule.name == "latent-diff":
        now = states[checked]
        values = relative_change(now, torch.stack([t.memory[p] for t, p in owners])).tolist()
        new_memory = list(now)
    else:
        current = log_probs(torch.stack([readouts[i] for i in checked]))
        fresh = [depths[i] == first for i in checked]
        if rule.name == "kl":
            uniform = uniform_like(current[0])
            previous = torch.stack([uniform if f else t.memory[p]
                                    for (t, p), f in zip(owners, fresh, strict=True)])
            values = kl(previous, current).tolist()
            new_memory = list(current)
        elif rule.name == "entropy-diff":
            now = entropy(current).tolist()
            values = [abs(h - (ENTROPY_START if f else t.memory[p]))
                      for (t, p), h, f in zip(owners, now, fresh, strict=True)]
            new_memory = now
        else:  # argmax-stable
            tops = current.argmax(-1).tolist()
            new_memory, values = [], []
            for (t, p), top, f in zip(owners, tops, fresh, strict=True):
                last, streak = (-1, 0) if f else t.memory[p]
                streak = streak + 1 if top == last else 0
                new_memory.append((top, streak))
                values.append(streak)
    for (t, p), m in zip(owners, new_memory, strict=True):
        t.memory[p] = m
    return _decide(rule, rows, depths, checked, values, fired)


def _decide(rule, rows, depths, indices, values, fired: list[bool]) -> list[bool]:
    """``fired`` with the rows at ``indices`` whose ``rule`` fires on their ``values`` set,
    each exit recorded in its tracker."""
    forced = rule.name == "forced"
    for i, v in zip(indices, values, strict=True):
        tracker, p = rows[i]
        r = depths[i]
        if r >= rule.min_depth and (v if forced else rule.fires(v)):
            fired[i] = True
            tracker.exit_depths[p] = r
            tracker.fired[p][-1] = r
    return fired


def depth_signals(states: dict[int, torch.Tensor], initial: torch.Tensor,
                  logits: dict[int, torch.Tensor], model: nn.Module) -> dict[str, list[float]]:
    """What every rule reads at each depth r = 1..R of one position, for its depth trace: from
    its states by depth (and its initial state) and its readouts by depth."""
    depths = sorted(logits)
    lp = log_probs(torch.stack([logits[r] for r in depths]))
    uniform = uniform_like(lp)
    h = torch.stack([initial, *(states[r] for r in depths)])
    out = {"kl_step": kl(torch.cat([uniform[:1], lp[:-1]]), lp).tolist(),
           "kl_start": kl(uniform, lp).tolist(),
           "entropy": entropy(lp).tolist(),
           "latent_step": relative_change(h[1:], h[:-1]).tolist(),
           "latent_start": relative_change(h[1:], h[:1].expand_as(h[1:])).tolist()}
    if hasattr(model, "exit_lambda"):
        out["exit_lambda"] = model.exit_lambda(h[1:]).tolist()
    return out

