"""WFD(d, cap), WaveFront Decoding: each tick one block call advances every position in flight
one step, each at its own depth; the newest drafts at d, the oldest verifies at R.

Closed form. Position i of a wave enters at tick e_i = max(e_{i-1} + d, e_{i-W} + R) and is
advanced at ticks e_i + 1 .. e_i + R. The ticks depend only on the ticks since the wave began, so
by renewal-reward the expected cost per token is
    (1 - alpha) * sum_{t <= R} cost(t)
      + sum_{t in the tail period} cost(t) * alpha^{n(t)} / sum_{v < V} alpha^v
where n(t) counts verifies before tick t and the tail repeats every d ticks (V = 1 verify) or,
under a binding cap, every R ticks (V = W verifies). With exits a wave is simulated call by call
(costmodel.adaptive).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from ..groups import Basis, CallGroup
from ..plans import Bonus, Call, Draft, Plan, Rollback, Steps, Verify, check_draft_depth
from ..slots import core_slot
from .base import Drafting, Schedule, register


def wave_width(depth: int, draft_depth: int, width_cap: int | None = None) -> int:
    """Positions in flight in a full WFD wave: ceil(R / d), or the cap if smaller."""
    natural = -(-depth // draft_depth)
    return natural if width_cap is None else min(natural, width_cap)


class WFDPlan(Plan):
    """WFD(d, cap): each tick is one block call advancing every in-flight position one step, each
    at its own depth. The newest position reaching d drafts (its token enters next tick, when
    the cap allows); the oldest reaching R verifies, in the same coda call. A rejection commits
    the correction, flushes every younger position and re-enters the correction at depth 0.
    With exits a position leaves the wave at its exit depth and waits, out of the calls, until
    every older one is committed; one that exits by d drafts its final token. With adaptive
    drafts the newest drafts where its draft rule fires (by d), and the next enters sooner."""

    def __init__(self, prompt_length: int, depth: int, *, draft_depth: int,
                 width_cap: int | None = None, **common):
        super().__init__(prompt_length, depth, readout_depths=(draft_depth,), **common)
        check_draft_depth(draft_depth, depth)
        if width_cap is not None and width_cap < 1:
            raise ValueError(f"width cap must be at least 1, got {width_cap}")
        self.draft_depth, self.width_cap = draft_depth, width_cap
        # adaptive drafts may come as shallow as the draft rule's first depth: a wider wave
        shallowest = min(draft_depth, self.drafts.min_depth) if self.drafts else draft_depth
        self.width = wave_width(depth, shallowest, width_cap)
        self.lookahead = self.width + 1  # the wave and the position after it

    def decode(self) -> Steps:
        d, cap = self.draft_depth, self.width_cap
        # [position, depth, final, drafted: 0 not yet, 1 a proposal, 2 its final token], oldest
        # first
        wave: list[list[int]] = []
        waiting: int | None = self.prompt_length  # the position whose token waits to enter
        while True:
            self.rounds += 1  # a tick: its prelude call (if a token enters), B, its coda call
            going = [entry for entry in wave if not entry[2] and not self.waits(entry[0])]
            # positions waiting out of the calls (``Plan.defer``) still hold their place
            if waiting is not None and (cap is None or len(going) < cap) and (
                    not self.defer or len(wave) < self.width):
                yield Call("prelude", (waiting,), (0,))
                wave.append([waiting, 0, False, 0])
                going.append(wave[-1])
                waiting = None
            for entry in going:
                entry[1] += 1
            yield Call("block", tuple(e[0] for e in going), tuple(e[1] for e in going))
            newest = wave[-1]
            # newest first: the draft's readout, then the verify's
            done = yield from self.after_block([e[0] for e in reversed(going)],
                                               [e[1] for e in reversed(going)])
            for entry in wave:
                entry[2] = entry[2] or entry[0] in done
            p, r, final, drafted = newest
            # a position that stopped below d drafts its final readout, or a proposal while
            # that waits (``Plan.defer``)
            if not drafted and (final or p in self.unread or newest in going and (
                    r == d or (yield from self.draft_check(p, r, d)))):
                yield from self.proposal(p)
                yield Draft(p, final=bool(final))
                newest[3] = 2 if final else 1
                waiting = p + 1
            while wave and wave[0][2]:
                p, _, _, drafted = wave.pop(0)
                if drafted == 2:
                    yield Bonus(p)
                elif not (yield Verify(p)):
                    self.flushed += len(wave)
                    yield Rollback(p + 1, flushed=len(wave))
                    self.rolled_back(p + 1)
                    wave.clear()
                    waiting = p + 1  # the correction re-enters at depth 0


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


def wfd_period(depth: int, draft_depth: int, width_cap: int | None) -> tuple[int, int]:
    """(ticks, verifies) of the steady-state period that repeats after the first R ticks."""
    if width_cap is not None and width_cap < wave_width(depth, draft_depth):
        return depth, width_cap
    return draft_depth, 1


def wfd_ticks(depth: int, d: int, cap: int | None, kv_sharing: int) -> list[Tick]:
    """The first R ticks of a wave plus one steady-state period."""
    period, _ = wfd_period(depth, d, cap)
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


@register
class WFD(Drafting):
    title = "WFD"
    in_phase = False
    kind: Literal["wfd"] = "wfd"
    width_cap: Annotated[int, Field(ge=1)] | None = None

    def plan(self, prompt_length, depth, *, coda_attends, readout_depths=(), prefill=True,
             exits=None, drafts=None) -> Plan:
        return WFDPlan(prompt_length, depth, draft_depth=self.draft_depth,
                       width_cap=self.width_cap, coda_attends=coda_attends, prefill=prefill,
                       exits=exits, drafts=drafts)

    def width(self, depth: int) -> int:
        return wave_width(depth, self.draft_depth, self.width_cap)

    def lookahead(self, depth: int) -> int:  # the wave and the position after it
        return self.width(depth) + 1

    def positions_per_call(self, depth: int) -> int:
        return self.width(depth)

    def fill_ticks(self, depth: int) -> int:  # the first position after the prompt, 0 to R
        return depth

    def call_groups(self, depth: int, kv_sharing: int = 0) -> list[CallGroup]:
        """Each tick's calls over the first R ticks and one steady period, weighted by
        renewal-reward (the module's docstring)."""
        self.check(depth)
        d, cap = self.draft_depth, self.width_cap
        _, verifies = wfd_period(depth, d, cap)
        groups = []
        ticks = wfd_ticks(depth, d, cap, kv_sharing)
        for before, tick in zip([None, *ticks[:-1]], ticks, strict=True):
            basis = wfd_tick_basis(tick, depth, verifies)
            # a tick's block call follows its prelude call, or the last tick's coda call (a
            # wave's first tick has both), or else the last tick's block call
            after_other = bool(tick.prelude_positions or before is None or before.readouts)
            groups.append(CallGroup("block", tick.block_positions, tick.block_slots, 1, basis,
                                    after_other))
            if tick.prelude_positions:
                groups.append(CallGroup("prelude", tick.prelude_positions, 1, 1, basis))
            if tick.readouts:
                # draft (depth d) and verify (depth R) readouts use different coda slots
                groups.append(CallGroup("coda", tick.readouts, tick.readouts, 1, basis))
        return groups

    @classmethod
    def variants(cls, draft_depth: int, depth: int, *, block_length: int | None = None,
                 width_cap: int | None = None, quick: bool = False) -> list[Schedule]:
        return [cls(draft_depth=draft_depth, width_cap=width_cap)]

    def refinements(self, depth: int) -> list[Schedule]:
        """Every cap below the natural width: a cap trades wider calls for more of them."""
        return [WFD(draft_depth=self.draft_depth, width_cap=cap)
                for cap in range(1, wave_width(depth, self.draft_depth))]

    def fields(self, depth: int) -> dict[str, int | None]:
        return {"draft_depth": self.draft_depth, "width": self.width(depth),
                "block_length": None, "width_cap": self.width_cap}

    @classmethod
    def label(cls, draft_depth=None, block_length=None, width=None, width_cap=None) -> str:
        return f"WFD d={draft_depth} " + (f"cap={width_cap}" if width_cap else f"W={width}")

    @classmethod
    def of(cls, draft_depth=None, block_length=None, width_cap=None) -> Schedule:
        return cls(draft_depth=draft_depth, width_cap=width_cap)

    def run_stats(self, plan: Plan, verifier_stats: dict) -> dict[str, object]:
        return {**verifier_stats, "ticks": plan.rounds, "flushed_positions": plan.flushed,
                **self.batch_stats(plan)}

    def batch_stats(self, plan: Plan) -> dict[str, object]:
        return {"draft_depth": self.draft_depth, "width": plan.width,
                "width_cap": self.width_cap}
