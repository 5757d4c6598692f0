"""A stream of requests served step by step (``predict_serving(..., fidelity="steps")``,
`costmodel serving --fidelity steps`): the same engine as ``costmodel.serving``'s call-by-call
simulation, its decoding priced a step at a time from the closed forms, fast enough for tens of
thousands of requests.

A step commits one token of every running sequence (in expectation: a DtV or WFD sequence's
share of its rounds or ticks, ``predict``'s steady state) and costs the schedule's time per
token at the step's batch and the sequences' mean context, plus the engine's own time. Those
times are priced once, vectorized over every batch size and context (in buckets of
``CONTEXT_BUCKET`` keys), and summed along the context, so the engine's clock jumps from one
event to the next (an arrival it may admit, a sequence that finishes) in one lookup, not a step
at a time. Newcomers are admitted at the end of the step they arrive in (first come first
served, their whole KV reserved), their prompts prefilled together, whole, before the next
step, and their first tokens counted from their arrival, as the call-by-call simulation starts a
newcomer's prefill at the next call, mid-round.

With exits (``StreamExits``) each step is priced from the schedule's closed form with exits at
the step's batch (AR's and DtV's; WFD's is simulated, so it has none): its tokens in step, or
each sequence at its own depth as the plugin's exit mode runs them on vLLM.

What it leaves out against the call-by-call simulation: the draws of each draft's acceptance (a
DtV or WFD sequence advances at its mean rate, so its TPOT spreads less: p99 shorter) and the
wave's ramp after a prefill; and it prices a step at the batch's mean context (exact for the KV
reads and attention, which are linear in it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .adaptive import ExitProfile, exit_profile
from .engines import EngineOverheads
from .groups import CallGroup, block_calls_per_token
from .hardware import HardwareSpec
from .model import LoopedModelSpec
from .placement import StreamPlacement
from .predict import _Pricer, prefill_time_s
from .requests import Request
from .schedules.base import Schedule
from .slots import readout_depths, static_span
from .workload import Workload

CONTEXT_BUCKET = 16  # keys: a step's time is priced at its context rounded to these


@dataclass(frozen=True)
class StreamExits:
    """Exits in a stream: each decoded token stops at a depth drawn from ``profile``; a batch's
    tokens in step (this project's batch: a block call runs while any token is at its depth)
    or, ``continuous``, each sequence at its own depth (the plugin's exit mode on vLLM, which
    runs AR as a wave: it pays the engine's time per tick and commits ahead as the drafting
    schedules do). ``fields``: the ``Workload`` exit fields the profile was made from."""

    profile: ExitProfile
    continuous: bool = False
    fields: dict = field(default_factory=dict)

    @classmethod
    def of(cls, model: LoopedModelSpec, exits: dict, depth: int, draft_depth: int,
           acceptance: float | None, continuous: bool) -> StreamExits:
        """From a ``Workload``'s exit fields (``exits``: ``exit_depths``, or ``depth_trace``
        with ``exit_rule``)."""
        workload = Workload(depth=depth, acceptance=acceptance, **exits)
        return cls(exit_profile(model, workload, depth, draft_depth), continuous, dict(exits))

    def groups(self, schedule: Schedule, batch: int) -> list[CallGroup]:
        """A step's calls at ``batch`` sequences, from the schedule's closed form with exits."""
        groups = schedule.exit_groups(self.profile, batch, self.continuous)
        if groups is None:
            raise _unpriced(schedule.name)
        return groups

    def schedules(self, names: Sequence[str] | None) -> list[str]:
        """The schedules a stream with exits runs: those asked for (each with a closed form
        under exits: a ValueError in one line otherwise), or every one that has."""
        from .schedules import SCHEDULES

        priced = [name for name, kind in SCHEDULES.items() if kind.variants(
            1, self.profile.depth)[0].exit_groups(self.profile, 1, self.continuous) is not None]
        for name in names or ():
            if name not in priced:
                raise _unpriced(name)
        return priced if names is None else list(names)

    def waves(self, schedule: Schedule) -> bool:
        return schedule.drafts or self.continuous


def _unpriced(name: str) -> ValueError:
    return ValueError(f"{name.upper()} with exits has no closed form to price a stream step by "
                      "step (predict simulates it): serve AR and DtV with exits (--schedule ar "
                      "--schedule dtv)")


def stream_readouts(schedule: Schedule, depth: int, exits: StreamExits | None) -> int:
    """The depths a sequence's tokens are read out at in a stream, a coda KV slot each (with
    exits, every depth a token may stop at)."""
    return readout_depths(schedule, depth, exits.profile.exits.min_depth if exits else None)


def step_times(model: LoopedModelSpec, hw: HardwareSpec, schedule: Schedule, *, alpha: float,
               depth: int, kv_sharing: int, dtype: str, max_batch: int, longest: int,
               engine: EngineOverheads, placement: StreamPlacement | None = None,
               exits: StreamExits | None = None) -> np.ndarray:
    """Seconds a step takes, ``[batch - 1, context]`` for every batch up to ``max_batch`` and
    every context (a sequence's tokens so far) up to ``longest``; on one device, or with the
    parts placed on devices of their own (``placement``); with ``exits``, each batch's calls
    those of its tokens' exit depths."""
    buckets = np.arange(0, longest + CONTEXT_BUCKET, CONTEXT_BUCKET, dtype=float)
    keys = buckets + 1
    if hw.graphs.cuda_graphs:  # a replayed step reads its static span
        keys = np.array([static_span(int(k)) for k in keys], dtype=float)
    if exits is not None:
        bucketed = _exit_step_times(model, hw, schedule, exits, alpha, dtype, keys, max_batch,
                                    engine, depth)
        return np.repeat(bucketed, CONTEXT_BUCKET, axis=1)[:, :longest + 1]
    batches = np.arange(1, max_batch + 1, dtype=float)[:, None]
    groups = schedule.call_groups(depth, kv_sharing)
    if placement is None:
        per_token = np.broadcast_to(_priced(model, hw, schedule, groups, alpha, dtype,
                                            keys[None, :], batches), (max_batch, len(buckets)))
    else:
        per_token = placement.step_s(model, groups, alpha, dtype, part_priced(
            model, hw, schedule, groups, alpha, dtype, keys[None, :], batches), max_batch)
    ticks = float(block_calls_per_token(groups, np.asarray(alpha))) if schedule.drafts else 0.0
    own = np.array([engine.token_share_s(b, schedule.drafts, ticks, depth)
                    for b in range(1, max_batch + 1)])
    bucketed = per_token + own[:, None]
    return np.repeat(bucketed, CONTEXT_BUCKET, axis=1)[:, :longest + 1]


def _exit_step_times(model, hw, schedule: Schedule, exits: StreamExits, alpha: float,
                     dtype: str, keys: np.ndarray, max_batch: int, engine: EngineOverheads,
                     depth: int) -> np.ndarray:
    """``step_times``'s rows with exits: a batch's calls depend on how many tokens share them
    (in step, a block call runs while any of them is still iterating), so each batch is priced
    from its own call groups."""
    rows = []
    for b in range(1, max_batch + 1):
        groups = exits.groups(schedule, b)
        batch = np.array([[float(b)]])
        calls = np.broadcast_to(_priced(model, hw, schedule, groups, alpha, dtype,
                                        keys[None, :], batch), (1, len(keys)))[0]
        waves = exits.waves(schedule)
        ticks = float(block_calls_per_token(groups, np.asarray(alpha))) if waves else 0.0
        rows.append(calls + engine.token_share_s(b, waves, ticks, depth))
    return np.array(rows)


def _priced(model, hw, schedule: Schedule, groups, alpha: float, dtype: str, keys, batches):
    """A step's time at each batch (every part's, ``part_priced``)."""
    return sum(part_priced(model, hw, schedule, groups, alpha, dtype, keys, batches).values())


def part_priced(model, hw, schedule: Schedule, groups, alpha: float, dtype: str, keys, batches
                ) -> dict[str, np.ndarray]:
    """Each part's time in a step at each batch: in phase, every call serves the whole batch;
    a WFD batch's waves each read out on ticks of their own phase, so a tick's prelude and coda
    calls come whenever any wave's readout falls due (1 - (1 - q)^B of the ticks, where one
    wave reads out on q of them) and serve the waves whose readout is due."""
    alpha = np.asarray(alpha)
    parts = {}
    block = [g for g in groups if g.part == "block"]
    ticks = sum(g.weight(alpha) for g in block)
    for part in ("prelude", "block", "coda"):
        own = [g for g in groups if g.part == part]
        if not own:
            continue
        q = 1.0 if schedule.in_phase or part == "block" else min(
            1.0, float(sum(g.weight(alpha) for g in own) / ticks))
        if not q:  # no call of this part
            continue
        due = 1 - (1 - q) ** batches  # the ticks with a call of this part
        served = batches * q / due  # the waves a call serves
        calls = _Pricer(model, hw, dtype, keys, served, None).per_token(own, alpha)
        parts[part] = calls["latency_s"] * due / q  # due / q times the in-phase calls
    return parts


def elapsed_times(model: LoopedModelSpec, hw: HardwareSpec, schedule: Schedule,
                  requests: Sequence[Request], *, acceptance: float, depth: int,
                  kv_sharing: int, dtype: str, max_batch: int,
                  engine: EngineOverheads, placement: StreamPlacement | None = None,
                  exits: StreamExits | None = None) -> np.ndarray:
    """``step_times`` summed along the context from 0: ``[batch - 1, c]`` is what the steps
    from context 0 to c take, so any run of steps costs one difference."""
    longest = max(r.prompt_tokens + r.output_tokens for r in requests)
    times = step_times(model, hw, schedule, alpha=acceptance, depth=depth,
                       kv_sharing=kv_sharing, dtype=dtype, max_batch=max_batch,
                       longest=longest, engine=engine, placement=placement, exits=exits)
    return np.concatenate([np.zeros((max_batch, 1)), np.cumsum(times, axis=1)], axis=1)


def decoding_run(line: np.ndarray, context: int, most: int, wait: float | None = None
                 ) -> tuple[int, float]:
    """(steps, their time) of a batch that only decodes from ``context`` (``line``: its row of
    ``elapsed_times``): at most ``most``, and where a request arrives ``wait`` seconds from
    now, up to the end of the step it arrives in."""
    if wait is not None:
        most = max(1, min(most, int(np.searchsorted(line, line[context] + wait)) - context))
    steps = min(most, len(line) - 1 - context)
    return steps, float(line[context + steps] - line[context])


def round_tokens(schedule: Schedule, acceptance: float) -> int:
    """The whole tokens a sequence commits in one of its rounds (AR's one, a DtV round's
    accepted drafts and bonus token, a WFD tick's share rounded up to one)."""
    return max(1, round(schedule.tokens_per_round(acceptance)))


class _Prefills:
    """The time a group of newcomers' prompts take, prefilled together at their mean length
    (placed: through the parts in order, their hidden states handed from device to device),
    and a step's of them with the engine's own time (``step``)."""

    def __init__(self, model, hw, depth: int, dtype: str, kv_sharing: int, readouts: int,
                 placement: StreamPlacement | None = None, together: bool = False,
                 engine: EngineOverheads | None = None):
        self.args = model, hw, depth, readouts, together
        self.fields = {"dtype": dtype, "kv_sharing": kv_sharing, "new_tokens": 1}
        self.memo: dict[tuple[int, int], float] = {}
        self.placement = placement
        self.engine = engine or EngineOverheads()

    def step(self, prompts: list[int], decoding: bool = False) -> float:
        """A step's time for ``prompts``: alone, their prefill, the engine's step and its time
        for prompts; beside decoding sequences (whose step is priced apart and pays the
        engine's step), their prefill past the one token's those share and the prompts' time."""
        if decoding:
            return max(0.0, self(prompts) - self([1])) + self.engine.prompt_s
        return self(prompts) + self.engine.step_s + self.engine.prompt_s

    def __call__(self, prompts: list[int]) -> float:
        key = (len(prompts), round(np.mean(prompts)))
        if key not in self.memo:
            model, hw, depth, readouts, together = self.args
            workload = Workload(context_length=key[1], batch_size=key[0], **self.fields)
            self.memo[key] = prefill_time_s(model, hw, workload, depth, readouts, together) + (
                self.placement.prefill_handoff_s(model, key[0] * key[1], self.fields["dtype"])
                if self.placement is not None else 0.0)
        return self.memo[key]


def serve_steps(model: LoopedModelSpec, hw: HardwareSpec, schedule: Schedule,
                requests: Sequence[Request], *, max_batch: int, acceptance: float, depth: int,
                kv_budget: int, kv_per_request: Sequence[int], kv_sharing: int = 0,
                dtype: str = "bf16", engine: EngineOverheads | None = None,
                placement: StreamPlacement | None = None, exits: StreamExits | None = None
                ) -> tuple[list[dict], float]:
    """Each request's arrival, first token and finish as ``schedule`` serves the stream step by
    step, and the mean number of sequences per step (weighed by the steps' time)."""
    engine = engine or EngineOverheads()
    elapsed = elapsed_times(model, hw, schedule, requests, acceptance=acceptance, depth=depth,
                            kv_sharing=kv_sharing, dtype=dtype, max_batch=max_batch,
                            engine=engine, placement=placement, exits=exits)
    readouts = stream_readouts(schedule, depth, exits)
    prefill = _Prefills(model, hw, depth, dtype, kv_sharing, readouts, placement, engine=engine)
    served = [{"arrival_s": r.arrival_s, "output_tokens": r.output_tokens} for r in requests]
    ready = [r.arrival_s + engine.request_s for r in requests]
    running: dict[int, list[int]] = {}  # request -> [tokens still to commit, its context]
    now, reserved, waiting, busy, weighed, woke = 0.0, 0, 0, 0.0, 0.0, 0.0
    step_began = None  # where the step a newcomer arrived in began (none: not decoding then)

    def startable(taken: int) -> bool:  # the next in line has arrived, with a place and KV
        return (waiting < len(requests) and taken < max_batch and ready[waiting] <= now
                and reserved + kv_per_request[waiting] <= kv_budget)

    while waiting < len(requests) or running:
        newcomers = []
        while startable(len(running) + len(newcomers)):
            newcomers.append(waiting)
            reserved += kv_per_request[waiting]
            waiting += 1
        if newcomers:
            # a newcomer arriving mid-step starts its prefill at the next call, which the steps
            # do not hold: its first token as if it started at its arrival (the running ones'
            # step, which in fact ends after that prefill, is counted as ended before it)
            early = max(0.0, now - max(step_began, *(ready[i] for i in newcomers))) if (
                step_began is not None) else 0.0
            step_began = None
            took = prefill.step([requests[i].prompt_tokens for i in newcomers]) + woke
            woke = 0.0  # the first step after an idle runs the slower
            busy, weighed, now = busy + took, weighed + took * len(newcomers), now + took
            for i in newcomers:
                served[i]["first_token_s"] = now - early
                running[i] = [requests[i].output_tokens - 1, requests[i].prompt_tokens + 1]
            reserved -= finish(running, served, now, kv_per_request)
            if startable(len(running)):
                continue  # one arrived during the prefill: its prefill before the next round
        if not running:
            if waiting < len(requests) and not newcomers:
                if ready[waiting] <= now:  # nothing runs, and the next one's KV cannot fit
                    raise ValueError(f"request {waiting} needs more KV than the engine has")
                woke, now = engine.wake_after(now, ready[waiting]), ready[waiting]
            continue
        # decode until a sequence finishes, or past the next arrival that could start
        b = len(running)
        context = round(np.mean([c for _, c in running.values()]))
        arrives = waiting < len(requests) and b < max_batch and ready[waiting] > now
        line = elapsed[b - 1]
        steps, took = decoding_run(line, context, min(left for left, _ in running.values()),
                                   ready[waiting] - now if arrives else None)
        # cut by an arrival: where its step began, for the newcomer's first token
        step_began = now + took - float(line[context + steps] - line[context + steps - 1]) if (
            arrives and steps) else None
        busy, weighed, now = busy + took, weighed + took * b, now + took
        for state in running.values():
            state[0] -= steps
            state[1] += steps
        reserved -= finish(running, served, now, kv_per_request)
    return served, weighed / busy if busy else 0.0


def finish(running: dict[int, list[int]], served: list[dict], now: float,
           kv_per_request: Sequence[int]) -> int:
    """The sequences with no token left finish now: their KV given back (its bytes)."""
    done = [i for i, (left, _) in running.items() if left <= 0]
    for i in done:
        served[i]["finish_s"] = now
        del running[i]
    return sum(kv_per_request[i] for i in done)
