"""What a schedule is to the rest of the project: its parameters (a frozen spec), its plan, its
closed-form call groups, what it reserves in the KV cache, how its results are labelled and what
its runs report. The cost model, the simulator, the decoder, the search and both command lines
loop over the registry (``SCHEDULES``) instead of naming schedules: a new schedule is one module
that subclasses ``Schedule`` and registers itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, ClassVar

from pydantic import Field

from ..groups import CallGroup
from ..plans import EarlyExit, Plan, check_draft_depth
from ..specs import Spec

if TYPE_CHECKING:
    from ..adaptive import ExitProfile

SCHEDULES: dict[str, type[Schedule]] = {}


def register(cls: type[Schedule]) -> type[Schedule]:
    """Add a schedule to the registry under its name, its ``kind`` field's value (a class
    decorator)."""
    cls.name = cls.model_fields["kind"].default
    SCHEDULES[cls.name] = cls
    return cls


def get(name: str) -> type[Schedule]:
    """The schedule registered as ``name``; a ValueError naming those that are."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; use {registered()}")
    return SCHEDULES[name]


def registered() -> str:
    """The registered schedules' names, in words: "ar, dtv or wfd"."""
    *rest, last = SCHEDULES
    return f"{', '.join(rest)} or {last}" if rest else last


def widest(depth: int, draft_depth: int = 1, **options) -> tuple[int, int]:
    """(the most positions one block call holds, the most positions written ahead) over every
    registered schedule's variants at ``draft_depth`` (``Schedule.variants``'s options): what a
    KV cache that may run any of them must hold."""
    every = [s for kind in SCHEDULES.values() for s in kind.variants(draft_depth, depth,
                                                                      **options)]
    return max(s.positions_per_call(depth) for s in every), max(s.lookahead(depth) for s in every)


class Schedule(Spec):
    """A schedule's parameters, and everything the project needs to know of it. Subclasses give
    a ``kind`` field whose only value is their name (the registry key, in their JSON) and a
    ``title``."""

    name: ClassVar[str]  # set by ``register``
    title: ClassVar[str]
    # drafts at a shallow depth and verifies at R: verifier statistics, a draft depth, an
    # acceptance; AR (False) is the baseline speedups are over
    drafts: ClassVar[bool] = False
    # whether a batch's sequences read out in the same calls (AR's tokens and DtV's rounds run in
    # step); a WFD wave's readouts fall on ticks of its own phase, each wave's another
    in_phase: ClassVar[bool] = True

    # --- the run (plans.py executes it: the decoder with tensors, the simulator with draws)

    def plan(self, prompt_length: int, depth: int, *, coda_attends: bool,
             readout_depths: Sequence[int] = (), prefill: bool = True,
             exits: EarlyExit | None = None, drafts: EarlyExit | None = None) -> Plan:
        raise NotImplementedError

    def lookahead(self, depth: int) -> int:
        """Positions past the committed ones the schedule may write (the static KV cache holds
        them beside the sequence, and the memory model counts them)."""
        return 0

    def tokens_per_round(self, alpha: float) -> float:
        """Tokens a sequence commits in one of its rounds on average, the points between which
        a batch admits a newcomer (an AR token; a DtV round; a WFD tick commits a share of
        one, so a newcomer waits for no token)."""
        return 1.0

    def positions_per_call(self, depth: int) -> int:
        """The most positions one of its block calls holds, per sequence."""
        return 1

    def fill_ticks(self, depth: int) -> int:
        """Block calls a wave makes after its prompt before its first commit, over which it
        commits nothing (a pipeline filling: WFD's R to its first readout at R; a DtV round's,
        whose tokens commit at its end; ``tokens_per_round`` of them): a step of the plugin's
        no newcomer shortens. 0 where every step commits as the steady state does (AR)."""
        return 0

    def check(self, depth: int) -> None:
        """Refuse parameters that do not fit R (a ValueError)."""

    # --- the closed forms (docs/costmodel.md, "Schedules")

    def call_groups(self, depth: int, kv_sharing: int = 0) -> list[CallGroup]:
        raise NotImplementedError

    def exit_groups(self, profile: ExitProfile, batch: int = 1, continuous: bool = False
                    ) -> list[CallGroup] | None:
        """With exits (adaptive depth): the call groups, or None where the schedule is simulated
        call by call instead (costmodel.adaptive); ``batch`` sequences in step, or in
        continuous depth batching (AR's: the others price a sequence's own calls)."""
        return None

    @classmethod
    def variants(cls, draft_depth: int, depth: int, *, block_length: int | None = None,
                 width_cap: int | None = None, quick: bool = False) -> list[Schedule]:
        """The configurations to price at a draft depth, the best of which is its prediction
        (DtV: every block length unless one is given); ``quick``: the few the quick search
        (``wfd generate --schedule auto``) tries."""
        raise NotImplementedError

    def refinements(self, depth: int) -> list[Schedule]:
        """Configurations the exhaustive search tries beside a near-best one (WFD: its width
        caps)."""
        return []

    # --- reports

    def fields(self, depth: int) -> dict[str, int | None]:
        """The parameters a prediction or a search result reports."""
        return {"draft_depth": None, "width": None, "block_length": None}

    @classmethod
    def label(cls, draft_depth: int | None = None, block_length: int | None = None,
              width: int | None = None, width_cap: int | None = None) -> str:
        """A configuration as tables name it, from its reported fields."""
        return cls.title

    def flags(self) -> str:
        """The `wfd generate` options that run it."""
        options = [f"--schedule {self.name}"]
        for field, value in self.model_dump(exclude={"kind"}).items():
            if value is not None:
                options.append(f"--{field.replace('_', '-')} {value}")
        return " ".join(options)

    @classmethod
    def of(cls, draft_depth: int | None = None, block_length: int | None = None,
           width_cap: int | None = None) -> Schedule:
        """The schedule from a command line's or a caller's options, those it does not take
        ignored (``wfd generate --block-length`` has a default whatever the schedule)."""
        return cls()

    def run_stats(self, plan: Plan, verifier_stats: dict) -> dict[str, object]:
        """What a decode with this schedule reports (wfd generate --json)."""
        return {"acceptance": None, "flushed_positions": 0, "forced_acceptance": False}

    def batch_stats(self, plan: Plan) -> dict[str, object]:
        """Its parameters as a batched decode reports them."""
        return {}


class Drafting(Schedule):
    """A schedule that drafts at depth d below R and verifies the drafts at R."""

    drafts: ClassVar[bool] = True
    draft_depth: Annotated[int, Field(ge=1)]

    def check(self, depth: int) -> None:
        check_draft_depth(self.draft_depth, depth)
