"""Event simulator: steps AR, DtV and WFD call by call and emits call records in the trace schema.

Acceptance comes from Bernoulli draws (seeded), or from a per-position sequence, for example the
one a measured depth trace gives (``DepthTrace.acceptance_sequence``): entry i says whether the
draft of the i-th token committed after the prefill matches the full-depth readout. The simulated
records are priced with the same per-call cost as the closed forms.

Positions are absolute: the prompt holds 0..L-1, the prefill's readout of position L-1 commits the
first new token, and decoding commits the remaining ``new_tokens - 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .cost import TERMS, call_cost
from .hardware import HardwareSpec
from .model import LoopedModelSpec
from .plans import Call, EarlyExit, Executor, Plan
from .presets import resolve
from .schedules.base import Schedule
from .slots import call_slots, in_prefill, keys_read
from .trace import CallRecord, slot_lengths
from .workload import Workload

if TYPE_CHECKING:
    from .adaptive import ExitProfile


@dataclass
class SimulationResult:
    records: list[CallRecord]
    committed_tokens: int  # committed by decoding (after the prefill's first token)
    accepted: int = 0
    rejected: int = 0
    bonus: int = 0
    flushed_positions: int = 0
    rounds_or_ticks: int = 0
    latency_s: float = 0.0
    ideal_s: float = 0.0  # the decode's calls at the roofline (records=False runs only)
    breakdown_s: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # calls of each part (P, B, C)

    @property
    def block_calls(self) -> int:
        return self.calls.get("block", 0)

    @property
    def latency_per_token_s(self) -> float:
        return self.latency_s / self.committed_tokens


def acceptance_draws(acceptance: float, count: int, seed: int) -> list[bool]:
    """Seeded Bernoulli draft outcomes, one per decoded position (the decoder's forced
    acceptance draws the same ones)."""
    if not 0 <= acceptance <= 1:  # NaN too: a draw against it would never accept
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    rng = np.random.default_rng(seed)
    return [bool(x) for x in rng.random(count) < acceptance]


ExitOracle = Callable[[int, int], int]  # (position, its entry: 0, 1, ...) -> its exit depth


def exit_sequence_oracle(exit_depths: Sequence[int], start: int, depth: int) -> ExitOracle:
    """Exit depths by decoded position (entry i: position start + i), the same at every entry
    of a position; R past the end."""
    def exit_at(position: int, entry: int) -> int:
        i = position - start
        return exit_depths[i] if 0 <= i < len(exit_depths) else depth
    return exit_at


class _Simulator(Executor):
    """Executes a plan without a model: each call becomes a record, each verification takes the
    outcome of its position from the acceptance sequence, each exit check the depth the oracle
    gives the position at its current entry."""

    def __init__(self, plan: Plan, kv_sharing: int, accept: Sequence[bool], tokens: int,
                 records: bool, static: bool = False, exit_at: ExitOracle | None = None,
                 draft_at: ExitOracle | None = None):
        self.plan, self.kv_sharing, self.accept, self.tokens = plan, kv_sharing, accept, tokens
        self.exit_at, self.draft_at = exit_at, draft_at
        self.entries: dict[int, int] = {}  # position -> times it entered (prelude calls)
        self.static = static  # graphs mode: each decode call reads its static span of keys
        self.result = SimulationResult([], committed_tokens=0)
        self.start = plan.prompt_length
        self.records = records
        self.shapes: dict[str, list[tuple[int, ...]]] = {}  # without records: shapes_by_part's
        self.previous = "coda"  # the part of the call before: decoding follows the prefill's

    @property
    def done(self) -> bool:
        return self.result.committed_tokens >= self.tokens

    def call(self, call: Call) -> None:
        calls = self.result.calls
        calls[call.kind] = calls.get(call.kind, 0) + 1
        if call.kind == "prelude" and (self.exit_at or self.draft_at) is not None:
            for p in call.positions:
                self.entries[p] = self.entries.get(p, 0) + 1
        slots = call_slots(call.kind, call.depths, self.kv_sharing)
        contexts = keys_read(call.positions, self.static and not in_prefill(
            call.positions, self.plan.prompt_length))
        if self.records:
            # model_construct: records by the hundred thousand, correct by construction
            self.result.records.append(CallRecord.model_construct(
                kind=call.kind, positions=list(call.positions), depths=list(call.depths),
                contexts=contexts, slots=slots, wall_s=0.0))
        else:
            self.shapes.setdefault(call.kind, []).append(
                (*call_shape(slots, contexts), call.kind != self.previous))
        self.previous = call.kind

    def check(self, positions: tuple[int, ...], depths: tuple[int, ...], draft: bool = False
              ) -> set[int]:
        oracle = self.draft_at if draft else self.exit_at
        return {p for p, r in zip(positions, depths, strict=True)
                if r == oracle(p, self.entries[p] - 1)}

    def verify(self, position: int) -> bool:
        ok = bool(self.accept[position - self.start])
        self.result.committed_tokens += 1
        self.result.accepted += ok
        self.result.rejected += not ok
        return ok

    def bonus(self, position: int) -> None:
        self.result.committed_tokens += 1
        if position >= self.start:  # not the prefill's first token
            self.result.bonus += 1


def check_schedule(schedule: object) -> None:
    if not isinstance(schedule, Schedule):  # a name leaves out DtV's and WFD's parameters
        raise TypeError(f"schedule must be a Schedule such as AR(), DtV(block_length=K, "
                        f"draft_depth=D) or WFD(draft_depth=D) (costmodel.schedules), got "
                        f"{schedule!r}")


def simulate(
    model: str | LoopedModelSpec,
    hw: str | HardwareSpec,
    schedule: Schedule,
    *,
    context_length: int,
    new_tokens: int,
    acceptance: float | None = None,
    accept_sequence: Sequence[bool] | None = None,
    seed: int = 0,
    depth: int | None = None,
    kv_sharing: int = 0,
    dtype: str = "bf16",
    batch_size: int = 1,
    prefill: bool = False,
    records: bool = True,
    exits: EarlyExit | None = None,
    exit_depths: Sequence[int] | ExitOracle | None = None,
    drafts: EarlyExit | None = None,
    draft_depths: ExitOracle | None = None,
) -> SimulationResult:
    """Simulate decoding ``new_tokens`` after a prompt of ``context_length`` tokens, and price it.

    ``accept_sequence`` gives the draft outcomes, or else Bernoulli draws with ``seed`` at
    ``acceptance`` (default: the model's); AR reads neither. With ``prefill`` the records begin
    with the prefill's calls (as a decoder's call trace does); the latency and committed tokens
    count decoding only.
    Without ``records`` only the latency, its breakdown and the counts come back (faster).
    Adaptive depth: ``exits`` (what the plan needs of the rule) and ``exit_depths``, the depth
    each decoded position exits at (by decoded position, or an oracle of (position, entry)).
    Adaptive drafting: ``drafts`` and ``draft_depths``, an oracle of the depth each entry of a
    position's draft rule fires at (one it never reaches: the rule does not fire). ``model`` and
    ``hw`` may name presets, as in ``predict``.
    """
    model, hw = resolve(model, hw)
    check_schedule(schedule)
    depth = depth or model.default_depth
    decode_tokens = new_tokens - 1
    if decode_tokens < 1:
        raise ValueError("simulate at least 2 new tokens (the prefill commits the first)")
    if accept_sequence is None:
        alpha = model.default_acceptance if acceptance is None else acceptance
        accept_sequence = acceptance_draws(alpha, decode_tokens + 64, seed)
    elif len(accept_sequence) < decode_tokens:
        raise ValueError(f"the acceptance sequence has {len(accept_sequence)} entries; "
                         f"decoding {decode_tokens} tokens needs at least that many")
    padded = list(accept_sequence) + [False] * 64  # drafts beyond the end are never committed
    plan = schedule.plan(context_length, depth, coda_attends=model.coda_layers > 0,
                         prefill=prefill, exits=exits, drafts=drafts)
    if exits is not None and exit_depths is None:
        raise ValueError("simulating exits needs the depth each position exits at")
    oracle = exit_depths if callable(exit_depths) or exits is None else exit_sequence_oracle(
        exit_depths, context_length, depth)
    sim = _Simulator(plan, kv_sharing, padded, new_tokens if prefill else decode_tokens,
                     records or prefill, static=hw.graphs.cuda_graphs, exit_at=oracle,
                     draft_at=draft_depths)
    sim.run(plan.steps())
    res = sim.result
    if prefill:
        res.committed_tokens -= 1
    res.rounds_or_ticks, res.flushed_positions = plan.rounds, plan.flushed
    if not sim.records:
        res.breakdown_s, _ = price_shapes(model, hw, sim.shapes, dtype=dtype,
                                          batch_size=batch_size)
        res.latency_s = sum(res.breakdown_s.values())
        res.ideal_s = _summed(model, hw, sim.shapes, "ideal_s", dtype, batch_size)
        return res
    decode = [r for r in res.records if min(r.positions) >= context_length]
    if prefill:
        price_records(model, hw, res.records[:len(res.records) - len(decode)], dtype=dtype,
                      batch_size=batch_size)
    res.breakdown_s = price_records(model, hw, decode, dtype=dtype, batch_size=batch_size,
                                    before="coda")
    res.latency_s = sum(r.wall_s for r in decode)
    return res


def price_records(model: LoopedModelSpec, hw: HardwareSpec, records: list[CallRecord], *,
                  dtype: str, batch_size: int = 1, before: str | None = None
                  ) -> dict[str, float]:
    """Set each record's ``wall_s`` to its predicted time; return the summed breakdown.

    The records are calls in the order they ran (``before``: the part of the call before the
    first; None: the first stands alone, timed as a calibration times a call, over and over);
    a call that follows another part's is priced so (``call_cost``'s ``after_other_part``).
    Records are priced together, one vectorized ``call_cost`` per part."""
    return _price(model, hw, records, _shapes_by_part(records, before), dtype, batch_size)


def _price(model: LoopedModelSpec, hw: HardwareSpec, records: list[CallRecord],
           shapes: dict[str, list[tuple[int, ...]]], dtype: str, batch_size: int = 1
           ) -> dict[str, float]:
    """``price_records`` with the records' shapes already worked out (``_shapes_by_part``)."""
    mine: dict[str, list[CallRecord]] = {}
    for r in records:
        mine.setdefault(r.kind, []).append(r)
    totals, times = price_shapes(model, hw, shapes, dtype=dtype, batch_size=batch_size)
    for kind, recs in mine.items():
        for record, t in zip(recs, times[kind], strict=True):
            record.wall_s = float(t)
    return totals


def price_bytes(model: LoopedModelSpec, hw: HardwareSpec, records: list[CallRecord], *,
                dtype: str, batch_size: int = 1) -> float:
    """Bytes the recorded calls read and write (weights, KV, activations), as the cost model
    counts them: the numerator of a measured run's fraction of the bandwidth roofline."""
    return _summed(model, hw, _shapes_by_part(records), "bytes", dtype, batch_size)


def _summed(model: LoopedModelSpec, hw: HardwareSpec, shapes: dict[str, list[tuple[int, ...]]],
            field: str, dtype: str, batch_size: int = 1) -> float:
    """A ``CallCost`` field summed over calls given by their shapes (``_shapes_by_part``)."""
    return sum(float(np.sum(np.broadcast_to(getattr(cost, field), (count,))))
               for _, cost, count in _part_costs(model, hw, shapes, dtype, batch_size))


def _shapes_by_part(records: list[CallRecord], before: str | None = None
                    ) -> dict[str, list[tuple[int, ...]]]:
    """Each part's calls: their ``call_shape`` and whether each follows another part's call
    (``before``: the part before the first record; None: the first follows none)."""
    shapes: dict[str, list[tuple[int, ...]]] = {}
    previous = before
    for r in records:
        shapes.setdefault(r.kind, []).append(
            (*call_shape(r.slots, r.contexts, r.sequences),
             previous is not None and r.kind != previous))
        previous = r.kind
    return shapes


def call_shape(slots: Sequence[int], contexts: Sequence[int],
               sequences: Sequence[int] | None = None) -> tuple[int, int, int, int, int]:
    """The five numbers a call is priced by: its positions, the distinct slots it reads (the
    kernels: sequences share them), the sum of the positions' contexts, the sum of the lengths
    of the distinct (sequence, slot) pairs read (the KV bytes), and how many such pairs there
    are (the key sets of its attention)."""
    lengths = slot_lengths(slots, contexts, sequences)
    return len(contexts), len(set(slots)), sum(contexts), sum(lengths.values()), len(lengths)


def price_shapes(model: LoopedModelSpec, hw: HardwareSpec,
                 shapes: dict[str, list[tuple[int, ...]]], *, dtype: str,
                 batch_size: int = 1) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Calls given by their ``call_shape`` and whether they follow another part's call, per
    part: the summed breakdown, and each call's time."""
    totals = dict.fromkeys(TERMS, 0.0)
    times: dict[str, np.ndarray] = {}
    for kind, cost, count in _part_costs(model, hw, shapes, dtype, batch_size):
        times[kind] = np.broadcast_to(cost.time_s, (count,))
        for key in totals:
            totals[key] += float(np.sum(np.broadcast_to(getattr(cost, key), (count,))))
    return totals, times


def _part_costs(model: LoopedModelSpec, hw: HardwareSpec,
                shapes: dict[str, list[tuple[int, ...]]], dtype: str, batch_size: int):
    """(part, its calls' vectorized CallCost, number of calls) for each part."""
    for kind, rows in shapes.items():
        n, slots, ctx_positions, ctx_slots, key_sets, after = np.array(rows, dtype=float).T
        yield kind, call_cost(model, hw, model.part(kind), dtype, n_positions=batch_size * n,
                              n_slots=slots, context_sum_positions=batch_size * ctx_positions,
                              context_sum_slots=batch_size * ctx_slots,
                              key_sets=batch_size * key_sets,
                              after_other_part=after.astype(bool)), len(rows)


@dataclass
class BatchSimulation:
    """A simulated batch: its merged calls in order (records naming each position's sequence,
    priced), which of them belong to prefills, and what decoding took without them."""

    calls: list[CallRecord]
    prefill: list[bool]  # per call: a prefill's (left out of the decode's latency)
    decode_tokens: int  # committed after each sequence's first token (the prefill's)
    latency_s: float
    breakdown_s: dict[str, float]
    ideal_s: float  # the decode's calls at the roofline (peak bandwidth and flops, no overhead)

    @property
    def records(self) -> list[CallRecord]:
        """The decode's calls."""
        return [r for r, p in zip(self.calls, self.prefill, strict=True) if not p]

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.latency_s

    @property
    def block_calls(self) -> int:
        return sum(r.kind == "block" for r in self.records)


def simulate_batch(
    model: str | LoopedModelSpec,
    hw: str | HardwareSpec,
    schedule: Schedule,
    sequences: Sequence[tuple[int, int, Sequence[bool] | None]],
    *,
    batch_size: int,
    depth: int | None = None,
    kv_sharing: int = 0,
    dtype: str = "bf16",
) -> BatchSimulation:
    """Simulate decoding ``sequences`` (context length, new tokens, draft outcomes by decoded
    position; None for AR) ``batch_size`` at a time, merged call by call as the decoder merges
    them (``costmodel.batching``), and price each merged call. Unlike ``predict --batch``, which
    prices B copies of one sequence's steady state, this counts what a finite batch does: the
    waves filling, sequences finishing at different calls, newcomers' prefills and rounds."""
    from .batching import PREFILL, merged_call, run_batch

    model, hw = resolve(model, hw)
    check_schedule(schedule)
    depth = depth or model.default_depth
    if batch_size < 1 or not sequences:
        raise ValueError(f"simulate one sequence or more, at least 1 at a time (got "
                         f"{len(sequences)} at batch size {batch_size})")
    calls: list[CallRecord] = []
    prefill: list[bool] = []

    def start(job: tuple[int, int, Sequence[bool] | None], region: int):
        context, new, accept = job
        if new < 2:
            raise ValueError("simulate at least 2 new tokens per sequence (the prefill "
                             "commits the first)")
        plan = schedule.plan(context, depth, coda_attends=model.coda_layers > 0)
        padded = list(accept or []) + [False] * 64  # drafts past the end are never committed
        return _Simulator(plan, kv_sharing, padded, new, records=False,
                          static=hw.graphs.cuda_graphs), plan

    def run_call(lanes) -> None:
        kind, positions, depths, regions = merged_call(lanes)
        calls.append(CallRecord.model_construct(
            kind=kind, positions=positions, depths=depths,
            contexts=keys_read(positions, hw.graphs.cuda_graphs and lanes[0].round != PREFILL),
            slots=call_slots(kind, depths, kv_sharing), sequences=regions, wall_s=0.0))
        prefill.append(lanes[0].round == PREFILL)

    run_batch(list(sequences), min(batch_size, len(sequences)), start, run_call, lambda _: None)
    price_records(model, hw, [r for r, p in zip(calls, prefill, strict=True) if p], dtype=dtype)
    decode = [r for r, p in zip(calls, prefill, strict=True) if not p]
    # a newcomer's prefill between two decode calls is not counted as coming between them
    shapes = _shapes_by_part(decode, before="coda")  # the slow part, worked out once
    breakdown = _price(model, hw, decode, shapes, dtype)
    return BatchSimulation(calls=calls, prefill=prefill,
                           decode_tokens=sum(new - 1 for _, new, _ in sequences),
                           latency_s=sum(r.wall_s for r in decode), breakdown_s=breakdown,
                           ideal_s=_summed(model, hw, shapes, "ideal_s", dtype))


# simulated per prediction of a schedule with exits and no closed form (WFD): a wave's mean cost
# to about 2%
WFD_POSITIONS = 2048


def simulate_exits(model: LoopedModelSpec, hw: HardwareSpec, schedule: Schedule,
                   workload: Workload, depth: int, profile: ExitProfile):
    """A schedule with exits and no closed form (WFD: ``Schedule.exit_groups`` is None): runs
    of the workload's length, seeded 0, 1, ... until ``WFD_POSITIONS`` positions are decoded;
    their summed latency, breakdown, ideal time, block calls and tokens."""
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
