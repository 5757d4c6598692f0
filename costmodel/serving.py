"""Serving: a stream of requests through one engine, simulated call by call.

Requests arrive (at a rate, Poisson by default, or at the times a file gives), wait in line,
and start when a place in the batch is free and their KV fits the memory left beside the
weights; each then runs its schedule's plan (AR, DtV or WFD) merged with the others' calls as
the batched decoder merges them (``costmodel.batching``: a newcomer's prefill first, whole, then
decoding rounds in step), and every call is priced by the calibrated per-call cost, so the
engine's time moves call by call. Out come each request's time to first token (TTFT: arrival to
the end of its prefill), time per output token (TPOT: the rest of its tokens over their number)
and end-to-end latency; their percentiles; throughput; and goodput, the requests a second that
meet both latency objectives (SLOs).

How it schedules, and where it departs from vLLM's scheduler: admission is first come first
served at decoding-round boundaries (vLLM: every engine step), a request's whole KV (prompt,
output and its schedule's lookahead) is reserved when it starts, so none is ever preempted
(vLLM reserves as tokens come and preempts when the cache runs out), and prefills run whole
before the round they join (vLLM's chunked prefill splits a long one over steps with a token
budget). Step by step with a token budget, ``costmodel.stream_vllm`` schedules as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .admission import kv_budget_bytes, kv_needs, kv_per_token
from .engines import EngineOverheads
from .hardware import HardwareSpec
from .links import Link
from .model import LoopedModelSpec
from .parallel import split
from .placement import StreamPlacement, placed_link
from .requests import Request, check_fits
from .schedules.base import Schedule
from .trace import CallRecord
from .workload import Workload


class Percentiles(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return cls(mean=float(np.mean(values)), p50=float(p50), p90=float(p90),
                   p99=float(p99))


class Served(BaseModel):
    """One request as served: its times on the engine's clock (seconds from the first
    arrival)."""

    model_config = ConfigDict(extra="forbid")
    arrival_s: float
    first_token_s: float
    finish_s: float
    output_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s


class ServingResult(BaseModel):
    """A schedule serving a stream: latency percentiles, throughput and goodput."""

    model_config = ConfigDict(extra="forbid")
    schedule: str
    options: str  # the schedule's parameters as `wfd generate` takes them
    requests: int
    duration_s: float  # first arrival to last finish
    throughput_tokens_per_s: float
    requests_per_s: float
    ttft_s: Percentiles
    tpot_s: Percentiles
    e2e_s: Percentiles
    mean_batch: float  # sequences per call, averaged over the engine's busy time
    slo_attainment: float | None = None  # the fraction meeting every objective given
    goodput_requests_per_s: float | None = None
    preemptions: int | None = None  # vLLM's scheduling (a token budget): requests preempted
    # each request, in the stream's order (keep_served); never in the result's JSON
    served: list[Served] | None = Field(default=None, exclude=True)


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
        self.marks: list[tuple[int, Callable[[float], None]]] = []
        self.previous: str | None = None
        self.woke = 0.0  # the wake the next call pays, after an idle

    def add(self, record: CallRecord, sequences: int, engine_s: float = 0.0) -> None:
        """A call over ``sequences`` sequences, and ``engine_s`` of the engine's own time with
        it."""
        self.pending.append((record, sequences, engine_s + self.woke))
        self.woke = 0.0

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


FIDELITIES = ("calls", "steps")


def serve(model: LoopedModelSpec, hw: HardwareSpec, schedule: Schedule,
          requests: Sequence[Request], *, max_batch: int, acceptance: float, depth: int,
          kv_sharing: int = 0, dtype: str = "bf16", kv_budget: int | None = None,
          seed: int = 0, engine: EngineOverheads | None = None, fidelity: str = "calls",
          token_budget: int | None = None, stats: dict | None = None,
          placement: StreamPlacement | None = None) -> tuple[list[Served], float]:
    """Each request as ``schedule`` serves the stream (drafts accepted at ``acceptance``, drawn
    per request from ``seed``), and the mean number of sequences per call. ``engine``: the
    engine's own time, a step's shared by the tokens it commits (one per running sequence: an
    AR round's, a share of one for a WFD tick that commits some sequences' tokens), paid with
    the call that commits them; a request's before it reaches the line. ``fidelity``: "calls"
    (simulated call by call) or "steps" (a step at a time from the closed forms:
    ``costmodel.stream``); with ``token_budget``, steps scheduled as vLLM's (chunked prefills,
    KV taken as tokens come, preemption: ``costmodel.stream_vllm``; ``stats`` gets how many
    preemptions). ``placement``: the parts on devices of their own, step by step
    (``costmodel.placement.StreamPlacement``)."""
    from .batching import run_batch

    if max_batch < 1:
        raise ValueError(f"the batch must hold at least 1 sequence, got {max_batch}")
    if fidelity not in FIDELITIES:
        raise ValueError(f"unknown fidelity {fidelity!r}; use {' or '.join(FIDELITIES)}")
    if placement is not None and (fidelity != "steps" or token_budget is not None):
        raise ValueError("a placement is served step by step as this project's engine "
                         "schedules: give fidelity steps (--fidelity steps), without a token "
                         "budget")
    if kv_budget is None:
        kv_budget = kv_budget_bytes(model, hw, dtype, depth, max_batch,
                                    schedule.positions_per_call(depth), schedule, kv_sharing,
                                    placement)
    if token_budget is not None:
        if fidelity != "steps":
            raise ValueError("a token budget schedules steps as vLLM does: give fidelity steps")
        if token_budget < 1:
            raise ValueError(f"the token budget must be at least 1, got {token_budget}")
        from .stream_vllm import serve_vllm_steps

        kv_needs(model, schedule, requests, depth=depth, dtype=dtype, kv_sharing=kv_sharing,
                 kv_budget=kv_budget)  # a request that never fits: refused
        served, mean_batch, preempted = serve_vllm_steps(
            model, hw, schedule, requests, max_batch=max_batch, acceptance=acceptance,
            depth=depth, kv_budget=kv_budget, token_budget=token_budget, kv_sharing=kv_sharing,
            kv_per_token=kv_per_token(model, schedule, depth=depth, dtype=dtype,
                                      kv_sharing=kv_sharing),
            dtype=dtype, engine=engine)
        if stats is not None:
            stats["preemptions"] = preempted
        return [Served(**s) for s in served], mean_batch
    if fidelity == "steps":
        from .stream import serve_steps

        needs = kv_needs(model, schedule, requests, depth=depth, dtype=dtype,
                         kv_sharing=kv_sharing, kv_budget=kv_budget)
        served, mean_batch = serve_steps(
            model, hw, schedule, requests, max_batch=max_batch, acceptance=acceptance,
            depth=depth, kv_budget=kv_budget, kv_per_request=needs, kv_sharing=kv_sharing,
            dtype=dtype, engine=engine, placement=placement)
        return [Served(**s) for s in served], mean_batch
    stream = _Stream(model, hw, schedule, requests, acceptance=acceptance, depth=depth,
                     kv_sharing=kv_sharing, dtype=dtype, kv_budget=kv_budget, seed=seed,
                     engine=engine or EngineOverheads())
    run_batch(list(range(len(requests))), max_batch, stream.start, stream.run_call,
              stream.finish, stream.admit)
    clock = stream.clock
    clock.settle()
    mean_batch = clock.sequence_s / clock.busy_s if clock.busy_s else 0.0
    return [Served(**stream.served[i]) for i in range(len(requests))], mean_batch


class _Stream:
    """``serve``'s run: ``run_batch``'s hooks over the stream's requests (by index), the
    engine's clock, and the KV each running request holds."""

    def __init__(self, model: LoopedModelSpec, hw: HardwareSpec, schedule: Schedule,
                 requests: Sequence[Request], *, acceptance: float, depth: int,
                 kv_sharing: int, dtype: str, kv_budget: int, seed: int,
                 engine: EngineOverheads):
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
        self.needs = kv_needs(model, schedule, requests, depth=depth, dtype=dtype,
                              kv_sharing=kv_sharing, kv_budget=kv_budget)

    def admit(self, i: int, lanes) -> bool:
        clock, arrives = self.clock, self.requests[i].arrival_s + self.engine.request_s
        if not lanes:
            clock.idle_until(arrives, self.engine)
        elif any(lane.calls_in_round for lane in lanes):
            return False  # between rounds only: a newcomer's prefill waits for the round's end
        elif arrives > clock.now and arrives > clock.settle():
            return False
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


def summarize(schedule: Schedule, served: list[Served], mean_batch: float, *,
              slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
              preemptions: int | None = None) -> ServingResult:
    """The stream's figures: percentiles, throughput, and (with objectives) goodput."""
    start = min(s.arrival_s for s in served)
    duration = max(s.finish_s for s in served) - start
    met = None
    if slo_ttft_s is not None or slo_tpot_s is not None:
        met = sum((slo_ttft_s is None or s.ttft_s <= slo_ttft_s)
                  and (slo_tpot_s is None or s.tpot_s <= slo_tpot_s) for s in served)
    return ServingResult(
        schedule=schedule.name, options=schedule.flags(), requests=len(served),
        duration_s=duration,
        throughput_tokens_per_s=sum(s.output_tokens for s in served) / duration,
        requests_per_s=len(served) / duration,
        ttft_s=Percentiles.of([s.ttft_s for s in served]),
        tpot_s=Percentiles.of([s.tpot_s for s in served]),
        e2e_s=Percentiles.of([s.e2e_s for s in served]), mean_batch=mean_batch,
        slo_attainment=None if met is None else met / len(served),
        goodput_requests_per_s=None if met is None else met / duration,
        preemptions=preemptions)


def chosen_schedules(model: LoopedModelSpec, hw: HardwareSpec, requests: Sequence[Request], *,
                     max_batch: int, depth: int, dtype: str, kv_sharing: int = 0,
                     acceptance: float | None = None, draft_depth: int | None = None,
                     width: int | None = None, block_length: int | None = None
                     ) -> tuple[dict[str, Schedule], float]:
    """Each registered schedule at the variant ``predict`` finds best for the stream's mean
    request at a full batch (at batch 1 where a full batch of it does not fit), and the
    acceptance its drafts are verified at."""
    from .predict import acceptance_for, predict, resolve_draft_depth
    from .schedules import get

    typical = {"context_length": round(np.mean([r.prompt_tokens for r in requests])),
               "new_tokens": round(np.mean([r.output_tokens for r in requests])),
               "dtype": dtype, "depth": depth, "kv_sharing": kv_sharing,
               "acceptance": acceptance}
    options = {"width": width, "draft_depth": draft_depth, "block_length": block_length}
    best = predict(model, hw, {**typical, "batch_size": max_batch}, **options)
    if not best.memory.fits:
        best = predict(model, hw, typical, **options)
    if not best.memory.fits:
        from .memory import does_not_fit

        raise ValueError(f"the stream's mean request: {does_not_fit(best.memory, best.workload)}")
    d = resolve_draft_depth(model, depth, width, draft_depth)
    alpha = acceptance_for(model, Workload(**typical), depth, d)
    return {name: get(name).of(r.draft_depth, r.block_length, r.width_cap)
            for name, r in best.schedules.items()}, alpha


def predict_serving(model: LoopedModelSpec, hw: HardwareSpec, requests: Sequence[Request], *,
                    max_batch: int, depth: int | None = None, dtype: str = "bf16",
                    kv_sharing: int = 0, acceptance: float | None = None,
                    draft_depth: int | None = None, width: int | None = None,
                    block_length: int | None = None, slo_ttft_s: float | None = None,
                    slo_tpot_s: float | None = None, names: Sequence[str] | None = None,
                    seed: int = 0, engine: EngineOverheads | None = None,
                    tensor_parallel: int = 1, link: str | Link | None = None,
                    fidelity: str = "calls", token_budget: int | None = None,
                    placement: str | None = None, keep_served: bool = False
                    ) -> dict[str, ServingResult]:
    """Each schedule (``names``: those of the registry to run; default all) serving the
    stream; on ``tensor_parallel`` devices joined by ``link`` (``costmodel.parallel.split``),
    or with its parts placed on devices of their own by ``placement`` (a layout of
    ``costmodel.placement.LAYOUTS``), joined by ``link``. ``keep_served``: each result keeps
    its requests as served."""
    check_fits(requests, model.max_position_embeddings)
    model, hw = split(model, hw, tensor_parallel, None if placement else link)
    placed = None if placement is None else StreamPlacement(
        placement, placed_link(hw, placement, link))
    depth = depth or model.default_depth
    schedules, alpha = chosen_schedules(
        model, hw, requests, max_batch=max_batch, depth=depth, dtype=dtype,
        kv_sharing=kv_sharing, acceptance=acceptance, draft_depth=draft_depth, width=width,
        block_length=block_length)
    results = {}
    for name, schedule in schedules.items():
        if names is not None and name not in names:
            continue
        stats: dict = {}
        served, mean_batch = serve(model, hw, schedule, requests, max_batch=max_batch,
                                   acceptance=alpha, depth=depth, kv_sharing=kv_sharing,
                                   dtype=dtype, seed=seed, engine=engine, fidelity=fidelity,
                                   token_budget=token_budget, stats=stats, placement=placed)
        results[name] = summarize(schedule, served, mean_batch, slo_ttft_s=slo_ttft_s,
                                  slo_tpot_s=slo_tpot_s, preemptions=stats.get("preemptions"))
        if keep_served:
            results[name].served = served
    return results


def highest_rate(meets: Callable[[float], bool], *, start_per_s: float = 1.0,
                 steps: int = 7) -> float | None:
    """The highest request rate at which ``meets(rate)`` holds (the objectives met), to about
    2 ** -steps of itself: doubled (or halved) from ``start_per_s`` to bracket it, then
    bisected; None where even 1/1024 of the start fails."""
    low, high = None, None
    rate = start_per_s
    for _ in range(10):  # bracket it: [low met, high not]
        if meets(rate):
            low = rate
            if high is not None:
                break
            rate *= 2
        else:
            high = rate
            if low is not None:
                break
            rate /= 2
    if low is None:
        return None
    if high is None:
        return low  # met at every rate tried: the engine keeps up with more than these
    for _ in range(steps):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low
