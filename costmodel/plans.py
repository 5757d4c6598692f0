"""The schedules, written once: AR, DtV(k, d) and WFD(d, cap) as plans.

A plan is a generator of events. ``Call`` says which part (P, B or C) runs next over which
positions at which depths; ``Draft``, ``Verify`` and ``Bonus`` say what to do with a position's
latest readout; ``Rollback`` drops the KV of discarded positions. ``Verify`` takes back the
outcome (``plan.send(accepted)``); ``Check`` asks an exit rule (or a draft rule) about positions
just advanced and takes back those it fires for, outcomes learned at run time like
verification (adaptive depth: ``EarlyExit``). The decoder (``wfd.generate``) executes a plan with
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
class Check:
    """Asks the exit rule about positions a block call just brought to ``depths`` (below R):
    the plan is sent back the set of those that exit here (their readout at this depth is
    their token's). With ``draft``, asks the draft rule instead: those that draft here."""

    positions: tuple[int, ...]
    depths: tuple[int, ...]
    draft: bool = False


@dataclass(frozen=True)
class Draft:
    position: int  # its readout at d proposes the token of position + 1
    final: bool = False  # the position exited by d: its readout is final, the draft is its token


@dataclass(frozen=True)
class Verify:
    position: int  # its readout at R checks the draft made from it; the plan is sent the outcome


@dataclass(frozen=True)
class Bonus:
    # its final readout commits the token of position + 1 with no draft to check: DtV's bonus
    # position, or a position that exited by the draft depth (its draft was its token)
    position: int


@dataclass(frozen=True)
class Rollback:
    length: int  # keep the KV of positions 0..length-1 only
    flushed: int = 0  # in-flight positions discarded (WFD)


Event = Call | Check | Draft | Verify | Bonus | Rollback
Steps = Generator[Event, bool | set[int] | None, None]


@dataclass(frozen=True)
class EarlyExit:
    """What a plan needs of an exit rule (wfd.exits): the shallowest depth a position may exit
    at, and whether each position is read out at every depth from there on (the rule reads the
    readouts, or a coda with attention needs them: a later position read out at a depth attends
    over that depth's coda KV). Otherwise only the depth a position exits at is read out."""

    min_depth: int = 1
    every_depth: bool = True


class Plan:
    """What every schedule shares: the prefill, and counters the decoder and simulator report.

    With ``exits`` (adaptive depth) a position stops at the first depth its rule fires (the
    plan asks with ``Check`` after each block call) or at R; its readout there is final, and it
    leaves the calls that follow. The prompt runs at full depth. With ``drafts`` (adaptive
    drafting, DtV and WFD), a position drafts at the first depth below d its draft rule fires,
    or at d; its draft-rule readouts below d use the depth-d coda slot (drafts are proposals:
    what they attend over does not touch the tokens)."""

    kind = "ar"

    def __init__(self, prompt_length: int, depth: int, *, coda_attends: bool,
                 readout_depths: Sequence[int] = (), prefill: bool = True,
                 exits: EarlyExit | None = None, drafts: EarlyExit | None = None):
        if prompt_length < 1:
            raise ValueError("the prompt is empty")
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        if exits is not None and not 1 <= exits.min_depth <= depth:
            raise ValueError(f"the minimum exit depth must be in 1..{depth}, "
                             f"got {exits.min_depth}")
        self.prompt_length, self.depth = prompt_length, depth
        self.coda_attends = coda_attends  # a coda with attention reads every prompt position out
        self.exits, self.drafts = exits, drafts
        # read out whatever else happens (the draft depth, R, a depth trace's); with exits, the
        # coda keeps a slot for every depth a position may exit at
        self.always_read = sorted({*readout_depths, depth})
        exit_depths = range(exits.min_depth, depth + 1) if exits else ()
        self.readout_depths = sorted({*self.always_read, *exit_depths})
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
        attends = self.coda_attends or every_position
        readout = positions if attends else (last,)
        depths = self.readout_depths if attends else self.always_read
        yield Call("prelude", positions, (0,) * len(positions))
        for r in range(1, self.depth + 1):
            yield Call("block", positions, (r,) * len(positions))
            if r in depths:
                yield Call("coda", readout, (r,) * len(readout))
        yield Bonus(last)

    def read_at(self, depth: int) -> bool:
        """Whether ``after_block`` reads out a position at ``depth`` whatever its exit."""
        every = self.exits is not None and self.exits.every_depth
        return depth in (self.readout_depths if every else self.always_read)

    def draft_check(self, position: int, depth: int, draft_depth: int
                    ) -> Generator[Event, bool | set[int] | None, bool]:
        """Adaptive drafting: whether ``position``, at ``depth`` below the draft depth, drafts
        now (its draft rule asked, after a readout into the draft slot when the rule reads one
        and none was made)."""
        rule = self.drafts
        if rule is None or depth < rule.min_depth:
            return False
        read = self.read_at(depth)
        if rule.every_depth and not read:
            yield Call("coda", (position,), (draft_depth,))
            read = True
        fired = position in (yield Check((position,), (depth,), draft=True))
        if fired and not read:  # a rule on the states: the draft's readout now
            yield Call("coda", (position,), (draft_depth,))
        return fired

    def after_block(self, positions: Sequence[int], depths: Sequence[int]
                    ) -> Generator[Event, bool | set[int] | None, set[int]]:
        """What follows a block call over ``positions`` at ``depths``: their readouts and, with
        exits, the rule's verdict. Returns the positions whose readout is now final (exited, or
        at R)."""
        pairs = list(zip(positions, depths, strict=True))
        exited: set[int] = set()
        checked = [(p, r) for p, r in pairs if r < self.depth] if self.exits else []
        every = self.exits is not None and self.exits.every_depth
        if checked and not every:  # the rule reads the states: ask first, read out the exits
            exited = yield Check(*map(tuple, zip(*checked, strict=True)))
        read = [(p, r) for p, r in pairs if self.read_at(r) or p in exited]
        if read:
            yield Call("coda", *map(tuple, zip(*read, strict=True)))
        if checked and every:
            exited = yield Check(*map(tuple, zip(*checked, strict=True)))
        return set(exited) | {p for p, r in pairs if r == self.depth}

    def decode(self) -> Steps:
        """AR: per token P, then block calls at one position (read out at each readout depth)
        until it exits or reaches R, then commit its final readout."""
        for p in count(self.prompt_length):
            self.rounds += 1
            yield Call("prelude", (p,), (0,))
            for r in range(1, self.depth + 1):
                yield Call("block", (p,), (r,))
                if p in (yield from self.after_block((p,), (r,))):
                    break
            yield Bonus(p)


class DtVPlan(Plan):
    """DtV(k, d), nested reuse: draft k + 1 positions one by one at depth d, continue them all
    from d to R in R - d batched calls, verify the k drafts in order, commit the correction at
    the first mismatch or the bonus token when all match, roll back the rest. With exits a
    position that exits by d drafts its final token (committed as is), and the others leave the
    batched calls as they exit. With adaptive drafts each position drafts where its draft rule
    fires, never deeper than the one before, and they continue together each from its own depth
    (the older never shallower, as in a wave)."""

    kind = "dtv"

    def __init__(self, prompt_length: int, depth: int, *, block_length: int, draft_depth: int,
                 **common):
        super().__init__(prompt_length, depth, readout_depths=(draft_depth,), **common)
        check_draft_depth(draft_depth, depth)
        if block_length < 1:
            raise ValueError(f"block length must be at least 1, got {block_length}")
        self.block_length, self.draft_depth = block_length, draft_depth
        self.lookahead = lookahead("dtv", block_length=block_length)

    def decode(self) -> Steps:
        k, d = self.block_length, self.draft_depth
        cur = self.prompt_length  # the position holding the newest committed token
        while True:
            self.rounds += 1
            drafted = tuple(range(cur, cur + k + 1))
            settled: set[int] = set()  # exited by d: the draft is the final token
            at: dict[int, int] = {}  # the depth each drafted position stopped drafting at
            limit = d  # adaptive drafts never go deeper than the one before (exactness)
            for p in drafted:
                yield Call("prelude", (p,), (0,))
                for r in range(1, limit + 1):  # the last one's readout only fills the coda's KV
                    yield Call("block", (p,), (r,))
                    at[p] = r
                    if p in (yield from self.after_block((p,), (r,))):
                        settled.add(p)  # its KV stands in for every deeper depth: no limit
                        break
                    if r == limit:  # below d: where the one before drafted; read out here
                        if not self.read_at(r):
                            yield Call("coda", (p,), (d,))
                        break
                    if (yield from self.draft_check(p, r, d)):
                        limit = r
                        break
                if p < cur + k:
                    yield Draft(p, final=p in settled)
            # the rest continue together, each a step per call from where it drafted (the older
            # never shallower), leaving as they exit or reach R
            going = [p for p in drafted if p not in settled]
            while going:
                for p in going:
                    at[p] += 1
                yield Call("block", tuple(going), tuple(at[p] for p in going))
                done = yield from self.after_block(going, [at[p] for p in going])
                going = [p for p in going if p not in done]
            accepted = 0
            while accepted < k:
                p = cur + accepted
                if p in settled:
                    yield Bonus(p)
                elif not (yield Verify(p)):
                    break
                accepted += 1
            if accepted == k:
                yield Bonus(cur + k)
            cur += accepted + 1
            yield Rollback(cur)


class WFDPlan(Plan):
    """WFD(d, cap): each tick is one block call advancing every in-flight position one step, each
    at its own depth. The newest position reaching d drafts (its token enters next tick, when
    the cap allows); the oldest reaching R verifies, in the same coda call. A rejection commits
    the correction, flushes every younger position and re-enters the correction at depth 0.
    With exits a position leaves the wave at its exit depth and waits, out of the calls, until
    every older one is committed; one that exits by d drafts its final token. With adaptive
    drafts the newest drafts where its draft rule fires (by d), and the next enters sooner."""

    kind = "wfd"

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
        self.lookahead = lookahead("wfd", width=self.width)

    def decode(self) -> Steps:
        d, cap = self.draft_depth, self.width_cap
        # [position, depth, final, drafted: 0 not yet, 1 a proposal, 2 its final token], oldest
        # first
        wave: list[list[int]] = []
        waiting: int | None = self.prompt_length  # the position whose token waits to enter
        while True:
            self.rounds += 1  # a tick: its prelude call (if a token enters), B, its coda call
            going = [entry for entry in wave if not entry[2]]
            if waiting is not None and (cap is None or len(going) < cap):
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
            for entry in going:
                entry[2] = entry[0] in done
            p, r, final, drafted = newest
            if newest in going and not drafted and (
                    r == d or final or (yield from self.draft_check(p, r, d))):
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
                    wave.clear()
                    waiting = p + 1  # the correction re-enters at depth 0


def make_plan(schedule: str, prompt_length: int, depth: int, *, coda_attends: bool,
              draft_depth: int | None = None, block_length: int = 4,
              width_cap: int | None = None, readout_depths: Sequence[int] = (),
              prefill: bool = True, exits: EarlyExit | None = None,
              drafts: EarlyExit | None = None) -> Plan:
    """A plan by name: "ar" (with extra readout depths, for a depth trace), "dtv" or "wfd";
    ``exits``: adaptive depth; ``drafts``: adaptive drafting (DtV, WFD)."""
    if drafts is not None and schedule == "ar":
        raise ValueError("adaptive drafting goes with dtv or wfd")
    common = dict(coda_attends=coda_attends, prefill=prefill, exits=exits, drafts=drafts)
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

    def check(self, positions: tuple[int, ...], depths: tuple[int, ...], draft: bool = False
              ) -> set[int]:
        raise NotImplementedError

    def draft(self, position: int, final: bool = False) -> None: ...

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
        reply: bool | set[int] | None = None
        while not self.done:
            try:
                event = steps.send(reply)
            except StopIteration:
                return None
            reply = None
            if isinstance(event, Call):
                return event
            if isinstance(event, Check):
                reply = self.check(event.positions, event.depths, event.draft)
            elif isinstance(event, Draft):
                self.draft(event.position, event.final)
            elif isinstance(event, Verify):
                reply = self.verify(event.position)
            elif isinstance(event, Bonus):
                self.bonus(event.position)
            else:
                self.rollback(event.length)
        return None


def check_draft_depth(draft_depth: int, depth: int) -> None:
    if depth < 2:
        raise ValueError(f"drafting needs a depth R of at least 2 (a draft below R), got {depth}")
    if not 1 <= draft_depth < depth:
        raise ValueError(f"draft depth must be in 1..{depth - 1} (below R = {depth}), "
                         f"got {draft_depth}")


def check_kv_sharing(kv_sharing: int, depth: int) -> None:
    if not 0 <= kv_sharing <= depth:
        raise ValueError(f"KV sharing is 0 (a slot per depth) or at most R = {depth} slots, got "
                         f"{kv_sharing}")
