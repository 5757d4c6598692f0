"""Exit rules on vLLM: the engine's (``hf_overrides={"exit_rule": "kl:0.001"}``) and a request's
own (``SamplingParams(extra_args={"exit": "kl:0.01", "exit_min_depth": 3})``, or ``"exit":
"none"`` for fixed depth), resolved into the rule the request's wave runs (``wfd.serving.wave``).

A request's rule is checked where vLLM admits it, before it reaches the engine: ``ExitParams``
is a logits processor installed as a vLLM plugin (entry point group ``vllm.logits_processors``),
whose ``validate_params`` vLLM's input processor calls for every request; a rule the engine
cannot run is vLLM's 400 error in one line, and the server stays up. Its ``apply`` changes no
logits. The engine's settings it checks against are recorded where vLLM makes the engine's
config (``ScheduleHook``), in the same process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from costmodel.exits import ExitRule

from .configs import check_exit_rule


@dataclass(frozen=True)
class EngineExits:
    """What a request's rule is checked against: whether the engine serves exit rules, its own
    (None: fixed depth unless a request sets one), the shallowest depth it reads out at for
    them, the model type and its depth R."""

    serves: bool
    rule: ExitRule | None
    min_depth: int
    model_type: str
    depth: int

    @classmethod
    def of(cls, cfg) -> EngineExits:
        """A looped config's (``configs.LoopedConfig``)."""
        return cls(cfg.serves_exits, cfg.exits, int(cfg.exit_min_depth), cfg.model_type,
                   cfg.depth)


def request_rule(engine: EngineExits, asked: dict | None) -> ExitRule | None:
    """The rule a request runs: the engine's, or its own (``asked``: its extra_args), or none;
    a ValueError in one line for one the engine cannot run."""
    asked = asked or {}
    text, min_depth = asked.get("exit"), asked.get("exit_min_depth")
    if text is None and min_depth is None:
        return engine.rule
    if isinstance(text, str) and text.strip().lower() == "none":
        return None
    if not engine.serves:
        raise ValueError("this engine decodes at a fixed depth: start it with the exit_rule "
                         "option to serve requests with an exit rule")
    if text is None and engine.rule is None:
        raise ValueError("exit_min_depth goes with an exit rule: this engine has none of its "
                         "own, so give the request's (extra_args exit)")
    base = engine.rule if text is None else ExitRule.parse(str(text))
    lowest = engine.min_depth
    try:
        depth = lowest if min_depth is None else int(min_depth)
    except (TypeError, ValueError):
        raise ValueError(f"exit_min_depth must be a whole number, got {min_depth!r}") from None
    if not lowest <= depth <= engine.depth:
        raise ValueError(f"exit_min_depth must be in {lowest}..{engine.depth} on this engine "
                         f"(its exit_min_depth is {lowest}), got {depth}")
    return check_exit_rule(ExitRule(base.name, base.threshold, depth), engine.model_type,
                           engine.depth)


class ExitParams(LogitsProcessor):
    """Checks each request's exit rule where vLLM admits it (``validate_params``); changes no
    logits."""

    engine: EngineExits | None = None  # the looped engine made in this process, if any

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        if cls.engine is not None:  # another model's engine: its extra_args are not ours
            request_rule(cls.engine, sampling_params.extra_args)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass
