"""Per-token latency of AR, DtV and WFD from the closed forms, for one point (``predict``) or for
arrays of points (``sweep``). Both price the same call groups with the same per-call cost.

A batch's closed form is its steady state: B sequences, each in its own schedule's steady
state, every call serving all B. A finite run of prompts (``Workload.prompts``) ends with the
batch emptying: its last sequences decode in ever smaller batches, and a batch of DtV or WFD
sequences waits for its unluckiest. ``predict`` then simulates the run call by call
(``simulate.simulate_batch``), with each prompt's draft outcomes drawn as a forced-acceptance
decode draws them (prompt i: seed i), and reports the run's figures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from .cost import TERMS, call_cost
from .engines import EngineOverheads
from .groups import CallGroup, basis_value, block_calls_per_token, merge_groups
from .hardware import HardwareSpec
from .links import Link
from .memory import MemoryReport, kv_cache_bytes, memory_report
from .model import LoopedModelSpec
from .parallel import split
from .plans import check_draft_depth
from .presets import resolve
from .schedules import AR, SCHEDULES, Schedule, widest
from .slots import check_kv_sharing, mean_decode_keys, readout_depths
from .workload import Workload

# the most tokens a finite run may simulate (prompts x new tokens), for the three schedules: a
# minute or two on a laptop's CPU; a run longer than this is near enough its steady state
MAX_SIMULATED_TOKENS = 100_000


class Breakdown(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    weights_s: float
    kv_s: float
    compute_s: float
    overhead_s: float
    link_s: float = 0.0  # tensor parallel: the collectives over the devices' link


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
    bound: Literal["bandwidth", "compute", "overhead", "link"]
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
            self._memo[key] = (*(getattr(c, term) for term in TERMS), c.ideal_s)
        return self._memo[key]

    def per_token(self, groups: list[CallGroup], alpha: np.ndarray) -> dict[str, np.ndarray]:
        alpha = np.asarray(alpha, dtype=float)
        bases: dict[tuple, np.ndarray] = {}
        totals = {k: 0.0 for k in (*TERMS, "ideal_s")}
        for g in merge_groups(groups):
            if g.basis not in bases:
                bases[g.basis] = basis_value(g.basis, alpha)
            w = g.count * bases[g.basis]
            for key, value in zip((*TERMS, "ideal_s"),
                                  self.shape_cost(g.part, g.positions, g.slots,
                                                  g.after_other_part), strict=True):
                totals[key] = totals[key] + w * value
        totals["latency_s"] = sum(totals[k] for k in TERMS)
        return totals

    def basis_latency(self, groups: list[CallGroup]) -> dict[tuple, np.ndarray]:
        """The latency of a schedule's calls grouped by basis, before acceptance weighs them:
        per token, sum over bases of ``basis_latency[b] * basis_value(b, alpha)``."""
        out: dict[tuple, np.ndarray] = {}
        for g in merge_groups(groups):
            cost = self.shape_cost(g.part, g.positions, g.slots, g.after_other_part)
            out[g.basis] = out.get(g.basis, 0.0) + g.count * sum(cost[:len(TERMS)])
        return out


def _bound(b: dict[str, float]) -> Literal["bandwidth", "compute", "overhead", "link"]:
    terms = {"bandwidth": b["weights_s"] + b["kv_s"], "compute": b["compute_s"],
             "overhead": b["overhead_s"], "link": b.get("link_s", 0.0)}
    return max(terms, key=terms.__getitem__)  # type: ignore[return-value]


def prefill_time_s(model: LoopedModelSpec, hw: HardwareSpec, workload: Workload, depth: int,
                   readout_depths: int, readouts_together: bool = False) -> float:
    """Prefill of the prompt through P, R block calls and the coda readout(s): a call per
    readout depth (this decoder), or with ``readouts_together`` one call over them all (the
    plugin's waves on vLLM, wfd/serving/wave.py)."""
    parts = model.parts
    L = workload.context_length
    b = workload.batch_size
    causal = L * (L + 1) / 2  # a prefill runs eagerly in every mode

    def t(part: str, n: int, ctx_sum: float, slots: int = 1) -> float:
        c = call_cost(model, hw, parts[part], workload.dtype, n_positions=b * n, n_slots=slots,
                      context_sum_positions=b * ctx_sum, context_sum_slots=b * L * slots,
                      key_sets=b * slots)
        return float(c.time_s)

    # a coda with attention must fill its KV for every prompt position, once per readout depth
    coda_positions = L if model.coda_layers else 1
    coda_ctx = causal if model.coda_layers else L
    coda = t("coda", readout_depths * coda_positions, readout_depths * coda_ctx,
             readout_depths) if readouts_together else \
        readout_depths * t("coda", coda_positions, coda_ctx)
    return t("prelude", L, causal) + depth * t("block", L, causal) + coda


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
    tensor_parallel: int = 1,
    link: str | Link | None = None,
    continuous_depth: bool = False,
    only: Sequence[str] | None = None,
) -> Prediction:
    """Predict each registered schedule's per-token latency (AR, DtV, WFD) for one model,
    hardware and workload, each at its best variant (``Schedule.variants``).

    width W means draft depth ceil(R / W). block_length None picks DtV's best k in 1..32.
    ``engine``: a serving engine's own time (per step, per tick of a wave), added to each token
    as overhead. ``tensor_parallel``: devices each call is split over, joined by ``link`` (a
    name of costmodel/data/links.json, a ``Link``, or None: the hardware's usual one); the
    memory is then one device's. ``continuous_depth``: a batch's tokens with exits batched
    continuously, each sequence at its own depth (the plugin's exit mode on vLLM), not in step
    (``wfd``'s batch); that mode runs AR as a wave, so with ``engine`` AR with exits pays the
    engine's time per tick and commits ahead as the plugin's drafting schedules do, and its
    waves read a prompt out at all its readout depths in one call. ``only``: the registered
    schedules to price (AR always, the speedups' baseline); default all.
    """
    spec, hw = split(*resolve(model, hardware), tensor_parallel, link)
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
            else schedule.exit_groups(exits, wl.batch_size, continuous_depth)
        if groups is not None:
            return groups, pricer.per_token(groups, alpha)
        latency, breakdown, ideal, blocks, decoded = simulate_exits(spec, hw, schedule, wl, depth,
                                                                    exits)
        return [], {**{key: v / decoded for key, v in breakdown.items()},
                    "latency_s": latency / decoded, "ideal_s": ideal / decoded,
                    "block_calls": blocks / decoded}

    chosen: dict[str, Schedule] = {}
    for name, kind in _registered(only):
        best = min(((s, *priced(s)) for s in kind.variants(d, depth, **options)),
                   key=lambda f: float(f[2]["latency_s"]))
        schedule, groups, totals = best
        chosen[name] = schedule
        readouts = readout_depths(schedule, depth, exits.exits.min_depth if exits else None)
        results[name] = _result(spec, hw, wl, depth, schedule, groups, alpha, totals, readouts,
                                readouts_together=continuous_depth,
                                mean_exit_depth=exits.mean_depth if exits else None,
                                acceptance=seen if schedule.drafts else None)
    if wl.prompts is not None:
        for name, schedule in chosen.items():
            _finite_run(spec, hw, wl, depth, schedule, float(alpha), results[name])
    _with_speedups(results, engine, wl.batch_size, depth,
                   waves=exits is not None and continuous_depth)
    return Prediction(model=spec.name, hardware=hw, workload=wl, depth=depth, memory=memory,
                      schedules=results)


def _registered(only: Sequence[str] | None) -> list[tuple[str, type[Schedule]]]:
    """The registered schedules to price: those ``only`` names (AR always), or all."""
    return [(name, kind) for name, kind in SCHEDULES.items()
            if only is None or name in only or name == AR.name]


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
            readouts_together: bool = False, **reported) -> ScheduleResult:
    """A schedule's prediction from its call groups (none where it was simulated) and totals per
    token (speedup filled in against AR's later), with the prefill and KV cache of its
    ``readouts`` coda readout depths, and what else is ``reported`` (its acceptance, the mean
    exit depth)."""
    latency = float(totals["latency_s"])
    block_calls = float(block_calls_per_token(groups, alpha)) if groups \
        else float(totals["block_calls"])
    terms = {k: float(totals[k]) for k in TERMS}
    return ScheduleResult(
        schedule=schedule.name, latency_per_token_s=latency,
        tokens_per_s=wl.batch_size / latency, speedup_vs_ar=1.0,
        block_calls_per_token=block_calls, breakdown=Breakdown(**terms),
        roofline_fraction=float(totals["ideal_s"]) / latency, bound=_bound(terms),
        prefill_s=prefill_time_s(spec, hw, wl, depth, readouts, readouts_together),
        kv_bytes=kv_cache_bytes(spec, wl, depth=depth, readout_depths=readouts,
                                lookahead=schedule.lookahead(depth),
                                static=hw.graphs.cuda_graphs),
        **schedule.fields(depth), **reported)


def _with_speedups(results: dict[str, ScheduleResult], engine: EngineOverheads | None,
                   batch: int, depth: int, waves: bool = False) -> None:
    """The engine's time (where given) added to each token as overhead: its step's share (a
    drafting schedule's step commits several tokens of each sequence) and a drafting
    schedule's ticks (``waves``: AR's too, run as a wave: the plugin's exit mode); speedups."""
    for name, r in results.items() if engine is not None else ():
        drafts = r.draft_depth is not None or waves
        ticks = r.block_calls_per_token
        own = engine.token_share_s(batch, drafts, ticks, depth)
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
    breakdown = {k: run.breakdown_s[k] * per_token for k in TERMS}
    result.latency_per_token_s = run.latency_s * per_token
    result.tokens_per_s = run.tokens_per_s
    result.block_calls_per_token = run.block_calls * per_token
    result.breakdown = Breakdown(**breakdown)
    result.roofline_fraction = run.ideal_s / run.latency_s
    result.bound = _bound(breakdown)
