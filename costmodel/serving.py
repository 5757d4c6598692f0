"""Serving: a stream of requests through one engine, simulated call by call
(``costmodel.stream_calls``; step by step: ``costmodel.stream``, ``costmodel.stream_vllm``).

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
from .stream import StreamExits, stream_readouts
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
    mean_exit_depth: float | None = None  # with exits: the depth a token stops at, on average
    # each request, in the stream's order (keep_served); never in the result's JSON
    served: list[Served] | None = Field(default=None, exclude=True)


FIDELITIES = ("calls", "steps")


def serve(model: LoopedModelSpec, hw: HardwareSpec, schedule: Schedule,
          requests: Sequence[Request], *, max_batch: int, acceptance: float, depth: int,
          kv_sharing: int = 0, dtype: str = "bf16", kv_budget: int | None = None,
          seed: int = 0, engine: EngineOverheads | None = None, fidelity: str = "calls",
          token_budget: int | None = None, stats: dict | None = None,
          placement: StreamPlacement | None = None, exits: StreamExits | None = None,
          on_served: Callable[[], None] | None = None) -> tuple[list[Served], float]:
    """Each request as ``schedule`` serves the stream (drafts accepted at ``acceptance``, drawn
    per request from ``seed``), and the mean number of sequences per call. ``engine``: the
    engine's own time, a step's shared by the tokens it commits (one per running sequence: an
    AR round's, a share of one for a WFD tick that commits some sequences' tokens), paid with
    the call that commits them; a request's before it reaches the line. ``fidelity``: "calls"
    (simulated call by call) or "steps" (a step at a time from the closed forms:
    ``costmodel.stream``); with ``token_budget``, steps scheduled as vLLM's (chunked prefills,
    KV taken as tokens come, preemption: ``costmodel.stream_vllm``; ``stats`` gets how many
    preemptions). ``placement``: the parts on devices of their own, step by step
    (``costmodel.placement.StreamPlacement``). ``exits``: each token's depth drawn from an
    exit profile, step by step (``costmodel.stream.StreamExits``). ``on_served``: called as
    each request is done, call by call (a progress bar's; a stream of steps takes no time)."""

    if exits is not None and (fidelity != "steps" or placement is not None):
        raise ValueError("exits in a stream are priced step by step on one device (or tensor "
                         "parallel): give fidelity steps (--fidelity steps), without a "
                         "placement")
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
    readouts = stream_readouts(schedule, depth, exits)  # coda slots a token holds
    if token_budget is not None:
        if fidelity != "steps":
            raise ValueError("a token budget schedules steps as vLLM does: give fidelity steps")
        if token_budget < 1:
            raise ValueError(f"the token budget must be at least 1, got {token_budget}")
        from .stream_vllm import serve_vllm_steps

        kv_needs(model, schedule, requests, depth=depth, dtype=dtype, kv_sharing=kv_sharing,
                 kv_budget=kv_budget, readouts=readouts)  # a request that never fits: refused
        served, mean_batch, preempted = serve_vllm_steps(
            model, hw, schedule, requests, max_batch=max_batch, acceptance=acceptance,
            depth=depth, kv_budget=kv_budget, token_budget=token_budget, kv_sharing=kv_sharing,
            kv_per_token=kv_per_token(model, schedule, depth=depth, dtype=dtype,
                                      kv_sharing=kv_sharing, readouts=readouts),
            dtype=dtype, engine=engine, exits=exits)
        if stats is not None:
            stats["preemptions"] = preempted
        return [Served(**s) for s in served], mean_batch
    if fidelity == "steps":
        from .stream import serve_steps

        needs = kv_needs(model, schedule, requests, depth=depth, dtype=dtype,
                         kv_sharing=kv_sharing, kv_budget=kv_budget, readouts=readouts)
        served, mean_batch = serve_steps(
            model, hw, schedule, requests, max_batch=max_batch, acceptance=acceptance,
            depth=depth, kv_budget=kv_budget, kv_per_request=needs, kv_sharing=kv_sharing,
            dtype=dtype, engine=engine, placement=placement, exits=exits)
        return [Served(**s) for s in served], mean_batch
    from .stream_calls import serve_calls

    served, mean_batch = serve_calls(model, hw, schedule, requests, max_batch=max_batch,
                                     acceptance=acceptance, depth=depth, kv_sharing=kv_sharing,
                                     dtype=dtype, kv_budget=kv_budget, seed=seed,
                                     engine=engine or EngineOverheads(), on_served=on_served)
    return [Served(**s) for s in served], mean_batch


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
                     width: int | None = None, block_length: int | None = None,
                     exits: StreamExits | None = None, only: Sequence[str] | None = None
                     ) -> tuple[dict[str, Schedule], float]:
    """Each registered schedule at the variant ``predict`` finds best for the stream's mean
    request at a full batch (at batch 1 where a full batch of it does not fit), and the
    acceptance its drafts are verified at; with ``exits``, with those exits (the drafts
    verified those of positions that go past d). ``only``: the schedules to choose
    (``predict``'s; default all)."""
    from .predict import acceptance_for, predict, resolve_draft_depth
    from .schedules import get

    typical = {"context_length": round(np.mean([r.prompt_tokens for r in requests])),
               "new_tokens": round(np.mean([r.output_tokens for r in requests])),
               "dtype": dtype, "depth": depth, "kv_sharing": kv_sharing,
               "acceptance": acceptance, **(exits.fields if exits else {})}
    options = {"width": width, "draft_depth": draft_depth, "block_length": block_length,
               "only": only}
    best = predict(model, hw, {**typical, "batch_size": max_batch}, **options)
    if not best.memory.fits:
        best = predict(model, hw, typical, **options)
    if not best.memory.fits:
        from .memory import does_not_fit

        raise ValueError(f"the stream's mean request: {does_not_fit(best.memory, best.workload)}")
    d = resolve_draft_depth(model, depth, width, draft_depth)
    alpha = float(exits.profile.acceptance(d)) if exits else acceptance_for(
        model, Workload(**typical), depth, d)
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
                    placement: str | None = None, keep_served: bool = False,
                    exits: dict | None = None, continuous_depth: bool = False,
                    on_served: Callable[[], None] | None = None
                    ) -> dict[str, ServingResult]:
    """Each schedule (``names``: those of the registry to run; default all) serving the
    stream; on ``tensor_parallel`` devices joined by ``link`` (``costmodel.parallel.split``),
    or with its parts placed on devices of their own by ``placement`` (a layout of
    ``costmodel.placement.LAYOUTS``), joined by ``link``. ``keep_served``: each result keeps
    its requests as served. ``exits``: adaptive depth, as a ``Workload``'s exit fields
    (``exit_depths``, or ``depth_trace`` with ``exit_rule``), priced step by step, the
    tokens of a batch in step or, ``continuous_depth``, each at its own depth (the plugin's
    exit mode on vLLM); only the schedules with a closed form under exits (AR, DtV) by
    default. ``on_served``: ``serve``'s, for every schedule's stream."""
    from .predict import resolve_draft_depth

    check_fits(requests, model.max_position_embeddings)
    model, hw = split(model, hw, tensor_parallel, None if placement else link)
    placed = None if placement is None else StreamPlacement(
        placement, placed_link(hw, placement, link))
    depth = depth or model.default_depth
    stream_exits = StreamExits.of(model, exits, depth, resolve_draft_depth(
        model, depth, width, draft_depth), acceptance, continuous_depth) if exits else None
    if stream_exits is not None:  # those with a closed form under exits (WFD is simulated)
        names = stream_exits.schedules(names)
    schedules, alpha = chosen_schedules(
        model, hw, requests, max_batch=max_batch, depth=depth, dtype=dtype,
        kv_sharing=kv_sharing, acceptance=acceptance, draft_depth=draft_depth, width=width,
        block_length=block_length, exits=stream_exits, only=names if exits else None)
    results = {}
    for name, schedule in schedules.items():
        if names is not None and name not in names:
            continue
        stats: dict = {}
        served, mean_batch = serve(model, hw, schedule, requests, max_batch=max_batch,
                                   acceptance=alpha, depth=depth, kv_sharing=kv_sharing,
                                   dtype=dtype, seed=seed, engine=engine, fidelity=fidelity,
                                   token_budget=token_budget, stats=stats, placement=placed,
                                   exits=stream_exits, on_served=on_served)
        results[name] = summarize(schedule, served, mean_batch, slo_ttft_s=slo_ttft_s,
                                  slo_tpot_s=slo_tpot_s, preemptions=stats.get("preemptions"))
        if keep_served:
            results[name].served = served
        if stream_exits is not None:
            results[name].mean_exit_depth = float(stream_exits.profile.mean_depth)
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
