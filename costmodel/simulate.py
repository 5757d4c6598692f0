"""Event simulator: steps AR, DtV and WFD call by call and emits call records in the trace schema.

Acceptance comes from Bernoulli draws (seeded), or from a per-position sequence, for example the
one a measured depth trace gives (``DepthTrace.acceptance_sequence``): entry i says whether the
draft of the i-th token committed after the prefill matches the full-depth readout. The simulated
records are priced with the same per-call cost as the closed forms.

Positions are absolute: the prompt holds 0..L-1, the prefill's readout of position L-1 commits the
first new token, and decoding commits the remaining ``new_tokens - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .cost import call_cost
from .specs import AR, WFD, DtV, HardwareSpec, LoopedModelSpec
from .trace import CallRecord


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
    breakdown_s: dict[str, float] = field(default_factory=dict)

    @property
    def block_calls(self) -> int:
        return sum(1 for r in self.records if r.kind == "block")

    @property
    def latency_per_token_s(self) -> float:
        return self.latency_s / self.committed_tokens


def acceptance_draws(acceptance: float, count: int, seed: int) -> list[bool]:
    rng = np.random.default_rng(seed)
    return list(rng.random(count) < acceptance)


class _Recorder:
    # Records are built with model_construct: the simulator makes them by the hundred thousand and
    # their fields are correct by construction.
    def __init__(self, kv_sharing: int):
        self.records: list[CallRecord] = []
        self.kv_sharing = kv_sharing

    def block_slot(self, depth: int) -> int:
        """The slot written and read by the step that brings a position to ``depth``."""
        return (depth - 1) % self.kv_sharing if self.kv_sharing else depth - 1

    def _add(self, kind: str, positions: list[int], depths: list[int], slots: list[int]) -> None:
        self.records.append(CallRecord.model_construct(
            kind=kind, positions=positions, depths=depths,
            contexts=[p + 1 for p in positions], slots=slots, wall_s=0.0))

    def prelude(self, positions: list[int]) -> None:
        self._add("prelude", positions, [0] * len(positions), [0] * len(positions))

    def block(self, positions: list[int], depths: list[int]) -> None:
        self._add("block", positions, depths, [self.block_slot(r) for r in depths])

    def coda(self, positions: list[int], depths: list[int]) -> None:
        self._add("coda", positions, depths, list(depths))  # one coda slot per readout depth


def _simulate_ar(rec: _Recorder, depth: int, start: int, tokens: int) -> SimulationResult:
    for p in range(start, start + tokens):
        rec.prelude([p])
        for r in range(1, depth + 1):
            rec.block([p], [r])
        rec.coda([p], [depth])
    return SimulationResult(rec.records, committed_tokens=tokens, rounds_or_ticks=tokens)


def _simulate_dtv(rec: _Recorder, schedule: DtV, depth: int, start: int, tokens: int,
                  accept: Sequence[bool]) -> SimulationResult:
    k, d = schedule.block_length, schedule.draft_depth
    res = SimulationResult(rec.records, committed_tokens=0)
    first = start  # position holding the newest committed token
    while res.committed_tokens < tokens:
        drafted = list(range(first, first + k + 1))
        for p in drafted:
            rec.prelude([p])
            for r in range(1, d + 1):
                rec.block([p], [r])
            rec.coda([p], [d])
        for r in range(d + 1, depth + 1):
            rec.block(drafted, [r] * len(drafted))
        rec.coda(drafted, [depth] * len(drafted))
        m = 0
        while m < k and accept[first - start + m]:
            m += 1
        res.accepted += m
        if m == k:
            res.bonus += 1
        else:
            res.rejected += 1
        res.committed_tokens += m + 1
        res.rounds_or_ticks += 1
        first += m + 1
    return res


def _simulate_wfd(rec: _Recorder, schedule: WFD, depth: int, start: int, tokens: int,
                  accept: Sequence[bool]) -> SimulationResult:
    d, cap = schedule.draft_depth, schedule.width_cap
    res = SimulationResult(rec.records, committed_tokens=0)
    in_flight: list[list[int]] = []  # [position, depth], oldest first
    waiting: int | None = start  # position whose token waits to enter at depth 0
    while res.committed_tokens < tokens:
        if waiting is not None and (cap is None or len(in_flight) < cap):
            rec.prelude([waiting])
            in_flight.append([waiting, 0])
            waiting = None
        for entry in in_flight:
            entry[1] += 1
        rec.block([p for p, _ in in_flight], [r for _, r in in_flight])
        res.rounds_or_ticks += 1
        readout: list[tuple[int, int]] = []
        newest_pos, newest_depth = in_flight[-1]
        if newest_depth == d:
            readout.append((newest_pos, d))
            waiting = newest_pos + 1
        oldest_pos, oldest_depth = in_flight[0]
        if oldest_depth == depth:
            readout.append((oldest_pos, depth))
        if readout:
            rec.coda([p for p, _ in readout], [r for _, r in readout])
        if oldest_depth == depth:
            res.committed_tokens += 1
            in_flight.pop(0)
            if accept[oldest_pos - start]:
                res.accepted += 1
            else:
                res.rejected += 1
                res.flushed_positions += len(in_flight)
                in_flight.clear()
                waiting = oldest_pos + 1  # the correction re-enters at depth 0
    return res


def simulate(
    model: LoopedModelSpec,
    hw: HardwareSpec,
    schedule: AR | DtV | WFD,
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
) -> SimulationResult:
    """Simulate decoding ``new_tokens`` after a prompt of ``context_length`` tokens, and price it.

    Exactly one of ``acceptance`` (Bernoulli draws with ``seed``) and ``accept_sequence`` gives the
    draft outcomes; AR needs neither.
    """
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
    rec = _Recorder(kv_sharing)
    start = context_length
    if isinstance(schedule, AR):
        res = _simulate_ar(rec, depth, start, decode_tokens)
    elif isinstance(schedule, DtV):
        res = _simulate_dtv(rec, schedule, depth, start, decode_tokens, padded)
    else:
        res = _simulate_wfd(rec, schedule, depth, start, decode_tokens, padded)
    res.breakdown_s = price_records(model, hw, res.records, dtype=dtype, batch_size=batch_size)
    res.latency_s = sum(r.wall_s for r in res.records)
    return res


def price_records(model: LoopedModelSpec, hw: HardwareSpec, records: list[CallRecord], *,
                  dtype: str, batch_size: int = 1) -> dict[str, float]:
    """Set each record's ``wall_s`` to its predicted time; return the summed breakdown.

    Records are priced together, one vectorized ``call_cost`` per part."""
    parts = model.parts
    totals = {"weights_s": 0.0, "kv_s": 0.0, "compute_s": 0.0, "overhead_s": 0.0}
    for kind, part in parts.items():
        mine = [r for r in records if r.kind == kind]
        if not mine:
            continue
        slot_ctx = [r.slot_contexts() for r in mine]
        cost = call_cost(
            model, hw, part, dtype,
            n_positions=batch_size * np.array([len(r.positions) for r in mine], dtype=float),
            n_slots=np.array([len(s) for s in slot_ctx], dtype=float),
            context_sum_positions=batch_size * np.array([sum(r.contexts) for r in mine],
                                                        dtype=float),
            context_sum_slots=batch_size * np.array([sum(s.values()) for s in slot_ctx],
                                                    dtype=float))
        times = np.broadcast_to(cost.time_s, (len(mine),))
        for record, t in zip(mine, times, strict=True):
            record.wall_s = float(t)
        for key in totals:
            totals[key] += float(np.sum(np.broadcast_to(getattr(cost, key), (len(mine),))))
    return totals
