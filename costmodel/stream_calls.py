"""A stream of requests served call by call (``costmodel.serving.serve``'s "calls" fidelity,
its default): every request runs its schedule's plan, merged with the others' calls as the
batched decoder merges them (``costmodel.batching``), each call priced by the calibrated
per-call cost on the engine's clock."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .admission import kv_needs
from .engines import EngineOverheads
from .hardware import HardwareSpec
from .model import LoopedModelSpec
from .requests import Request
from .schedules.base import Schedule
from .trace import CallRecord


def serve_calls(model: LoopedModelSpec, hw: HardwareSpec, schedule: Schedule,
                requests: Sequence[Request], *, max_batch: int, acceptance: float, depth: int,
                kv_sharing: int, dtype: str, kv_budget: int, seed: int,
                engine: EngineOverheads, on_served: Callable[[], None] | None = None
                ) -> tuple[list[dict], float]:
    """Each request's arrival, first token and finish, and the mean number of sequences per
    call (weighed by the calls' time); ``on_served`` is called as each request is done (a
    progress bar's)."""
    from .batching import run_batch

    stream = _Stream(model, hw, schedule, requests, acceptance=acceptance, depth=depth,
                     kv_sharing=kv_sharing, dtype=dtype, kv_budget=kv_budget, seed=seed,
                     engine=engine, on_served=on_served)
    run_batch(list(range(len(requests))), max_batch, stream.start, stream.run_call,
              stream.finish, stream.admit)
    clock = stream.clock
    clock.settle()
    mean_batch = clock.sequence_s / clock.busy_s if clock.busy_s else 0.0
    return [stream.served[i] for i in range(len(requests))], mean_batch


# calls priced at most this many at a time: a saturated stream, with no place free for a
# newcomer, may go long between the moments that need the time, and its calls held till then
# grew with the stream (millions for 10,000 requests)
SETTLE_EVERY = 4096
# at most this many calls held unpriced while a request waits for its arrival: within them the
# longest call of a shape stands for its next ones (their contexts grow little meanwhile)
BOUND_CALLS = 64


def _shape(record: CallRecord) -> tuple[str, int]:
    return record.kind, len(record.positions)


@dataclass
class _Clock:
    """The engine's time. Calls are priced in runs (one vectorized pricing per run) when the
    time is needed; what waits on a call's end (a first token, a finish) is set then."""

    model: LoopedModelSpec
    hw: HardwareSpec
    dtype: str
    now: float = 0.0
    busy_s: float = 0.0
    sequence_s: float = 0.0  # sum over calls of their time x the sequences they serve

    def __post_init__(self):
        self.pending: list[tuple[CallRecord, int, float]] = []
        # the longest call priced yet of each shape (part, positions), the engine's time apart
        self.longest: dict[tuple[str, int], float] = {}
        self.marks: list[tuple[int, Callable[[float], None]]] = []
        self.previous: str | None = None
        self.woke = 0.0  # the wake the next call pays, after an idle

    def add(self, record: CallRecord, sequences: int, engine_s: float = 0.0) -> None:
        """A call over ``sequences`` sequences, and ``engine_s`` of the engine's own time with
        it."""
        if len(self.pending) >= SETTLE_EVERY:
            self.settle()
        self.pending.append((record, sequences, engine_s + self.woke))
        self.woke = 0.0

    def passed(self, time: float) -> bool:
        """Whether ``time`` has passed by the end of the calls added so far. A stream's next
        arrival, mostly well ahead, is checked before every call, and pricing a run of calls
        at once is what keeps the stream fast: the calls are priced for it only where they may
        reach it, each taken at most twice as long as the longest priced yet of its shape
        (part and positions), with the engine's time it carries (one of a shape not priced yet,
        or more than ``BOUND_CALLS`` of them: priced)."""
        if time <= self.now:
            return True
        if len(self.pending) <= BOUND_CALLS:
            bounds = [self.longest.get(_shape(r)) for r, _, _ in self.pending]
            if None not in bounds and time > self.now + 2 * sum(bounds) + sum(
                    engine for _, _, engine in self.pending):
                return False
        return time <= self.settle()

    def extend_last(self, engine_s: float) -> None:
        """``engine_s`` more of the engine's time with the last call added."""
        if engine_s and self.pending:
            record, sequences, before = self.pending[-1]
            self.pending[-1] = (record, sequences, before + engine_s)

    def at_end(self, setter: Callable[[float], None]) -> None:
        """``setter(time)`` once the last call added is priced (now, where none waits)."""
        if self.pending:
            self.marks.append((len(self.pending) - 1, setter))
        else:
            setter(self.now)

    def settle(self) -> float:
        from .simulate import price_records

        if self.pending:
            records = [r for r, _, _ in self.pending]
            price_records(self.model, self.hw, records, dtype=self.dtype, before=self.previous)
            walls = np.array([r.wall_s + engine for r, _, engine in self.pending])
            for record in records:
                shape = _shape(record)
                self.longest[shape] = max(self.longest.get(shape, 0.0), record.wall_s)
            ends = self.now + np.cumsum(walls)
            for index, setter in self.marks:
                setter(float(ends[index]))
            self.busy_s += float(walls.sum())
            self.sequence_s += float(walls @ np.array([n for _, n, _ in self.pending]))
            self.now, self.previous = float(ends[-1]), records[-1].kind
            self.pending.clear()
            self.marks.clear()
        return self.now

    def idle_until(self, time: float, engine: EngineOverheads) -> None:
        """Nothing to do until ``time``; then the engine's wake from that idle, paid by the
        call that follows."""
        self.settle()
        if time > self.now:  # after a pause a call stands alone
            self.woke, self.now, self.previous = engine.wake_after(self.now, time), time, None


class _Stream:
    """``serve``'s run: ``run_batch``'s hooks over the stream's requests (by index), the
    engine's clock, and the KV each running request holds."""

    def __init__(self, model: LoopedModelSpec, hw: HardwareSpec, schedule: Schedule,
                 requests: Sequence[Request], *, acceptance: float, depth: int,
                 kv_sharing: int, dtype: str, kv_budget: int, seed: int,
                 engine: EngineOverheads, on_served: Callable[[], None] | None = None):
        self.model, self.schedule, self.requests = model, schedule, requests
        self.acceptance, self.depth, self.seed = acceptance, depth, seed
        self.kv_sharing = kv_sharing
        self.engine, self.kv_budget = engine, kv_budget
        self.graphs = hw.graphs.cuda_graphs
        self.clock = _Clock(model, hw, dtype)
        self.served: dict[int, dict[str, float]] = {}
        self.reserved: dict[int, int] = {}
        self.accounted: dict[int, int] = {}  # committed tokens whose engine time is counted
        self.ticks = self.committed = 0  # block calls and tokens so far, for the engine's share
        self.last_call_lanes = 1
        self.on_served = on_served
        self.needs = kv_needs(model, schedule, requests, depth=depth, dtype=dtype,
                              kv_sharing=kv_sharing, kv_budget=kv_budget)

    def admit(self, i: int, lanes) -> bool:
        clock, arrives = self.clock, self.requests[i].arrival_s + self.engine.request_s
        if not lanes:
            clock.idle_until(arrives, self.engine)
        elif not clock.passed(arrives):  # by the end of the calls so far: the batch path
            return False  # admits a newcomer before any call, mid-round too, as wfd's does
        if sum(self.reserved.values()) + self.needs[i] > self.kv_budget:
            return False
        self.reserved[i] = self.needs[i]
        return True

    def start(self, i: int, region: int):
        from .simulate import _Simulator, acceptance_draws

        r = self.requests[i]
        plan = self.schedule.plan(r.prompt_tokens, self.depth,
                                  coda_attends=self.model.coda_layers > 0)
        accept = acceptance_draws(self.acceptance, r.output_tokens + 64, self.seed + i)
        self.served[i] = {"arrival_s": r.arrival_s, "output_tokens": r.output_tokens}
        return _Simulator(plan, self.kv_sharing, accept, r.output_tokens, records=False,
                          static=self.graphs), plan

    def run_call(self, lanes) -> None:
        from .batching import PREFILL, merged_call
        from .slots import call_slots, keys_read

        kind, positions, depths, regions = merged_call(lanes)
        prefill = lanes[0].round == PREFILL
        # the engine's time for the tokens committed: a prefill's first with its last call (in
        # its TTFT), the others before the sequence's next call (or with its last, ``finish``)
        tokens = len(lanes) if prefill and kind == "coda" and self.depth in depths else 0
        for lane in lanes if not prefill else ():
            tokens += self.committed_since(lane)
        self.ticks += kind == "block" and not prefill
        self.committed += tokens
        self.clock.add(CallRecord.model_construct(
            kind=kind, positions=positions, depths=depths,
            contexts=keys_read(positions, self.graphs and not prefill),
            slots=call_slots(kind, depths, self.kv_sharing), sequences=regions, wall_s=0.0),
            len(lanes), tokens * self.engine_per_token(len(lanes))
            + (self.engine.per_tick_s(len(lanes)) if kind == "block" and self.schedule.drafts
               else 0.0) + (self.engine.prompt_s if prefill and tokens else 0.0))
        self.last_call_lanes = len(lanes)
        if prefill:  # the last prefill call's end is the first token's time
            for lane in lanes:
                self.clock.at_end(lambda t, i=lane.job: self.served[i].__setitem__(
                    "first_token_s", t))

    def finish(self, lane) -> None:
        self.reserved.pop(lane.job)
        self.clock.extend_last(self.committed_since(lane)
                               * self.engine_per_token(self.last_call_lanes))
        self.clock.at_end(lambda t, i=lane.job: self.served[i].__setitem__("finish_s", t))
        if self.on_served is not None:
            self.on_served()

    def committed_since(self, lane) -> int:
        """Tokens the sequence committed since this was last asked (its prefill's counted)."""
        now = lane.executor.result.committed_tokens
        before, self.accounted[lane.job] = self.accounted.get(lane.job, 1), now
        return now - before

    def engine_per_token(self, sequences: int) -> float:
        """A token's share of the engine's step (of ``sequences`` sequences), and of its
        sequence's."""
        return self.engine.per_token_s(sequences, self.schedule.drafts,
                                       self.ticks * sequences / max(1, self.committed),
                                       self.depth)
