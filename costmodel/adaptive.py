"""Pricing adaptive depth (early exit): the calls of AR, DtV and WFD per committed token when each
position stops at its own depth, drawn from a distribution (``--exit-depths``, with acceptance
alpha for drafts that go on) or from a depth trace under a rule (``--depth-trace FILE --exit
RULE``: each position's exit depth and whether its draft equals its final readout, together).

AR and DtV have closed forms (a DtV continuation call at depth r holds Binomial(k + 1, P(e >= r))
positions). A wave's width and flushes depend on the whole sequence of exits, so WFD is
simulated call by call with the decoder's plan (``WFD_POSITIONS`` positions, seeded).
docs/adaptive-depth.md says more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, cached_property

import numpy as np

from .exits import ExitRule, check_exit_depths
from .plans import EarlyExit, make_plan
from .schedules import CallGroup
from .specs import WFD, DtV, HardwareSpec, LoopedModelSpec, Workload

WFD_POSITIONS = 2048  # simulated per WFD prediction: a wave's mean cost to about 2%


@dataclass(frozen=True)
class ExitProfile:
    """Exit depths as the pricing reads them: the probability of each depth 1..R, whether a
    draft at d equals its position's final token (per depth a position exits at: P(accept | e)),
    and what the plan needs of the rule."""

    depth: int
    probs: tuple[float, ...]  # P(e = r), r = 1..R
    accept_given_exit: tuple[float, ...]  # P(y(p, d) == y(p, e) | e = r), r = 1..R
    exits: EarlyExit
    # (exit depth, accepted) per position, for simulation; empty: draw from the probabilities
    pairs: tuple[tuple[int, bool], ...] = ()

    @classmethod
    def from_distribution(cls, dist: dict[int, float], depth: int, acceptance: float,
                          every_depth: bool) -> ExitProfile:
        probs = tuple(dist.get(r, 0.0) for r in range(1, depth + 1))
        first = min(r for r, p in dist.items() if p > 0)
        return cls(depth, probs, (acceptance,) * depth, EarlyExit(first, every_depth))

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[int, bool]], depth: int, exits: EarlyExit
                   ) -> ExitProfile:
        if not pairs:
            raise ValueError("no decoded positions to read exit depths from")
        counts = np.zeros(depth)
        accepted = np.zeros(depth)
        for e, ok in pairs:
            counts[e - 1] += 1
            accepted[e - 1] += ok
        probs = counts / counts.sum()
        given = np.divide(accepted, counts, out=np.ones(depth), where=counts > 0)
        return cls(depth, tuple(probs), tuple(given), exits, tuple(pairs))

    @property
    def mean_depth(self) -> float:
        return sum(r * p for r, p in enumerate(self.probs, start=1))

    @cached_property
    def _tails(self) -> tuple[float, ...]:
        return tuple(float(t) for t in np.cumsum(self.probs[::-1])[::-1]) + (0.0,)

    def at_least(self, r: int) -> float:
        """P(e >= r)."""
        return self._tails[r - 1]

    def acceptance(self, draft_depth: int) -> float:
        """P(a position's draft is its token): it exits by d, or its draft equals its final."""
        return sum(p * (1.0 if r <= draft_depth else a) for r, (p, a) in enumerate(
            zip(self.probs, self.accept_given_exit, strict=True), start=1))

    def draft_acceptance(self, draft_depth: int) -> float | None:
        """P(draft accepted | the position goes past d): what the verifier sees."""
        past = self.at_least(draft_depth + 1)
        if past == 0:
            return None
        return sum(p * a for p, a in zip(self.probs[draft_depth:],
                                         self.accept_given_exit[draft_depth:], strict=True)
                   ) / past

    def draws(self, count: int, seed: int) -> tuple[list[int], list[bool]]:
        """Exit depths and draft outcomes for ``count`` decoded positions: the recorded pairs
        drawn with replacement, or independent draws from the probabilities."""
        rng = np.random.default_rng(seed)
        if self.pairs:
            picked = rng.integers(0, len(self.pairs), count)
            return ([self.pairs[i][0] for i in picked], [self.pairs[i][1] for i in picked])
        depths = rng.choice(np.arange(1, self.depth + 1), size=count, p=np.asarray(self.probs))
        accept = rng.random(count) < np.asarray(self.accept_given_exit)[depths - 1]
        return [int(e) for e in depths], [bool(a) for a in accept]

    def reads(self, schedule: str = "ar", draft_depth: int | None = None):
        """Whether the schedule's plan reads a position still going out after its step r
        (before knowing whether it exits there): the plan's own rule (``Plan.read_at``)."""
        plan = make_plan(schedule, 1, self.depth, coda_attends=False, draft_depth=draft_depth,
                         exits=self.exits)
        return plan.read_at


def ar_exit_groups(profile: ExitProfile) -> list[CallGroup]:
    """AR with exits, per token: P, a block call at each depth the position reaches, and its
    readouts (every checked depth, or the exit depth only)."""
    depth, read_at = profile.depth, profile.reads()
    groups = [CallGroup("prelude", 1, 1, 1), CallGroup("block", 1, 1, 1)]
    for r in range(2, depth + 1):
        groups.append(CallGroup("block", 1, 1, profile.at_least(r),
                                after_other_part=read_at(r - 1)))
    readouts = sum(profile.at_least(r) for r in range(1, depth + 1) if read_at(r)) \
        if profile.exits.every_depth else 1.0
    groups.append(CallGroup("coda", 1, 1, readouts))
    return groups


def dtv_exit_groups(schedule: DtV, profile: ExitProfile) -> list[CallGroup]:
    """DtV(k, d) with exits, per round (basis ("dtv", k)): k + 1 drafts of up to d steps each,
    then continuation calls over the positions still going."""
    k, d, depth = schedule.block_length, schedule.draft_depth, profile.depth
    read_at = profile.reads("dtv", d)
    drafted = k + 1
    per_round = ("dtv", k)
    groups = [CallGroup("prelude", 1, 1, drafted, per_round),
              CallGroup("block", 1, 1, drafted, per_round)]
    for r in range(2, d + 1):
        groups.append(CallGroup("block", 1, 1, drafted * profile.at_least(r), per_round,
                                after_other_part=read_at(r - 1)))
    # without every depth's readouts, one per draft: at d, or where it exits before d
    readouts = sum(profile.at_least(r) for r in range(1, d + 1) if read_at(r)) \
        if profile.exits.every_depth else 1.0
    groups.append(CallGroup("coda", 1, 1, drafted * readouts, per_round))
    for r in range(d + 1, depth + 1):
        going = _binomial(drafted, profile.at_least(r))
        # the call after a depth with readouts follows the coda: with every-depth readouts, or
        # (state rules) when a position exited at r - 1; r = d + 1 follows the drafts' readouts
        if r == d + 1 or read_at(r - 1):
            after_coda = np.ones(drafted + 1)
        else:
            stopped = profile.at_least(r - 1) - profile.at_least(r)
            rest = 1.0 - profile.at_least(r)  # exited before r
            share = stopped / rest if rest > 0 else 0.0
            after_coda = 1.0 - (1.0 - share) ** (drafted - np.arange(drafted + 1))
        for n in range(1, drafted + 1):
            if going[n] > 0:
                groups.append(CallGroup("block", n, 1, going[n] * after_coda[n], per_round))
                groups.append(CallGroup("block", n, 1, going[n] * (1 - after_coda[n]),
                                        per_round, after_other_part=False))
        # read out: every position going, or only those exiting at r
        reading = going if read_at(r) else _binomial(drafted, profile.probs[r - 1])
        for n in range(1, drafted + 1):
            if reading[n] > 0:
                groups.append(CallGroup("coda", n, 1, reading[n], per_round))
    return groups


def _binomial(n: int, p: float) -> np.ndarray:
    """P(X = i), i = 0..n, X ~ Binomial(n, p)."""
    p = min(max(p, 0.0), 1.0)
    i = np.arange(n + 1)
    return _combinations(n) * p**i * (1 - p) ** (n - i)


@cache
def _combinations(n: int) -> np.ndarray:
    return np.array([math.comb(n, i) for i in range(n + 1)], dtype=float)


def exit_profile(model: LoopedModelSpec, workload: Workload, depth: int, draft_depth: int
                 ) -> ExitProfile | None:
    """The workload's exit depths (None at fixed depth), checked against R."""
    if not workload.adaptive:
        return None
    coda_attends = model.coda_layers > 0
    rule = ExitRule.parse(workload.exit_rule, workload.exit_min_depth) \
        if workload.exit_rule else None
    if rule is not None and rule.name == "gate" and not model.exit_gate:
        raise ValueError(f"the gate rule needs a model with an exit gate; {model.name} has none")
    if workload.exit_depths is not None:
        dist = workload.exit_depths
        check_exit_depths(dist, depth)
        alpha = model.default_acceptance if workload.acceptance is None else workload.acceptance
        every = rule.for_plan(coda_attends, depth).every_depth if rule else coda_attends
        return ExitProfile.from_distribution(dist, depth, alpha, every)
    from .trace import read_depth_trace

    trace = read_depth_trace(workload.depth_trace)
    if trace.header.depth != depth:
        raise ValueError(f"the depth trace was recorded at R = {trace.header.depth}, the "
                         f"prediction is for R = {depth}")
    return ExitProfile.from_pairs(trace.exit_pairs(rule, draft_depth), depth,
                                  rule.for_plan(coda_attends, depth))


def simulate_wfd(model: LoopedModelSpec, hw: HardwareSpec, schedule: WFD, workload: Workload,
                 depth: int, profile: ExitProfile):
    """WFD with exits: runs of the workload's length, seeded 0, 1, ... until ``WFD_POSITIONS``
    positions are decoded; their summed latency, breakdown, ideal time, block calls and
    tokens."""
    from .simulate import simulate

    runs, decoded, seed = [], 0, 0
    tokens = max(workload.new_tokens, 2)
    while decoded < WFD_POSITIONS:
        depths, accept = profile.draws(tokens + 64, seed)
        runs.append(simulate(model, hw, schedule, context_length=workload.context_length,
                             new_tokens=tokens, accept_sequence=accept, depth=depth,
                             kv_sharing=workload.kv_sharing, dtype=workload.dtype,
                             batch_size=workload.batch_size, records=False,
                             exits=profile.exits, exit_depths=depths))
        decoded += runs[-1].committed_tokens
        seed += 1
    breakdown = {k: sum(r.breakdown_s[k] for r in runs) for k in runs[0].breakdown_s}
    return (sum(r.latency_s for r in runs), breakdown, sum(r.ideal_s for r in runs),
            sum(r.block_calls for r in runs), decoded)
