"""AR: each token runs the prelude, R block steps and the coda before the next one starts. The
baseline every speedup is over."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count
from typing import TYPE_CHECKING, Literal

from ..groups import CallGroup
from ..plans import Bonus, Call, EarlyExit, Plan, Steps
from .base import Schedule, register

if TYPE_CHECKING:
    from ..adaptive import ExitProfile


class ARPlan(Plan):
    """Per token P, then block calls at one position (read out at each readout depth) until it
    exits or reaches R, then commit its final readout."""

    def decode(self) -> Steps:
        for p in count(self.prompt_length):
            self.rounds += 1
            yield Call("prelude", (p,), (0,))
            for r in range(1, self.depth + 1):
                yield Call("block", (p,), (r,))
                if p in (yield from self.after_block((p,), (r,))):
                    break
            yield Bonus(p)


@register
class AR(Schedule):
    title = "AR"
    kind: Literal["ar"] = "ar"

    def plan(self, prompt_length: int, depth: int, *, coda_attends: bool,
             readout_depths: Sequence[int] = (), prefill: bool = True,
             exits: EarlyExit | None = None, drafts: EarlyExit | None = None) -> Plan:
        """AR's plan, with extra readout depths (a depth trace's: every depth)."""
        if drafts is not None:
            raise ValueError("adaptive drafting goes with a schedule that drafts (dtv or wfd)")
        return ARPlan(prompt_length, depth, coda_attends=coda_attends,
                      readout_depths=readout_depths, prefill=prefill, exits=exits)

    def call_groups(self, depth: int, kv_sharing: int = 0) -> list[CallGroup]:
        return [CallGroup("prelude", 1, 1, 1), CallGroup("block", 1, 1, 1),
                CallGroup("block", 1, 1, depth - 1, after_other_part=False),
                CallGroup("coda", 1, 1, 1)]

    def exit_groups(self, profile: ExitProfile, batch: int = 1, continuous: bool = False
                    ) -> list[CallGroup]:
        """Per round (a token of each of ``batch`` sequences): P, a block call at each depth a
        position reaches, and its readouts (every checked depth, or the exit depth only). In
        a batch the tokens exit apart: in step (``wfd``'s batch: the call at depth r runs
        while any sequence's token is still there, with those that are), or continuously
        (the plugin's exit mode on vLLM: each tick a block call over every sequence, each at
        its own token's depth, a new token entering as one exits, the prelude and readout
        calls of a tick holding those entering and reading out)."""
        # tokens that all stop at one depth stay in step, as they entered: AR's calls
        if continuous and batch > 1 and max(profile.probs) < 1.0:
            return _continuous_groups(profile, batch, profile.reads(self))
        depth, read_at = profile.depth, profile.reads(self)
        groups = [CallGroup("prelude", 1, 1, 1), _stepped("block", profile.at_least(1), batch)]
        for r in range(2, depth + 1):
            groups.append(_stepped("block", profile.at_least(r), batch,
                                   after_other_part=read_at(r - 1)))
        if profile.exits.every_depth:
            groups += [_stepped("coda", profile.at_least(r), batch)
                       for r in range(1, depth + 1) if read_at(r)]
        else:
            groups += [_stepped("coda", p, batch) for p in profile.probs if p > 0]
        return [g for g in groups if g.count > 0]

    @classmethod
    def variants(cls, draft_depth: int, depth: int, *, block_length: int | None = None,
                 width_cap: int | None = None, quick: bool = False) -> list[Schedule]:
        return [cls()]


def _stepped(part: str, share: float, batch: int, after_other_part: bool = True) -> CallGroup:
    """The calls at one depth of a batch in step, ``share`` of its sequences' tokens taking
    part: one whenever any does (1 - (1 - share)^B a round), holding those that do."""
    calls = 1.0 - (1.0 - share) ** batch
    rows = share / calls if calls > 0 else 1.0  # per sequence: the pricer multiplies by B
    return CallGroup(part, rows, rows, calls, after_other_part=after_other_part)


def _continuous_groups(profile: ExitProfile, batch: int, read_at) -> list[CallGroup]:
    """A round of continuous depth batching: its ticks (the mean exit depth: each sequence
    spends its token's exit depth in ticks, all at once) each a block call over every sequence;
    the tokens entering (one a sequence a round) in the ticks where any does, the readouts in
    every tick (a rule that reads every checked depth: those at checked depths) or in those
    where a token exits."""
    ticks = profile.mean_depth
    busy = ticks * (1.0 - (1.0 - 1.0 / ticks) ** batch)  # ticks in which some token enters
    groups = [CallGroup("prelude", 1 / busy, 1 / busy, busy),
              CallGroup("block", 1, 1, ticks)]
    if profile.exits.every_depth:
        read = sum(profile.at_least(r) for r in range(1, profile.depth + 1) if read_at(r))
        groups.append(CallGroup("coda", read / ticks, read / ticks, ticks))
    else:
        groups.append(CallGroup("coda", 1 / busy, 1 / busy, busy))
    return groups
