"""Closed forms: the expected calls per committed token of AR, DtV(k, d) and WFD(d) under i.i.d.
acceptance alpha, as a list of call groups (a call shape and its expected count per token),
priced by ``cost.call_cost``. They are the independent check of the event simulator
(simulate.py), which must agree with them on i.i.d. inputs; docs/costmodel.md ("Schedules")
derives each.

WFD(d, cap W): position i of a wave enters at tick e_i = max(e_{i-1} + d, e_{i-W} + R) and is
advanced at ticks e_i + 1 .. e_i + R. The ticks depend only on the ticks since the wave began, so
by renewal-reward the expected cost per token is
    (1 - alpha) * sum_{t <= R} cost(t)
      + sum_{t in the tail period} cost(t) * alpha^{n(t)} / sum_{v < V} alpha^v
where n(t) counts verifies before tick t and the tail repeats every d ticks (V = 1 verify) or,
under a binding cap, every R ticks (V = W verifies).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .plans import core_slot, wave_width
from .specs import AR, WFD, DtV

Basis = tuple  # hashable: ("const",), ("dtv", k), ("wfd-ramp",), ("wfd-tail", n, V)


@dataclass(frozen=True)
class CallGroup:
    """Calls of one shape, and how many of them a committed token costs on average:
    ``count * basis_value(basis, alpha)``. Groups of one schedule share few bases, so a sweep
    evaluates each basis once."""

    part: str  # "prelude" | "block" | "coda"
    positions: int  # per sequence
    slots: int  # distinct KV slots read, per sequence
    count: float
    basis: Basis = ("const",)
    # the calls follow a call of another part (a CPU's cache then holds what is left of the
    # whole model's weights, not this part's: cost.call_cost); only block calls ever repeat
    after_other_part: bool = True

    def weight(self, alpha: np.ndarray) -> np.ndarray:
        return self.count * basis_value(self.basis, np.asarray(alpha, dtype=float))


def expected_tokens_per_round(alpha: np.ndarray, block_length: int) -> np.ndarray:
    """DtV: sum_{i=0..k} alpha^i (k drafts, plus the correction or the bonus token)."""
    return _geometric_sum(np.asarray(alpha, dtype=float), block_length + 1)


def _geometric_sum(alpha: np.ndarray, terms: int) -> np.ndarray:
    """sum_{i < terms} alpha^i, by Horner's rule (no powers)."""
    total = np.ones_like(alpha)
    for _ in range(terms - 1):
        total = 1.0 + alpha * total
    return total


def basis_value(basis: Basis, alpha: np.ndarray) -> np.ndarray:
    kind = basis[0]
    if kind == "const":
        return np.ones_like(alpha)
    if kind == "dtv":  # per round, divided by the expected tokens per round
        return 1.0 / expected_tokens_per_round(alpha, basis[1])
    if kind == "wfd-ramp":  # the first R ticks of a wave, once per wave of 1/(1-alpha) tokens
        return 1.0 - alpha
    if kind == "wfd-tail":  # a steady-state tick after n verifies, V verifies per period
        _, verifies_before, verifies_per_period = basis
        return alpha**verifies_before / _geometric_sum(alpha, verifies_per_period)
    raise ValueError(f"unknown basis {basis!r}")


def ar_groups(depth: int) -> list[CallGroup]:
    return [CallGroup("prelude", 1, 1, 1), CallGroup("block", 1, 1, 1),
            CallGroup("block", 1, 1, depth - 1, after_other_part=False),
            CallGroup("coda", 1, 1, 1)]


def dtv_groups(schedule: DtV, depth: int) -> list[CallGroup]:
    k, d = schedule.block_length, schedule.draft_depth
    drafted = k + 1
    per_round = ("dtv", k)
    return [
        CallGroup("prelude", 1, 1, drafted, per_round),
        CallGroup("block", 1, 1, drafted, per_round),  # each draft's first, after its prelude
        CallGroup("block", 1, 1, drafted * (d - 1), per_round, after_other_part=False),
        CallGroup("coda", 1, 1, drafted, per_round),
        CallGroup("block", drafted, 1, 1, per_round),  # the continuation's first, after C
        CallGroup("block", drafted, 1, depth - d - 1, per_round, after_other_part=False),
        CallGroup("coda", drafted, 1, 1, per_round),
    ]


@dataclass(frozen=True)
class Tick:
    """One tick of a WFD wave: the block call over the in-flight positions and its companions."""

    index: int  # ticks since the wave began, from 1
    block_positions: int
    block_slots: int
    prelude_positions: int  # entries just before this tick
    readouts: int  # draft and verify readouts in this tick's C call
    verifies_before: int  # verify readouts in earlier ticks of the wave


def wave_entry_ticks(depth: int, draft_depth: int, width_cap: int | None, count: int) -> list[int]:
    entries: list[int] = []
    for i in range(count):
        e = 0 if i == 0 else entries[-1] + draft_depth
        if width_cap is not None and i >= width_cap:
            e = max(e, entries[i - width_cap] + depth)
        entries.append(e)
    return entries


def wfd_period(depth: int, schedule: WFD) -> tuple[int, int]:
    """(ticks, verifies) of the steady-state period that repeats after the first R ticks."""
    cap = schedule.width_cap
    if cap is not None and cap < wave_width(depth, schedule.draft_depth):
        return depth, cap
    return schedule.draft_depth, 1


def wfd_ticks(depth: int, schedule: WFD, kv_sharing: int) -> list[Tick]:
    """The first R ticks of a wave plus one steady-state period."""
    d, cap = schedule.draft_depth, schedule.width_cap
    period, _ = wfd_period(depth, schedule)
    horizon = depth + period
    entries = wave_entry_ticks(depth, d, cap, horizon // max(d, 1) + 2)
    ticks = []
    for t in range(1, horizon + 1):
        depths = [t - e for e in entries if e < t <= e + depth]
        slots = {core_slot(r, kv_sharing) for r in depths}
        ticks.append(Tick(
            index=t,
            block_positions=len(depths),
            block_slots=len(slots),
            prelude_positions=sum(1 for e in entries if e == t - 1),
            readouts=sum(1 for r in depths if r in (d, depth)),
            verifies_before=sum(1 for e in entries if e + depth < t),
        ))
    return ticks


def wfd_tick_basis(tick: Tick, depth: int, verifies_per_period: int) -> Basis:
    if tick.index <= depth:
        return ("wfd-ramp",)
    return ("wfd-tail", tick.verifies_before, verifies_per_period)


def wfd_groups(schedule: WFD, depth: int, kv_sharing: int) -> list[CallGroup]:
    if schedule.draft_depth >= depth:
        raise ValueError(f"draft depth {schedule.draft_depth} must be below R = {depth}")
    _, verifies = wfd_period(depth, schedule)
    groups = []
    ticks = wfd_ticks(depth, schedule, kv_sharing)
    for before, tick in zip([None, *ticks[:-1]], ticks, strict=True):
        basis = wfd_tick_basis(tick, depth, verifies)
        # a tick's block call follows its prelude call, or the last tick's coda call (a wave's
        # first tick has both), or else the last tick's block call
        after_other = bool(tick.prelude_positions or before is None or before.readouts)
        groups.append(CallGroup("block", tick.block_positions, tick.block_slots, 1, basis,
                                after_other))
        if tick.prelude_positions:
            groups.append(CallGroup("prelude", tick.prelude_positions, 1, 1, basis))
        if tick.readouts:
            # draft (depth d) and verify (depth R) readouts use different coda slots
            groups.append(CallGroup("coda", tick.readouts, tick.readouts, 1, basis))
    return groups


def call_groups(schedule: AR | DtV | WFD, depth: int, kv_sharing: int = 0) -> list[CallGroup]:
    if isinstance(schedule, AR):
        return ar_groups(depth)
    if isinstance(schedule, DtV):
        if schedule.draft_depth >= depth:
            raise ValueError(f"draft depth {schedule.draft_depth} must be below R = {depth}")
        return dtv_groups(schedule, depth)
    return wfd_groups(schedule, depth, kv_sharing)


def merge_groups(groups: list[CallGroup]) -> list[CallGroup]:
    """Add up the counts of groups with the same shape and basis."""
    merged: dict[tuple, float] = {}
    for g in groups:
        if g.count:
            key = (g.part, g.positions, g.slots, g.basis, g.after_other_part)
            merged[key] = merged.get(key, 0.0) + g.count
    return [CallGroup(part, n, slots, count, basis, after)
            for (part, n, slots, basis, after), count in merged.items()]


def block_calls_per_token(groups: list[CallGroup], alpha: np.ndarray) -> np.ndarray:
    alpha = np.asarray(alpha, dtype=float)
    return sum(g.weight(alpha) for g in groups if g.part == "block")
