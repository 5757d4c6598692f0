"""The run object: every setting of one decode (the schedule and its parameters, the depth, KV
sharing, the exit and draft rules, sampling, the timing modes, the execution mode and dtype),
checked when it is built. `wfd generate` builds one from its options, and ``generate`` and
``decode_batch`` take one (or the same settings as keywords, which they build one from). What
needs the model (a draft depth below its R, a gate it has) is checked once
the model is known (``wfd.settings.RunSetup``). No torch: a command refuses bad settings before
it loads any."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from costmodel.errors import validation_message
from costmodel.exits import ExitRule, ForcedExits
from costmodel.schedules import SCHEDULES, Schedule

AUTO = "auto"  # the cost model picks the schedule from the prompt's acceptance


SEEDS = 2 ** 32  # sampling seeds are 0..SEEDS-1


class GenerationError(ValueError):
    """A request the model cannot serve (prompt too long, bad depth), in one line."""


class RunOptions(BaseModel):
    """One decode's settings. ``exit_rule`` and ``draft_rule`` take a rule (costmodel.exits) or
    its text, ``RULE[:THRESHOLD]``; ``sampling`` a ``wfd.sampling.Sampling`` of the caller's own
    (teacher forcing, say) in place of ``temperature``, ``top_p`` and ``seed``'s."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    schedule: str | Schedule = "ar"  # a registered name, "auto", or a Schedule
    max_new_tokens: int = Field(64, ge=1)
    depth: int | None = Field(None, ge=1)  # None: the model's R
    draft_depth: int | None = Field(None, ge=1)  # None: the model's default, or from width
    width: int | None = Field(None, ge=2)  # WFD's W: draft depth ceil(R / W)
    width_cap: int | None = Field(None, ge=1)
    block_length: int | None = Field(None, ge=1)
    kv_sharing: int = Field(0, ge=0)
    exit_rule: ExitRule | ForcedExits | None = None
    min_depth: int = Field(1, ge=1)
    # what later tokens read of an exited token's skipped depths (costmodel.exits.EXIT_KV):
    # "latest" (its KV at its exit depth) or "reference" (the public Huginn code's)
    exit_kv: Literal["latest", "reference"] = "latest"
    force_exits: str | None = None  # timing: exit depths drawn from "DEPTH:P,..."
    draft_rule: ExitRule | None = None
    temperature: float = Field(0.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1)
    # seeds sampling, forced outcomes and Huginn's initial state; (seed, position) seeds a
    # 64-bit generator seed, so a seed stays below 2^32
    seed: int = Field(0, ge=0, lt=SEEDS)
    sampling: Any = None
    stop_tokens: frozenset[int] = frozenset()
    force_acceptance: float | None = Field(None, ge=0, le=1)
    mode: Literal["eager", "static", "graphs"] | None = None  # None: graphs on CUDA, else eager
    dtype: Literal["fp32", "bf16", "fp16"] | None = None  # None: the model's

    @classmethod
    def of(cls, options: RunOptions | None = None, settings: dict | None = None) -> RunOptions:
        """``options`` with ``settings`` (keywords) over it; bad settings as a GenerationError in
        one line."""
        merged = {**(dict(options) if options is not None else {}), **(settings or {})}
        try:
            return cls(**merged)
        except ValidationError as exc:
            raise GenerationError(validation_message(exc)) from None

    @model_validator(mode="before")
    @classmethod
    def _parse_rules(cls, data: Any) -> Any:
        """A rule given as text, parsed (an exit rule with its minimum depth)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("exit_rule"), str):
            data["exit_rule"] = ExitRule.parse(data["exit_rule"], data.get("min_depth", 1),
                                               data.get("exit_kv", "latest"))
        elif isinstance(data.get("exit_rule"), ExitRule):  # one KV rule, the rule's or given
            if "exit_kv" in data:
                data["exit_rule"] = replace(data["exit_rule"], kv=data["exit_kv"])
            else:
                data["exit_kv"] = data["exit_rule"].kv
        if isinstance(data.get("draft_rule"), str):
            try:
                data["draft_rule"] = ExitRule.parse(data["draft_rule"])
            except ValueError as exc:
                raise ValueError(f"draft rule: {exc}") from None
        if isinstance(data.get("schedule"), str) and data["schedule"] not in (*SCHEDULES, AUTO):
            raise ValueError(f"unknown schedule {data['schedule']!r}; use "
                             f"{', '.join(SCHEDULES)} or {AUTO}")
        return data

    @model_validator(mode="after")
    def _check(self) -> RunOptions:
        rule = self.exit_rule
        if self.width is not None and self.draft_depth is not None:
            raise ValueError("give either a width or a draft depth, not both")
        if self.min_depth != 1 and not isinstance(rule, ExitRule):
            raise ValueError("a minimum exit depth (--min-depth) goes with an exit rule (--exit)")
        if rule is not None and self.depth is not None and rule.min_depth > self.depth:
            raise ValueError(f"the minimum exit depth must be in 1..{self.depth}, got "
                             f"{rule.min_depth}")
        if self.exit_kv == "reference" and not isinstance(rule, ExitRule):
            raise ValueError("the reference exit KV rule (--exit-kv) goes with an exit rule "
                             "(--exit)")
        if self.exit_kv == "reference" and (self.auto or self.draft_rule or self.kv_sharing):
            raise ValueError("the reference exit KV rule runs with a named schedule, a KV slot "
                             "per depth and no draft rule (--draft-when)")
        if self.force_exits is not None and rule is not None:
            raise ValueError("give an exit rule or forced exits, not both")
        if self.draft_rule is not None and not self.drafts:
            raise ValueError("adaptive drafting (--draft-when) goes with a schedule that drafts "
                             "(dtv or wfd)")
        if self.auto and (rule is not None or self.force_exits is not None):
            raise ValueError("--schedule auto chooses among fixed-depth schedules; name the "
                             "schedule to run with exits")
        if self.auto and self.force_acceptance is not None:
            raise ValueError("--schedule auto decides with the model's own acceptance, not a "
                             "forced one")
        return self

    @property
    def auto(self) -> bool:
        return self.schedule == AUTO

    @property
    def schedule_name(self) -> str:
        return self.schedule if isinstance(self.schedule, str) else self.schedule.name

    @property
    def drafts(self) -> bool:
        """Whether the schedule drafts (auto: not known until it has chosen)."""
        if isinstance(self.schedule, Schedule):
            return self.schedule.drafts
        return not self.auto and SCHEDULES[self.schedule].drafts

    def rule(self, depth: int) -> ExitRule | ForcedExits | None:
        """The exit rule at R = ``depth`` (forced exits are drawn from depths 1..R)."""
        if self.force_exits is None:
            return self.exit_rule
        try:
            return ForcedExits.parse(self.force_exits, depth, self.seed)
        except ValueError as exc:
            raise GenerationError(f"forced exits: {exc}") from None
