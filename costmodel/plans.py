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
from typing import Literal


def default_draft_depth(depth: int) -> int:
    """ceil(R / 8) below R: Huginn at R = 32 drafts at 4, Ouro at R = 4 at 1."""
    return max(1, min(depth - 1, -(-depth // 8)))


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
    # "reference": the coda keeps one slot per position, so a prompt is read out at R only
    # (costmodel.exits.EXIT_KV)
    kv: str = "latest"


class Plan:
    """What every schedule shares: the prefill, and counters the decoder and simulator report.

    With ``exits`` (adaptive depth) a position stops at the first depth its rule fires (the
    plan asks with ``Check`` after each block call) or at R; its readout there is final, and it
    leaves the calls that follow. The prompt runs at full depth. With ``drafts`` (adaptive
    drafting, DtV and WFD), a position drafts at the first depth below d its draft rule fires,
    or at d; its draft-rule readouts below d use the depth-d coda slot (drafts are proposals:
    what they attend over does not touch the tokens)."""

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
        # with exits: the first prompt position that is a decoded token (a preempted request's
        # prompt again, in an engine), whose prefill step stops where its rule fires, as when
        # it was decoded; None: every prompt position at full depth
        self.exits_from: int | None = None
        # the reference exit KV rule with a coda that attends: a token's final readout (and a
        # rule's readout that decides its exit) attends over every older token's final one, so
        # it waits until those are made (``after_block``); AR never waits
        self.defer = exits is not None and exits.kv == "reference" and coda_attends
        self.front = prompt_length  # the oldest position whose final readout is not made
        self.held: dict[int, int] = {}  # position -> the depth it waits at for its rule
        self.unread: dict[int, int] = {}  # position -> the depth it stopped at, unread

    def steps(self) -> Steps:
        """The whole schedule: the prefill (unless skipped), then decoding without end."""
        if self.prefill:
            yield from self.prefill_steps()
        yield from self.decode()

    def prefill_steps(self, every_position: bool = False) -> Steps:
        """P over the prompt, R block calls, a readout at each readout depth: of every prompt
        position when the coda attends (its KV is needed later) or ``every_position`` asks.
        Positions from ``exits_from`` on (decoded tokens) go on as decoding takes them: each
        read out and checked after each step (``after_block``), leaving the calls at its exit,
        so their KV is what it was."""
        last = self.prompt_length - 1
        first = self.prompt_length if self.exits is None or self.exits_from is None else \
            min(self.exits_from, self.prompt_length)
        positions, going = tuple(range(first)), tuple(range(first, self.prompt_length))
        attends = self.coda_attends or every_position
        readout = positions if attends else tuple(p for p in (last,) if p < first)
        single = self.exits is not None and self.exits.kv == "reference"
        depths = (self.depth,) if single else self.readout_depths if attends else \
            self.always_read
        yield Call("prelude", positions + going, (0,) * self.prompt_length)
        for r in range(1, self.depth + 1):
            yield Call("block", positions + going, (r,) * (len(positions) + len(going)))
            if r in depths and readout:
                yield Call("coda", readout, (r,) * len(readout))
            if going:
                done = yield from self.after_block(going, (r,) * len(going))
                going = tuple(p for p in going if p not in done)
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
        if self.defer:
            return (yield from self.after_block_deferred(positions, depths))
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

    def after_block_deferred(self, positions: Sequence[int], depths: Sequence[int]
                             ) -> Generator[Event, bool | set[int] | None, set[int]]:
        """``after_block`` under the reference exit KV rule (``defer``). A rule on the states
        decides at once, but a stopped position's final readout waits until every older one's
        is made (``unread``). A rule on the readouts decides with a readout that must attend
        over the older final ones, so a position past the rule's first depth that is not the
        oldest unread waits out of the calls (``held``) until it is: it never steps past a
        depth whose verdict is unknown, so the core KV later positions read is AR's. Readouts
        at the depths always read (a draft's) are made at once, as proposals. Returns the
        positions whose final readout is now made, these or older ones."""
        rule = self.exits
        pairs = list(zip(positions, depths, strict=True))
        checked = [(p, r) for p, r in pairs if r < self.depth]
        exited = set()
        if checked and not rule.every_depth:
            exited = yield Check(*map(tuple, zip(*checked, strict=True)))
        self.unread.update((p, r) for p, r in pairs if r == self.depth or p in exited)
        if rule.every_depth:
            self.held.update((p, r) for p, r in checked if r >= rule.min_depth)
        proposals = {p: r for p, r in pairs if r in self.always_read and r < self.depth}
        return (yield from self.read_final(proposals))

    def read_final(self, proposals: dict[int, int]
                   ) -> Generator[Event, bool | set[int] | None, set[int]]:
        """One coda call with ``proposals`` and every final readout that can be made now (the
        oldest unread position's and the stopped ones that follow it); then, if the oldest
        waits for its rule, its verdict, and again while it exits."""
        done: set[int] = set()
        while True:
            read, p = dict(proposals), self.front
            while p in self.unread:
                read[p] = self.unread.pop(p)
                done.add(p)
                p += 1
            self.front = p
            asked = (p, self.held.pop(p)) if p in self.held else None
            if asked:
                read[p] = asked[1]
            if read:
                order = sorted(read)
                yield Call("coda", tuple(order), tuple(read[q] for q in order))
            if asked is None or p not in (yield Check((p,), (asked[1],))):
                return done  # the oldest unread goes on (back into the calls), or none waits
            done.add(p)
            self.front, proposals = p + 1, {}

    def waits(self, position: int) -> bool:
        """Whether a position stays out of the calls for now (``after_block_deferred``)."""
        return position in self.held or position in self.unread

    def proposal(self, position: int) -> Generator[Event, bool | set[int] | None, None]:
        """A readout to draft from, for a position that stopped below the draft depth with its
        final readout still waiting (a proposal: verified when the final one is made)."""
        depth = self.unread.get(position)
        if depth is not None and depth not in self.always_read:
            yield Call("coda", (position,), (depth,))

    def rolled_back(self, length: int) -> None:
        """Positions from ``length`` on are discarded: none of them waits any more."""
        self.front = length
        for waiting in (self.held, self.unread):
            for p in [p for p in waiting if p >= length]:
                del waiting[p]

    def decode(self) -> Steps:
        """Decoding without end: each schedule's own (costmodel.schedules)."""
        raise NotImplementedError


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
