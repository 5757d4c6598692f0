"""The schedules, written once: AR, DtV(k, d) and WFD(d, cap) as plans.

A plan is a generator of events. ``Call`` says which part (P, B or C) runs next over which
positions at which depths; ``Draft``, ``Verify`` and ``Bonus`` say what to do with the readouts
of the last coda call; ``Rollback`` drops the KV of discarded positions. ``Verify`` takes back
the outcome (``plan.send(accepted)``). The decoder (``wfd.generate``) executes a plan with
tensors and the model; the simulator (``costmodel.simulate``) executes the same plan with draws
or a measured acceptance sequence and prices each call. Both stop the plan once enough tokens
are committed (each ``Verify`` and each ``Bonus`` commits one).

Positions are absolute: the prompt holds 0..L-1, the prefill reads position L-1 out at depth R
and commits its token (the first new one); position p's readout drafts or commits the token of
position p + 1.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Literal


def core_slot(depth: int, kv_sharing: int) -> int:
    """The KV slot written and read by the step that brings a position to ``depth`` (1-based):
    one slot per depth, or with s shared slots (depth - 1) mod s."""
    return (depth - 1) % kv_sharing if kv_sharing else depth - 1


def call_slots(kind: str, depths: Sequence[int], kv_sharing: int) -> list[int]:
    """The KV slot each position of a call reads and writes, as the call trace records it: 0 in
    the prelude, the core slot of its depth in the block, its readout depth in the coda."""
    if kind == "block":
        return [core_slot(r, kv_sharing) for r in depths]
    return [0] * len(depths) if kind == "prelude" else list(depths)


# A static call (graphs mode) attends over a fixed span of keys under a mask, rounded up to a
# multiple of this: a shape captured once serves every position of its bucket, at most this many
# keys are read past a position, and the captures grow with the context's length over the block,
# not with its tokens. The extra keys matter only where the KV is a large share of a call, that is
# at long contexts, where a fixed block is a small fraction of them (powers of two would read up
# to twice the keys there).
STATIC_SPAN_KEYS = 256


def static_span(keys: int) -> int:
    """The keys a static call reads when its latest position attends over ``keys``."""
    return -(-keys // STATIC_SPAN_KEYS) * STATIC_SPAN_KEYS


def keys_read(positions: Sequence[int], static: bool) -> list[int]:
    """The keys each position of a call attends over, as the call trace records them: its own
    prefix (p + 1) in eager mode; the call's static span in static and graphs modes."""
    if static:
        return [static_span(max(positions) + 1)] * len(positions)
    return [p + 1 for p in positions]


def in_prefill(positions: Sequence[int], prompt_length: int) -> bool:
    """Whether a call belongs to the prompt's prefill (decoding's calls hold a position past the
    prompt): a prefill call runs eagerly in every mode, so it reads its own prefix of keys."""
    return max(positions) < prompt_length


def mean_decode_keys(context, new_tokens, static: bool):
    """The keys a decode step attends over, on average over contexts L .. L + N - 1 (numbers or
    numpy arrays): L + (N - 1) / 2, or in static mode the mean of their static spans."""
    if not static:
        return context + (new_tokens - 1) / 2

    def spans_up_to(x):  # sum of static_span(c) for c = 1..x, in closed form
        q, r = x // STATIC_SPAN_KEYS, x % STATIC_SPAN_KEYS
        return STATIC_SPAN_KEYS * (STATIC_SPAN_KEYS * q * (q + 1) / 2 + r * (q + 1))

    return (spans_up_to(context + new_tokens - 1) - spans_up_to(context - 1)) / new_tokens


def wave_width(depth: int, draft_depth: int, width_cap: int | None = None) -> int:
    """Positions in flight in a full WFD wave: ceil(R / d), or the cap if smaller."""
    natural = -(-depth // draft_depth)
    return natural if width_cap is None else min(natural, width_cap)


def default_draft_depth(depth: int) -> int:
    """ceil(R / 8) below R: Huginn at R = 32 drafts at 4, Ouro at R = 4 at 1."""
    return max(1, min(depth - 1, -(-depth // 8)))


def lookahead(schedule: str, *, block_length: int = 0, width: int = 0) -> int:
    """Positions past the committed ones a schedule may write: DtV's k drafts and its bonus
    position, WFD's wave and the position after it. The decoder's static KV cache holds them
    beside the sequence, and the memory model counts them."""
    return {"ar": 0, "dtv": block_length + 1, "wfd": width + 1}[schedule]


@dataclass(frozen=True)
class Call:
    kind: Literal["prelude", "block", "coda"]
    positions: tuple[int, ...]
    depths: tuple[int, ...]  # after the call (B), read out at (C), 0 (P)


@dataclass(frozen=True)
class Draft:
    position: int  # its readout at d proposes the token of position + 1


@dataclass(frozen=True)
class Verify:
    position: int  # its readout at R checks the draft made from it; the plan is sent the outcome


@dataclass(frozen=True)
class Bonus:
    position: int  # its readout at R commits the token of position + 1 (no draft to check)


@dataclass(frozen=True)
class Rollback:
    length: int  # keep the KV of positions 0..length-1 only
    flushed: int = 0  # in-flight positions discarded (WFD)


Event = Call | Draft | Verify | Bonus | Rollback
Steps = Generator[Event, bool | None, None]


class Plan:
    """What every schedule shares: the prefill, and counters the decoder and simulator report."""

    kind = "ar"

    def __init__(self, prompt_length: int, depth: int, *, coda_attends: bool,
                 readout_depths: Sequence[int] = (), prefill: bool = True):
        if prompt_length < 1:
            raise ValueError("the prompt is empty")
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.prompt_length, self.depth = prompt_length, depth
        self.coda_attends = coda_attends  # a coda with attention reads every prompt position out
        self.readout_depths = sorted({*readout_depths, depth})
        self.prefill = prefill
        self.rounds = 0  # AR tokens, DtV rounds or WFD ticks begun
        self.flushed = 0
        self.lookahead = 0  # positions past the committed ones a plan may write

    def steps(self) -> Steps:
        """The whole schedule: the prefill (unless skipped), then decoding without end."""
        if self.prefill:
            yield from self.prefill_steps()
        yield from self.decode()

    def prefill_steps(self, every_position: bool = False) -> Steps:
        """P over the prompt, R block calls, a readout at each readout depth: of every prompt
        position when the coda attends (its KV is needed later) or ``every_position`` asks."""
        last = self.prompt_length - 1
        positions = tuple(range(self.prompt_length))
        readout = positions if self.coda_attends or every_position else (last,)
        yield Call("prelude", positions, (0,) * len(positions))
        for r in range(1, self.depth + 1):
            yield Call("block", positions, (r,) * len(positions))
            if r in self.readout_depths:
                yield Call("coda", readout, (r,) * len(readout))
        yield Bonus(last)

    def decode(self) -> Steps:
        """AR: per token P, R block calls at one position (read out at each readout depth), C."""
        for p in count(self.prompt_length):
            self.rounds += 1
            yield Call("prelude", (p,), (0,))
            for r in range(1, self.depth + 1):
                yield Call("block", (p,), (r,))
                if r in self.readout_depths:
                    yield Call("coda", (p,), (r,))
            yield Bonus(p)


class DtVPlan(Plan):
    """DtV(k, d), nested reuse: draft k + 1 positions one by one at depth d, continue them all
    from d to R in R - d batched calls, verify the k drafts in order, commit the correction at
    the first mismatch or the bonus token when all match, roll back the rest."""

    kind = "dtv"

    def __init__(self, prompt_length: int, depth: int, *, block_length: int, draft_depth: int,
                 **common):
        super().__init__(prompt_length, depth, readout_depths=(draft_depth,), **common)
        _check_draft_depth(draft_depth, depth)
        if block_length < 1:
            raise ValueError(f"block length must be at least 1, got {block_length}")
        self.block_length, self.draft_depth = block_length, draft_depth
        self.lookahead = lookahead("dtv", block_length=block_length)

    def decode(self) -> Steps:
        k, d, depth = self.block_length, self.draft_depth, self.depth
        cur = self.prompt_length  # the position holding the newest committed token
        while True:
            self.rounds += 1
            drafted = tuple(range(cur, cur + k + 1))
            for p in drafted:
                yield Call("prelude", (p,), (0,))
                for r in range(1, d + 1):
                    yield Call("block", (p,), (r,))
                yield Call("coda", (p,), (d,))  # the last one only fills the coda's depth-d KV
                if p < cur + k:
                    yield Draft(p)
            for r in range(d + 1, depth + 1):
                yield Call("block", drafted, (r,) * len(drafted))
            yield Call("coda", drafted, (depth,) * len(drafted))
            accepted = 0
            while accepted < k and (yield Verify(cur + accepted)):
                accepted += 1
            if accepted == k:
                yield Bonus(cur + k)
            cur += accepted + 1
            yield Rollback(cur)


class WFDPlan(Plan):
    """WFD(d, cap): each tick is one block call advancing every in-flight position one step, each
    at its own depth. The newest position reaching d drafts (its token enters next tick, when
    the cap allows); the oldest reaching R verifies, in the same coda call. A rejection commits
    the correction, flushes every younger position and re-enters the correction at depth 0."""

    kind = "wfd"

    def __init__(self, prompt_length: int, depth: int, *, draft_depth: int,
                 width_cap: int | None = None, **common):
        super().__init__(prompt_length, depth, readout_depths=(draft_depth,), **common)
        _check_draft_depth(draft_depth, depth)
        if width_cap is not None and width_cap < 1:
            raise ValueError(f"width cap must be at least 1, got {width_cap}")
        self.draft_depth, self.width_cap = draft_depth, width_cap
        self.width = wave_width(depth, draft_depth, width_cap)
        self.lookahead = lookahead("wfd", width=self.width)

    def decode(self) -> Steps:
        d, depth, cap = self.draft_depth, self.depth, self.width_cap
        in_flight: list[list[int]] = []  # [position, depth], oldest first
        waiting: int | None = self.prompt_length  # the position whose token waits to enter
        while True:
            self.rounds += 1  # a tick: its prelude call (if a token enters), B, its coda call
            if waiting is not None and (cap is None or len(in_flight) < cap):
                yield Call("prelude", (waiting,), (0,))
                in_flight.append([waiting, 0])
                waiting = None
            for entry in in_flight:
                entry[1] += 1
            yield Call("block", tuple(p for p, _ in in_flight), tuple(r for _, r in in_flight))
            (newest, newest_depth), (oldest, oldest_depth) = in_flight[-1], in_flight[0]
            readout = [(p, r) for p, r in dict.fromkeys(((newest, newest_depth),
                                                         (oldest, oldest_depth)))
                       if r in (d, depth)]
            if not readout:
                continue
            yield Call("coda", tuple(p for p, _ in readout), tuple(r for _, r in readout))
            if newest_depth == d:
                yield Draft(newest)
                waiting = newest + 1
            if oldest_depth == depth:
                in_flight.pop(0)
                if not (yield Verify(oldest)):
                    self.flushed += len(in_flight)
                    yield Rollback(oldest + 1, flushed=len(in_flight))
                    in_flight.clear()
                    waiting = oldest + 1  # the correction re-enters at depth 0


def make_plan(schedule: str, prompt_length: int, depth: int, *, coda_attends: bool,
              draft_depth: int | None = None, block_length: int = 4,
              width_cap: int | None = None, readout_depths: Sequence[int] = (),
              prefill: bool = True) -> Plan:
    """A plan by name: "ar" (with extra readout depths, for a depth trace), "dtv" or "wfd"."""
    common = dict(coda_attends=coda_attends, prefill=prefill)
    if schedule == "ar":
        return Plan(prompt_length, depth, readout_depths=readout_depths, **common)
    d = default_draft_depth(depth) if draft_depth is None else draft_depth
    if schedule == "dtv":
        return DtVPlan(prompt_length, depth, block_length=block_length, draft_depth=d, **common)
    if schedule == "wfd":
        return WFDPlan(prompt_length, depth, draft_depth=d, width_cap=width_cap, **common)
    raise ValueError(f"unknown schedule {schedule!r}; use ar, dtv or wfd")


class Executor:
    """Runs a plan's events. Subclasses do the work of each event; ``done`` ends the run."""

    done = False

    def call(self, call: Call) -> None: ...

    def draft(self, position: int) -> None: ...

    def verify(self, position: int) -> bool:
        raise NotImplementedError

    def bonus(self, position: int) -> None: ...

    def rollback(self, length: int) -> None: ...

    def run(self, steps: Steps) -> None:
        """Execute events (``plan.steps()``, or a part of a plan) until ``done`` or their end."""
        while (call := self.advance(steps)) is not None:
            self.call(call)

    def advance(self, steps: Steps) -> Call | None:
        """Handle the events up to the next call and return it, unrun (a batch runs the calls of
        many sequences together); None once ``done`` or the events end."""
        reply: bool | None = None
        while not self.done:
            try:
                event = steps.send(reply)
            except StopIteration:
                return None
            reply = None
            if isinstance(event, Call):
                return event
            if isinstance(event, Draft):
                self.draft(event.position)
            elif isinstance(event, Verify):
                reply = self.verify(event.position)
            elif isinstance(event, Bonus):
                self.bonus(event.position)
            else:
                self.rollback(event.length)
        return None


def _check_draft_depth(draft_depth: int, depth: int) -> None:
    if not 1 <= draft_depth < depth:
        raise ValueError(f"draft depth must be in 1..{depth - 1} (below R = {depth}), "
                         f"got {draft_depth}")

