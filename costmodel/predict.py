"""Per-token latency of AR, DtV and WFD from the closed forms, for one point (``predict``) or for
arrays of points (``sweep``). Both price the same call groups with the same per-call cost.

A batch's closed form is its steady state: B sequences, each in its own schedule's steady
state, every call serving all B. A finite run of prompts (``Workload.prompts``) ends with the
batch emptying: its last sequences decode in ever smaller batches, and a batch of DtV or WFD
sequences waits for its unluckiest. ``predict`` then simulates the run call by call
(``simulate.simulate_batch``), with each prompt's draft outcomes drawn as a forced-acceptance
decode draws them (prompt i: seed i), and reports the run's figures."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from .cost import call_cost
from .engines import EngineOverheads
from .groups import CallGroup, basis_value, block_calls_per_token, merge_groups
from .hardware import HardwareSpec
from .memory import MemoryReport, kv_cache_bytes, memory_report
from .model import LoopedModelSpec
from .plans import check_draft_depth
from .presets import resolve
from .schedules import AR, SCHEDULES, WFD, DtV, Schedule, widest
from .schedules.dtv import MAX_BLOCK_LENGTH
from .slots import check_kv_sharing, mean_decode_keys
from .specs import DTYPE_BYTES
from .workload import Workload

# the most tokens a finite run may simulate (prompts x new tokens), for the three schedules: a
# minute or two on a laptop's CPU; a run longer than this is near enough its steady state
MAX_SIMULATED_TOKENS = 100_000
_TERMS = ("weights_s", "kv_s", "compute_s", "overhead_s")


class Breakdown(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    weights_s: float
    kv_s: float
    compute_s: float
    overhead_s: float


class ScheduleResult(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    schedule: str  # its name in the registry (costmodel.schedules)
    latency_per_token_s: float
    tokens_per_s: float
    speedup_vs_ar: float
    block_calls_per_token: float
    draft_depth: int | None
    width: int | None
    width_cap: int | None = None
    block_length: int | None
    acceptance: float | None
    breakdown: Breakdown
    roofline_fraction: float
    bound: Literal["bandwidth", "compute", "overhead"]
    prefill_s: float
    # the static KV cache this schedule's run allocates (sequence + its lookahead), what
    # `wfd generate --json` reports as kv_bytes_allocated
    kv_bytes: int
    # adaptive depth: the mean depth a token stops at (None: every token runs R steps)
    mean_exit_depth: float | None = None


class Prediction(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    model: str
    hardware: HardwareSpec
    workload: Workload
    depth: int
    memory: MemoryReport
    schedules: dict[str, ScheduleResult]


class _Pricer:
    """Prices call groups over broadcast arrays, computing each distinct call shape once."""

    def __init__(self, model: LoopedModelSpec, hw: HardwareSpec, dtype: str,
                 mean_context: np.ndarray, batch: np.ndarray, bandwidth: np.ndarray | None):
        self.model, self.hw, self.dtype = model, hw, dtype
        self.context, self.batch, self.bandwidth = mean_context, batch, bandwidth
        self.parts = model.parts
        self._memo: dict[tuple[str, int, int, bool], tuple[np.ndarray, ...]] = {}

    def shape_cost(self, part: str, positions: int, slots: int, after_other_part: bool
                   ) -> tuple[np.ndarray, ...]:
        key = (part, positions, slots, after_other_part)
        if key not in self._memo:
            n = self.batch * positions
            c = call_cost(self.model, self.hw, self.parts[part], self.dtype, n_positions=n,
                          n_slots=slots, context_sum_positions=n * self.context,
                          context_sum_slots=self.batch * slots * self.context,
                          bandwidth_bytes_per_s=self.bandwidth, key_sets=self.batch * slots,
                          after_other_part=after_other_part)
            self._memo[key] = (c.weights_s, c.kv_s, c.compute_s, c.overhead_s, c.ideal_s)
        return self._memo[key]

    def per_token(self, groups: list[CallGroup], alpha: np.ndarray) -> dict[str, np.ndarray]:
        alpha = np.asarray(alpha, dtype=float)
        bases: dict[tuple, np.ndarray] = {}
        totals = {k: 0.0 for k in (*_TERMS, "ideal_s")}
        for g in merge_groups(groups):
            if g.basis not in bases:
                bases[g.basis] = basis_value(g.basis, alpha)
            w = g.count * bases[g.basis]
            for key, value in zip((*_TERMS, "ideal_s"),
                                  self.shape_cost(g.part, g.positions, g.slots,
                                                  g.after_other_part), strict=True):
                totals[key] = totals[key] + w * value
        totals["latency_s"] = sum(totals[k] for k in _TERMS)
        return totals

    def basis_latency(self, groups: list[CallGroup]) -> dict[tuple, np.ndarray]:
        """The latency of a schedule's calls grouped by basis, before acceptance weighs them:
        per token, sum over bases of ``basis_latency[b] * basis_value(b, alpha)``."""
        out: dict[tuple, np.ndarray] = {}
        for g in merge_groups(groups):
            cost = self.shape_cost(g.part, g.positions, g.slots, g.after_other_part)
            out[g.basis] = out.get(g.basis, 0.0) + g.count * sum(cost[:len(_TERMS)])
        return out


def _bound(b: dict[str, float]) -> Literal["bandwidth", "compute", "overhead"]:
    terms = {"bandwidth": b["weights_s"] + b["kv_s"], "compute": b["compute_s"],
             "overhead": b["overhead_s"]}
    return max(terms, key=terms.__getitem__)  # type: ignore[return-value]


def prefill_time_s(model: LoopedModelSpec, hw: HardwareSpec, workload: Workload, depth: int,
                   readout_depths: int) -> float:
    """Prefill of the prompt through P, R block calls and the coda readout(s)."""
    parts = model.parts
    L = workload.context_length
    b = workload.batch_size
    causal = L * (L + 1) / 2  # a prefill runs eagerly in every mode

    def t(part: str, n: int, ctx_sum: float) -> float:
        c = call_cost(model, hw, parts[part], workload.dtype, n_positions=b * n, n_slots=1,
                      context_sum_positions=b * ctx_sum, context_sum_slots=b * L, key_sets=b)
        return float(c.time_s)

    # a coda with attention must fill its KV for every prompt position, once per readout depth
    coda_positions = L if model.coda_layers else 1
    coda_ctx = causal if model.coda_layers else L
    return (t("prelude", L, causal) + depth * t("block", L, causal)
            + readout_depths * t("coda", coda_positions, coda_ctx))


def decode_keys(workload: Workload, hw: HardwareSpec) -> float:
    """The keys a decode step attends over on average, as the hardware's mode reads them."""
    return mean_decode_keys(workload.context_length, workload.new_tokens, hw.graphs.cuda_graphs)


def resolve_draft_depth(model: LoopedModelSpec, depth: int, width: int | None,
                        draft_depth: int | None) -> int:
    if width is not None and draft_depth is not None:
        raise ValueError("give either a width or a draft depth, not both")
    check_draft_depth(1, depth)  # R >= 2: room to draft at all
    if width is not None and not 2 <= width <= depth:  # width 1 drafts at R: nothing to verify
        raise ValueError(f"width must be in 2..{depth} (R = {depth}), got {width}")
    d = model.width_to_draft_depth(width, depth) if width is not None else (
        draft_depth if draft_depth is not None else min(model.default_draft_depth, depth - 1))
    check_draft_depth(d, depth)
    return d


def acceptance_for(spec: LoopedModelSpec, wl: Workload, depth: int, draft_depth: int) -> float:
    """The workload's acceptance: given, read from its depth trace at the draft depth, or the
    model's default."""
    if wl.acceptance is not None:
        return wl.acceptance
    if wl.depth_trace is not None:
        from .trace import read_depth_trace

        trace = read_depth_trace(wl.depth_trace)
        if trace.header.depth != depth:
            raise ValueError(f"the depth trace was recorded at R = {trace.header.depth}, the "
                             f"prediction is for R = {depth}")
        return trace.acceptance(draft_depth)
    return spec.default_acceptance


def predict(
    model: str | LoopedModelSpec = "huginn-3.5b",
    hardware: str | HardwareSpec = "a6000",
    workload: Workload | dict | None = None,
    *,
    width: int | None = None,
    draft_depth: int | None = None,
    block_length: int | None = None,
    width_cap: int | None = None,
    engine: EngineOverheads | None = None,
) -> Prediction:
    """Predict each registered schedule's per-token latency (AR, DtV, WFD) for one model,
    hardware and workload, each at its best variant (``Schedule.variants``).

    width W means draft depth ceil(R / W). block_length None picks DtV's best k in 1..32.
    ``engine``: a serving engine's own time (per step, per tick of a wave), added to each token
    as overhead.
    """
    spec, hw = resolve(model, hardware)
    wl = Workload.model_validate(workload or {})  # a Workload, or its fields as a dict
    depth = wl.depth or spec.default_depth
    d = resolve_draft_depth(spec, depth, width, draft_depth)
    _check_request(wl, depth, block_length, width_cap)
    if wl.adaptive:  # the exits' distribution and wave simulation, imported when asked for
        from .adaptive import exit_profile
        from .simulate import simulate_exits

    exits = exit_profile(spec, wl, depth, d) if wl.adaptive else None
    alpha = np.asarray(acceptance_for(spec, wl, depth, d) if exits is None
                       else exits.acceptance(d))
    hw.achievable_flops_per_s(wl.dtype)  # an unknown dtype fails here with a clear message
    # coda readout depths (coda KV slots, prefill readouts): R, d for a schedule that drafts,
    # and with exits every depth a token may stop at
    exit_reads = set(range(exits.exits.min_depth, depth + 1)) if exits else set()
    options = {"block_length": block_length, "width_cap": width_cap}
    positions, ahead = widest(depth, d, **options)
    memory = memory_report(spec, hw, wl, depth=depth, readout_depths=len({depth, d} | exit_reads),
                           positions_per_call=positions, lookahead=ahead)

    pricer = _Pricer(spec, hw, wl.dtype, np.asarray(decode_keys(wl, hw)),
                     np.asarray(float(wl.batch_size)), None)
    results: dict[str, ScheduleResult] = {}
    if not memory.fits:
        return Prediction(model=spec.name, hardware=hw, workload=wl, depth=depth, memory=memory,
                          schedules=results)
    # the acceptance the verifier sees: of the drafts of positions that go past d
    seen = float(alpha) if exits is None else exits.draft_acceptance(d)

    def priced(schedule: Schedule) -> tuple[list[CallGroup], dict]:
        """Its call groups (none where it is simulated) and their totals per token."""
        groups = schedule.call_groups(depth, wl.kv_sharing) if exits is None \
            else schedule.exit_groups(exits)
        if groups is not None:
            return groups, pricer.per_token(groups, alpha)
        latency, breakdown, ideal, blocks, decoded = simulate_exits(spec, hw, schedule, wl, depth,
                                                                    exits)
        return [], {**{key: v / decoded for key, v in breakdown.items()},
                    "latency_s": latency / decoded, "ideal_s": ideal / decoded,
                    "block_calls": blocks / decoded}

    chosen: dict[str, Schedule] = {}
    for name, kind in SCHEDULES.items():
        best = min(((s, *priced(s)) for s in kind.variants(d, depth, **options)),
                   key=lambda f: float(f[2]["latency_s"]))
        schedule, groups, totals = best
        chosen[name] = schedule
        readouts = len({depth} | exit_reads | ({d} if schedule.drafts else set()))
        results[name] = _result(spec, hw, wl, depth, schedule, groups, alpha, totals, readouts,
                                mean_exit_depth=exits.mean_depth if exits else None,
                                acceptance=seen if schedule.drafts else None)
    if wl.prompts is not None:
        for name, schedule in chosen.items():
            _finite_run(spec, hw, wl, depth, schedule, float(alpha), results[name])
    _with_speedups(results, engine, wl.batch_size, depth)
    return Prediction(model=spec.name, hardware=hw, workload=wl, depth=depth, memory=memory,
                      schedules=results)


def _check_request(wl: Workload, depth: int, block_length: int | None,
                   width_cap: int | None) -> None:
    """Refuse what ``predict`` cannot price, in one line."""
    if block_length is not None and block_length < 1:
        raise ValueError(f"block length must be at least 1, got {block_length}")
    if width_cap is not None and width_cap < 1:
        raise ValueError(f"width cap must be at least 1, got {width_cap}")
    check_kv_sharing(wl.kv_sharing, depth)
    if wl.prompts is not None and wl.prompts * wl.new_tokens > MAX_SIMULATED_TOKENS:
        raise ValueError(f"{wl.prompts} prompts x {wl.new_tokens} new tokens = "
                         f"{wl.prompts * wl.new_tokens:,} tokens to simulate, more than "
                         f"{MAX_SIMULATED_TOKENS:,}; a run this long is the steady state (leave "
                         "out the prompts)")


def _result(spec: LoopedModelSpec, hw: HardwareSpec, wl: Workload, depth: int,
            schedule: Schedule, groups: list[CallGroup], alpha, totals: dict, readouts: int,
            **reported) -> ScheduleResult:
    """A schedule's prediction from its call groups (none where it was simulated) and totals per
    token (speedup filled in against AR's later), with the prefill and KV cache of its
    ``readouts`` coda readout depths, and what else is ``reported`` (its acceptance, the mean
    exit depth)."""
    latency = float(totals["latency_s"])
    block_calls = float(block_calls_per_token(groups, alpha)) if groups \
        else float(totals["block_calls"])
    terms = {k: float(totals[k]) for k in _TERMS}
    return ScheduleResult(
        schedule=schedule.name, latency_per_token_s=latency,
        tokens_per_s=wl.batch_size / latency, speedup_vs_ar=1.0,
        block_calls_per_token=block_calls, breakdown=Breakdown(**terms),
        roofline_fraction=float(totals["ideal_s"]) / latency, bound=_bound(terms),
        prefill_s=prefill_time_s(spec, hw, wl, depth, readouts),
        kv_bytes=kv_cache_bytes(spec, wl, depth=depth, readout_depths=readouts,
                                lookahead=schedule.lookahead(depth),
                                static=hw.graphs.cuda_graphs),
        **schedule.fields(depth), **reported)


def _with_speedups(results: dict[str, ScheduleResult], engine: EngineOverheads | None,
                   batch: int, depth: int) -> None:
    """The engine's time (where given) added to each token as overhead: its step's share (a
    drafting schedule's step commits several tokens of each sequence) and a drafting
    schedule's ticks; speedups."""
    for name, r in results.items() if engine is not None else ():
        drafts = r.draft_depth is not None
        ticks = r.block_calls_per_token
        own = batch * engine.per_token_s(batch, drafts, ticks, depth) + (
            engine.per_tick_s(batch) * ticks if drafts else 0.0)
        latency = r.latency_per_token_s + own
        terms = {**r.breakdown.model_dump(), "overhead_s": r.breakdown.overhead_s + own}
        results[name] = r.model_copy(update={
            "latency_per_token_s": latency, "tokens_per_s": batch / latency,
            "breakdown": Breakdown(**terms), "bound": _bound(terms),
            "roofline_fraction": r.roofline_fraction * r.latency_per_token_s / latency})
    baseline = results[AR.name].latency_per_token_s
    for r in results.values():
        r.speedup_vs_ar = baseline / r.latency_per_token_s


def _finite_run(spec: LoopedModelSpec, hw: HardwareSpec, wl: Workload, depth: int,
                schedule: Schedule, alpha: float, result: ScheduleResult) -> None:
    """Replace a schedule's steady-state figures with those of the workload's finite run of
    prompts, simulated call by call (DtV at the steady state's best k)."""
    from .simulate import acceptance_draws, simulate_batch

    sequences = [(wl.context_length, wl.new_tokens,
                  acceptance_draws(alpha, wl.new_tokens + 1, i) if schedule.drafts else None)
                 for i in range(wl.prompts)]
    run = simulate_batch(spec, hw, schedule, sequences, batch_size=wl.batch_size, depth=depth,
                         kv_sharing=wl.kv_sharing, dtype=wl.dtype)
    # per token of one sequence, as the steady state counts: the batch's time over its tokens,
    # times the batch
    per_token = wl.batch_size / run.decode_tokens
    breakdown = {k: run.breakdown_s[k] * per_token for k in _TERMS}
    result.latency_per_token_s = run.latency_s * per_token
    result.tokens_per_s = run.tokens_per_s
    result.block_calls_per_token = run.block_calls * per_token
    result.breakdown = Breakdown(**breakdown)
    result.roofline_fraction = run.ideal_s / run.latency_s
    result.bound = _bound(breakdown)


def _check_grid(depth: int, w, a, ctx, bwa, b, new_tokens: int, block_lengths: range,
                dtype: str) -> None:
    """Refuse a sweep's impossible points (each test as "not (valid)", so that NaN is refused
    too)."""
    for bad, what in ((depth < 2, f"depth R must be at least 2, got {depth}"),
                      (np.any(~((w >= 2) & (w <= depth))), f"width must be in 2..{depth}"),
                      (np.any(~((a >= 0) & (a <= 1))), "acceptance must be in [0, 1]"),
                      (np.any(~(ctx >= 1)), "context must be at least 1 token"),
                      (np.any(~(b >= 1)), "batch must be at least 1"),
                      (np.any(~(bwa > 0)), "bandwidth must be positive"),
                      (new_tokens < 1, f"new tokens must be at least 1, got {new_tokens}"),
                      (not block_lengths or min(block_lengths) < 1,
                       "block lengths must be 1 or more"),
                      (dtype not in DTYPE_BYTES, f"unknown dtype {dtype!r}")):
        if bad:
            raise ValueError(what)


def _best_block_length(pricer: _Pricer, priced, alpha: np.ndarray, draft_depth: int,
                       depth: int, block_lengths: range) -> tuple[np.ndarray, np.ndarray]:
    """DtV's lowest latency per token over ``block_lengths`` at each point of acceptance
    ``alpha``, and the k that gives it (``priced`` reads a round's cost at the points)."""
    best = np.full(alpha.shape, np.inf)
    best_k = np.zeros(alpha.shape)
    tokens = np.ones_like(alpha)  # expected tokens per round: sum_{i <= k} alpha^i
    for k in range(1, max(block_lengths) + 1):
        tokens = 1.0 + alpha * tokens
        if k not in block_lengths:
            continue
        (per_round,) = pricer.basis_latency(
            DtV(block_length=k, draft_depth=draft_depth).call_groups(depth)).values()
        latency = priced(per_round) / tokens
        better = latency < best
        best = np.where(better, latency, best)
        best_k = np.where(better, k, best_k)
    return best, best_k


def sweep(
    model: str | LoopedModelSpec = "huginn-3.5b",
    hardware: str | HardwareSpec = "a6000",
    *,
    width: np.ndarray | int | None = None,
    acceptance: np.ndarray | float | None = None,
    context: np.ndarray | int = 1024,
    bandwidth_bytes_per_s: np.ndarray | float | None = None,
    batch: np.ndarray | int = 1,
    new_tokens: int = 512,
    dtype: str = "bf16",
    kv_sharing: int = 0,
    depth: int | None = None,
    block_lengths: range = range(1, MAX_BLOCK_LENGTH + 1),
) -> dict[str, np.ndarray]:
    """Vectorized predictions over broadcast arrays of width, acceptance, context, bandwidth and
    batch: per-token latencies of AR, DtV (best k per point) and WFD, the speedups, the chosen k and
    the draft depth (memory fit not checked: ``memory_report``). A call's cost depends on context,
    batch and bandwidth, never on acceptance or width, so the calls are priced once over those axes
    (``_Pricer.basis_latency``) and only then weighed by each point's acceptance."""
    spec, hw = resolve(model, hardware)
    depth = depth or spec.default_depth
    alpha = spec.default_acceptance if acceptance is None else acceptance
    width = -(-depth // spec.default_draft_depth) if width is None else width
    bw = hw.roofline.memory_bandwidth_bytes_per_s if bandwidth_bytes_per_s is None else (
        bandwidth_bytes_per_s)
    w, a, ctx, bwa, b = (np.asarray(width), np.asarray(alpha, dtype=float),
                         np.asarray(context, dtype=float), np.asarray(bw, dtype=float),
                         np.asarray(batch, dtype=float))
    shape = np.broadcast_shapes(w.shape, a.shape, ctx.shape, bwa.shape, b.shape)
    check_kv_sharing(kv_sharing, depth)
    _check_grid(depth, w, a, ctx, bwa, b, new_tokens, block_lengths, dtype)
    d = -(-depth // w)
    keys = mean_decode_keys(ctx, new_tokens, hw.graphs.cuda_graphs)
    # calls priced once over the cost axes, unless those vary point by point (a scatter of
    # points): then per draft depth over its own points
    cost_shape = np.broadcast_shapes(ctx.shape, b.shape, bwa.shape)
    per_point = np.prod(cost_shape) * 8 > np.prod(shape)
    shared = None if per_point else _Pricer(spec, hw, dtype, keys, b, bwa)
    # which of the shared costs each point reads
    cost_cells = None if per_point else np.arange(np.prod(cost_shape)).reshape(cost_shape)
    out = {key: np.empty(shape) for key in ("ar_latency_s", "dtv_latency_s", "wfd_latency_s",
                                            "dtv_block_length")}
    for dv in np.unique(d):
        sel = np.broadcast_to(d == dv, shape)
        alpha_sel = np.broadcast_to(a, shape)[sel]

        def on_points(values: np.ndarray, sel: np.ndarray = sel) -> np.ndarray:
            return np.broadcast_to(values, shape)[sel]

        cells = None if per_point else on_points(cost_cells)

        def priced(cost: np.ndarray, cells: np.ndarray | None = cells) -> np.ndarray:
            """A latency at this draft depth's points (a cost over the cost axes read at each
            point's cell: one small gather, not a pass over the whole grid)."""
            if cells is None or not np.ndim(cost):
                return cost
            return np.broadcast_to(cost, cost_shape).ravel()[cells]

        pricer = _Pricer(spec, hw, dtype, on_points(keys), on_points(b), on_points(bwa)) \
            if per_point else shared
        out["ar_latency_s"][sel] = priced(sum(pricer.basis_latency(
            AR().call_groups(depth)).values()))
        out["dtv_latency_s"][sel], out["dtv_block_length"][sel] = _best_block_length(
            pricer, priced, alpha_sel, int(dv), depth, block_lengths)
        wfd = pricer.basis_latency(WFD(draft_depth=int(dv)).call_groups(depth, kv_sharing))
        out["wfd_latency_s"][sel] = sum(priced(cost) * basis_value(basis, alpha_sel)
                                        for basis, cost in wfd.items())
    out["draft_depth"] = np.broadcast_to(d, shape).copy()
    out["dtv_speedup"] = out["ar_latency_s"] / out["dtv_latency_s"]
    out["wfd_speedup"] = out["ar_latency_s"] / out["wfd_latency_s"]
    return out
