"""What a run of one schedule fixes before its prompts (``RunSetup``), shared by single and
batched generation: the depth, the schedule with its parameters, the exit and draft rules, each
prompt's plan and verifier."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pydantic import ValidationError
from torch import nn

from costmodel.errors import validation_message
from costmodel.exits import ExitRule, Rule
from costmodel.plans import EarlyExit, Plan
from costmodel.schedules import Schedule, get, widest
from costmodel.simulate import acceptance_draws

from .checkpoint import DTYPE_NAMES
from .exits import check_rule
from .options import GenerationError, RunOptions
from .sampling import Sampling, Verifier


def _named(options: RunOptions, model: nn.Module, depth: int) -> Schedule:
    """The registered schedule ``options`` names with the parameters it takes (the draft depth
    the model's own where neither it nor a width is given); what it cannot run at R in one
    line."""
    from costmodel.predict import resolve_draft_depth

    try:
        kind = get(options.schedule)
        if not kind.drafts:
            if options.width is not None or options.draft_depth is not None:
                # it drafts nothing, but a draft depth R cannot have is refused, not ignored
                resolve_draft_depth(model.config, depth, options.width, options.draft_depth)
            return kind()
        draft_depth = resolve_draft_depth(model.config, depth, options.width,
                                          options.draft_depth)
        return kind.of(draft_depth, options.block_length, options.width_cap)
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

    options: RunOptions
    schedule: Schedule
    depth: int
    coda_attends: bool
    exit_rule: Rule | None = None

    @classmethod
    def of(cls, model: nn.Module, options: RunOptions, schedule: Schedule | None = None
           ) -> RunSetup:
        """The run ``options`` asks of ``model``, checked against it; ``schedule`` in place of
        the one it names (auto's probe runs AR)."""
        depth = model.config.depth if options.depth is None else options.depth
        if schedule is None:
            schedule = options.schedule if isinstance(options.schedule, Schedule) else \
                _named(options, model, depth)
        dtype = DTYPE_NAMES[next(model.parameters()).dtype]
        if options.dtype is not None and options.dtype != dtype:
            raise GenerationError(f"the run asks for {options.dtype}; the model is in {dtype}")
        rule = options.rule(depth)
        if rule is not None:
            check_rule(rule, model, depth)
        if options.draft_rule is not None:
            check_rule(options.draft_rule, model, schedule.draft_depth)
        return cls(options, schedule, depth, model.config.coda_layers > 0, rule)

    @property
    def exit_kv(self) -> str:
        """The exit KV rule the cache keeps (costmodel.exits.EXIT_KV)."""
        return self.exit_rule.kv if isinstance(self.exit_rule, ExitRule) else "latest"

    @property
    def draft_rule(self) -> ExitRule | None:
        return self.options.draft_rule

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

    def verifier(self, prompt_length: int, max_new_tokens: int, seed: int,
                 sampling_seed: int | None = None) -> Verifier:
        """A prompt's verifier: with forced acceptance, the seeded outcomes the simulator draws
        for the same run (a schedule that drafts nothing verifies nothing); its sampling seeded
        by ``sampling_seed`` where given, else by the run's."""
        accept = self.options.force_acceptance
        forced = None if accept is None or not self.schedule.drafts else \
            acceptance_draws(accept, max_new_tokens + 1, seed)
        sampling = self.sampling if sampling_seed is None else replace(self.sampling,
                                                                       seed=sampling_seed)
        return Verifier(sampling, forced, first_position=prompt_length)

    @property
    def sampling(self) -> Sampling:
        """The caller's own sampling rule, or the one of the run's temperature, top-p and
        seed."""
        o = self.options
        return o.sampling if o.sampling is not None else Sampling(o.temperature, o.top_p, o.seed)


def widest_lookahead(depth: int) -> int:
    """Room in the cache for any schedule the quick search may choose (DtV's k + 1 at its
    longest block, WFD's W + 1 at its widest wave)."""
    return widest(depth, quick=True)[1]
