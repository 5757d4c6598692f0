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

    def exit_groups(self, profile: ExitProfile) -> list[CallGroup]:
        """Per token: P, a block call at each depth the position reaches, and its readouts
        (every checked depth, or the exit depth only)."""
        depth, read_at = profile.depth, profile.reads(self)
        groups = [CallGroup("prelude", 1, 1, 1), CallGroup("block", 1, 1, 1)]
        for r in range(2, depth + 1):
            groups.append(CallGroup("block", 1, 1, profile.at_least(r),
                                    after_other_part=read_at(r - 1)))
        readouts = sum(profile.at_least(r) for r in range(1, depth + 1) if read_at(r)) \
            if profile.exits.every_depth else 1.0
        groups.append(CallGroup("coda", 1, 1, readouts))
        return groups

    @classmethod
    def variants(cls, draft_depth: int, depth: int, *, block_length: int | None = None,
                 width_cap: int | None = None, quick: bool = False) -> list[Schedule]:
        return [cls()]
