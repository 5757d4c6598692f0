"""What a run of one schedule fixes before its prompts (``RunSetup``), shared by single and
batched generation: the depth, the schedule with its parameters, the exit and draft rules, each
prompt's plan and verifier."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from costmodel.exits import ExitRule, Rule
from costmodel.plans import EarlyExit, Plan
from costmodel.schedules import Schedule, get, widest
from costmodel.simulate import acceptance_draws

from .exits import check_rule
from .sampling import GenerationError, Sampling, Verifier


def _named(name: str, model: nn.Module, depth: int, draft_depth: int | None,
           block_length: int | None, width_cap: int | None) -> Schedule:
    """The registered schedule ``name`` with the options it takes (the draft depth the model's
    own where none is given); what it cannot run at R in one line."""
    from pydantic import ValidationError

    from costmodel.errors import validation_message
    from costmodel.predict import resolve_draft_depth

    try:
        kind = get(name)
        if not kind.drafts:
            return kind()
        return kind.of(resolve_draft_depth(model.config, depth, None, draft_depth),
                       block_length, width_cap)
    except ValidationError as exc:
        raise GenerationError(validation_message(exc)) from None
    except ValueError as exc:
        raise GenerationError(str(exc)) from None


@dataclass(frozen=True)
class RunSetup:
    """What a run of one schedule fixes before its prompts, shared by single and batched
    generation: the depth, the schedule with its parameters (the draft depth the model's own,
    ceil(R / 8) unless its config names one, where none is given), each prompt's plan, and each
    prompt's verifier."""

    schedule: Schedule
    depth: int
    coda_attends: bool
    exit_rule: Rule | None = None
    draft_rule: ExitRule | None = None

    @classmethod
    def of(cls, model: nn.Module, schedule: str | Schedule, depth: int | None,
           draft_depth: int | None = None, block_length: int | None = None,
           width_cap: int | None = None, exit_rule: Rule | None = None,
           draft_rule: ExitRule | None = None) -> RunSetup:
        """``schedule``: a Schedule, or a registered name with its options (those it does not
        take are ignored)."""
        depth = model.config.depth if depth is None else depth  # 0 is refused, not the default
        if isinstance(schedule, str):
            schedule = _named(schedule, model, depth, draft_depth, block_length, width_cap)
        if exit_rule is not None:
            check_rule(exit_rule, model, depth)
        if draft_rule is not None:
            if not schedule.drafts:
                raise GenerationError("adaptive drafting (--draft-when) goes with a schedule "
                                      "that drafts (dtv or wfd)")
            check_rule(draft_rule, model, schedule.draft_depth)
        return cls(schedule, depth, model.config.coda_layers > 0, exit_rule, draft_rule)

    @property
    def exits(self) -> EarlyExit | None:
        rule = self.exit_rule
        return None if rule is None else rule.for_plan(self.coda_attends, self.depth)

    @property
    def drafts(self) -> EarlyExit | None:
        """A draft rule's readouts are proposals' (whatever the coda attends over)."""
        rule = self.draft_rule
        return None if rule is None else EarlyExit(rule.min_depth, rule.reads_readouts)

    def plan(self, prompt_length: int, readout_depths: Sequence[int] = ()) -> Plan:
        """The schedule's plan for a prompt; a combination it cannot run in one line."""
        try:
            return self.schedule.plan(prompt_length, self.depth, coda_attends=self.coda_attends,
                                      readout_depths=readout_depths, exits=self.exits,
                                      drafts=self.drafts)
        except ValueError as exc:
            raise GenerationError(str(exc)) from None

    def verifier(self, sampling: Sampling, prompt_length: int, max_new_tokens: int,
                 force_acceptance: float | None, seed: int) -> Verifier:
        """A prompt's verifier: with ``force_acceptance``, the seeded outcomes the simulator
        draws for the same run (a schedule that drafts nothing verifies nothing)."""
        forced = None if force_acceptance is None or not self.schedule.drafts else \
            acceptance_draws(force_acceptance, max_new_tokens + 1, seed)
        return Verifier(sampling, forced, first_position=prompt_length)


def widest_lookahead(depth: int) -> int:
    """Room in the cache for any schedule the quick search may choose (DtV's k + 1 at its
    longest block, WFD's W + 1 at its widest wave)."""
    return widest(depth, quick=True)[1]
