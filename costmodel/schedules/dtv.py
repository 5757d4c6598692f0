"""DtV(k, d), draft-then-verify with nested reuse: k + 1 positions drafted one by one at depth
d, continued together from d to R, verified in order; the correction or the bonus token
commits."""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
from pydantic import Field

from ..groups import CallGroup, binomial, expected_tokens_per_round
from ..plans import Bonus, Call, Draft, Event, Plan, Rollback, Steps, Verify, check_draft_depth
from .base import Drafting, Schedule, register

if TYPE_CHECKING:
    from ..adaptive import ExitProfile

MAX_BLOCK_LENGTH = 32  # the block lengths a prediction searches: 1..32
QUICK_BLOCK_LENGTHS = (1, 2, 4, 8, 16, 32)  # the quick search's (wfd generate --schedule auto)


class DtVPlan(Plan):
    """DtV(k, d), nested reuse: draft k + 1 positions one by one at depth d, continue them all
    from d to R in R - d batched calls, verify the k drafts in order, commit the correction at
    the first mismatch or the bonus token when all match, roll back the rest. With exits a
    position that exits by d drafts its final token (committed as is), and the others leave the
    batched calls as they exit. With adaptive drafts each position drafts where its draft rule
    fires, never deeper than the one before, and they continue together each from its own depth
    (the older never shallower, as in a wave)."""

    def __init__(self, prompt_length: int, depth: int, *, block_length: int, draft_depth: int,
                 **common):
        super().__init__(prompt_length, depth, readout_depths=(draft_depth,), **common)
        check_draft_depth(draft_depth, depth)
        if block_length < 1:
            raise ValueError(f"block length must be at least 1, got {block_length}")
        self.block_length, self.draft_depth = block_length, draft_depth
        self.lookahead = block_length + 1

    def decode(self) -> Steps:
        cur = self.prompt_length  # the position holding the newest committed token
        while True:
            self.rounds += 1
            drafted, settled, final, at = yield from self.draft_round(cur)
            # the rest continue together, each a step per call from where it drafted (the older
            # never shallower), leaving as they exit or reach R; a position waiting for older
            # readouts (``Plan.defer``) rejoins when they are made
            while len(final) < len(drafted):
                going = [p for p in drafted if p not in final and not self.waits(p)]
                for p in going:
                    at[p] += 1
                yield Call("block", tuple(going), tuple(at[p] for p in going))
                final |= yield from self.after_block(going, [at[p] for p in going])
            accepted, drafts = 0, len(drafted) - 1  # k, or fewer where drafting had to stop
            while accepted < drafts:
                p = cur + accepted
                if p in settled:
                    yield Bonus(p)
                elif not (yield Verify(p)):
                    break
                accepted += 1
            if accepted == drafts:
                yield Bonus(cur + drafts)
            cur += accepted + 1
            yield Rollback(cur)
            self.rolled_back(cur)

    def draft_round(self, cur: int) -> Generator[
            Event, bool | set[int] | None, tuple[list[int], set[int], set[int], dict[int, int]]]:
        """Draft positions cur, cur + 1, ... one by one at d (k + 1 of them), each drafting the
        next one's token. Returns the positions drafted; those settled (exited by d with their
        final readout made: the draft is the token); those whose final readout is made; and the
        depth each stopped drafting at. A position that must wait for older readouts below d
        (``Plan.defer``) ends the round's drafting there: it is the round's last, with no draft
        of its own."""
        k, d = self.block_length, self.draft_depth
        settled: set[int] = set()
        final: set[int] = set()
        at: dict[int, int] = {}
        drafted: list[int] = []
        limit = d  # adaptive drafts never go deeper than the one before (exactness)
        for p in range(cur, cur + k + 1):
            drafted.append(p)
            yield Call("prelude", (p,), (0,))
            for r in range(1, limit + 1):  # the last one's readout only fills the coda's KV
                yield Call("block", (p,), (r,))
                at[p] = r
                final |= yield from self.after_block((p,), (r,))
                if p in final:
                    settled.add(p)  # its KV stands in for every deeper depth: no limit
                    break
                if p in self.unread:  # stopped; its final readout waits: draft a proposal
                    yield from self.proposal(p)
                    break
                if p in self.held and r < d:
                    return drafted, settled, final, at
                if r == limit:  # below d: where the one before drafted; read out here
                    if not self.read_at(r) and not self.defer:
                        yield Call("coda", (p,), (d,))
                    break
                if (yield from self.draft_check(p, r, d)):
                    limit = r
                    break
            if p < cur + k:
                yield Draft(p, final=p in settled)
        return drafted, settled, final, at


@register
class DtV(Drafting):
    title = "DtV"
    kind: Literal["dtv"] = "dtv"
    block_length: Annotated[int, Field(ge=1)]

    def plan(self, prompt_length, depth, *, coda_attends, readout_depths=(), prefill=True,
             exits=None, drafts=None) -> Plan:
        return DtVPlan(prompt_length, depth, block_length=self.block_length,
                       draft_depth=self.draft_depth, coda_attends=coda_attends, prefill=prefill,
                       exits=exits, drafts=drafts)

    def lookahead(self, depth: int) -> int:  # k drafts and the bonus position
        return self.block_length + 1

    def tokens_per_round(self, alpha: float) -> float:
        return float(expected_tokens_per_round(alpha, self.block_length))

    def fill_ticks(self, depth: int) -> int:
        """A first round's block calls (``call_groups``'), at whose end its tokens commit."""
        d = self.draft_depth
        return (self.block_length + 1) * d + depth - d

    def positions_per_call(self, depth: int) -> int:
        return self.block_length + 1

    def call_groups(self, depth: int, kv_sharing: int = 0) -> list[CallGroup]:
        """Per round (basis ("dtv", k)): k + 1 drafts of d steps each, then the continuation's
        R - d batched calls and its readout."""
        self.check(depth)
        k, d = self.block_length, self.draft_depth
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

    def exit_groups(self, profile: ExitProfile, batch: int = 1, continuous: bool = False
                    ) -> list[CallGroup] | None:
        """DtV(k, d) with exits, per round (basis ("dtv", k)): k + 1 drafts of up to d steps each,
        then continuation calls over the positions still going; None under the reference exit
        KV rule, whose waiting positions (``Plan.defer``) are simulated call by call."""
        if profile.exits.kv == "reference":
            return None
        k, d, depth = self.block_length, self.draft_depth, profile.depth
        read_at = profile.reads(self)
        drafted = k + 1
        per_round = ("dtv", k)
        groups = [CallGroup("prelude", 1, 1, drafted, per_round),
                  CallGroup("block", 1, 1, drafted, per_round)]
        for r in range(2, d + 1):
            groups.append(CallGroup("block", 1, 1, drafted * profile.at_least(r), per_round,
                                    after_other_part=read_at(r - 1)))
        # without every depth's readouts, one per draft: at d, or where it exits before d
        readouts = sum(profile.at_least(r) for r in range(1, d + 1) if read_at(r)) \
            if profile.exits.every_depth else 1.0
        groups.append(CallGroup("coda", 1, 1, drafted * readouts, per_round))
        for r in range(d + 1, depth + 1):
            going = binomial(drafted, profile.at_least(r))
            # the call after a depth with readouts follows the coda: with every-depth readouts, or
            # (state rules) when a position exited at r - 1; r = d + 1 follows the drafts' readouts
            if r == d + 1 or read_at(r - 1):
                after_coda = np.ones(drafted + 1)
            else:
                stopped = profile.at_least(r - 1) - profile.at_least(r)
                rest = 1.0 - profile.at_least(r)  # exited before r
                share = stopped / rest if rest > 0 else 0.0
                after_coda = 1.0 - (1.0 - share) ** (drafted - np.arange(drafted + 1))
            for n in range(1, drafted + 1):
                if going[n] > 0:
                    groups.append(CallGroup("block", n, 1, going[n] * after_coda[n], per_round))
                    groups.append(CallGroup("block", n, 1, going[n] * (1 - after_coda[n]),
                                            per_round, after_other_part=False))
            # read out: every position going, or only those exiting at r
            reading = going if read_at(r) else binomial(drafted, profile.probs[r - 1])
            for n in range(1, drafted + 1):
                if reading[n] > 0:
                    groups.append(CallGroup("coda", n, 1, reading[n], per_round))
        return groups

    @classmethod
    def variants(cls, draft_depth: int, depth: int, *, block_length: int | None = None,
                 width_cap: int | None = None, quick: bool = False) -> list[Schedule]:
        lengths = [block_length] if block_length else (
            QUICK_BLOCK_LENGTHS if quick else range(1, MAX_BLOCK_LENGTH + 1))
        return [cls(draft_depth=draft_depth, block_length=k) for k in lengths]

    def fields(self, depth: int) -> dict[str, int | None]:
        return {"draft_depth": self.draft_depth, "width": self.block_length + 1,
                "block_length": self.block_length}

    @classmethod
    def label(cls, draft_depth=None, block_length=None, width=None, width_cap=None) -> str:
        return f"DtV k={block_length} d={draft_depth}"

    @classmethod
    def of(cls, draft_depth=None, block_length=None, width_cap=None) -> Schedule:
        return cls(draft_depth=draft_depth, block_length=4 if block_length is None
                   else block_length)

    def run_stats(self, plan: Plan, verifier_stats: dict) -> dict[str, object]:
        return {**verifier_stats, "rounds": plan.rounds, "flushed_positions": 0,
                **self.batch_stats(plan)}

    def batch_stats(self, plan: Plan) -> dict[str, object]:
        return {"block_length": self.block_length, "draft_depth": self.draft_depth}
