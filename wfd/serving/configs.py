"""Each family's config.json as a transformers config vLLM can read: the checkpoint's own keys,
plus the standard names vLLM asks every decoder for (hidden size, heads, layers), derived by
``wfd.config.ModelConfig`` exactly as ``wfd`` reads the folder."""

from __future__ import annotations

from transformers import PretrainedConfig

from costmodel.slots import check_kv_sharing
from wfd.config import ConfigError, ModelConfig


class LoopedConfig(PretrainedConfig):
    """A looped model's config (a transformers dataclass config: its fields are the plugin's
    options, the checkpoint's keys arrive as the rest). ``looped`` is the architecture as ``wfd``
    reads it."""

    model_type = ""
    recurrence_depth: int | None = None  # R; None: the checkpoint's
    kv_sharing: int = 0  # 0: a KV slot per depth; S in 1..R: S shared slots
    init_scale: float = 1.0  # Huginn's initial state, as wfd generate --init-scale
    state_seed: int = 0  # and --seed
    # DtV (speculative_config method draft_model, the same checkpoint as drafter): the drafter's
    # depth d; None: the model's default draft depth
    draft_depth: int | None = None
    # the plugin's own schedule (wfd.serving.wave): "wfd", WaveFront Decoding at draft_depth with
    # at most width_cap positions in flight, or "dtv", DtV at draft_depth drafting block_length
    # tokens a round with nested reuse; "ar": one position at a time (or vLLM's DtV, with a
    # second copy of the weights, by its speculative_config)
    schedule: str = "ar"
    width_cap: int | None = None
    block_length: int = 4
    # WFD and the plugin's DtV: tokens a greedy request's wave may commit itself past vLLM's
    # next sample, handed to vLLM as speculative tokens (wfd.serving.ahead); 0: a token a step
    commit_ahead: int = 8
    # adaptive depth (wfd.serving.exits): each decoded token stops iterating where this rule
    # (costmodel.exits.ExitRule's RULE[:THRESHOLD]) fires, from exit_min_depth on, or at forced
    # depths (forced:DEPTH:P,...: timing on random weights, ``served_rule``); a request
    # may set its own (SamplingParams extra_args "exit", "exit_min_depth"); "none": fixed depth
    # unless a request sets one; None: fixed depth, vLLM's own forward
    exit_rule: str | None = None
    exit_min_depth: int = 1

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        try:
            looped = self.looped
        except ConfigError:  # a bare instance (transformers makes one to compare defaults with)
            return
        # the names vLLM reads of every decoder
        self.hidden_size = looped.hidden_size
        self.num_attention_heads = looped.num_heads
        self.num_key_value_heads = looped.num_kv_heads
        self.head_dim = looped.head_dim
        self.intermediate_size = looped.mlp_size
        self.vocab_size = looped.vocab_size
        self.max_position_embeddings = looped.max_position_embeddings
        self.tie_word_embeddings = looped.tied_head
        # the transformer layers (Ouro's own key: its loop)
        self.num_hidden_layers = looped.prelude_layers + looped.core_layers + looped.coda_layers

    # vLLM sets hf_overrides on the config after making it: what they decide is read on use
    @property
    def depth(self) -> int:
        depth = int(self.recurrence_depth or self.looped.depth)
        if depth < 1:
            raise ValueError(f"recurrence_depth must be >= 1, got {depth}")
        check_kv_sharing(self.kv_sharing, depth)
        return depth

    @property
    def drafter(self) -> tuple[int, int]:
        """(depth, KV sharing) of this checkpoint as vLLM's draft model: d below R, with the
        slots of steps 1..d of the target's sharing (step r in slot (r - 1) mod S)."""
        depth = self.depth
        d = self.draft_depth or min(self.looped.default_draft_depth, depth - 1)
        if not 1 <= d < depth:
            raise ValueError(f"draft_depth must be in 1..{depth - 1} (below R = {depth}), "
                             f"got {d}")
        return d, min(self.kv_sharing, d)

    @property
    def serves_exits(self) -> bool:
        """Whether the engine serves exit rules: its own (``exit_rule``), or only those requests
        ask for (``exit_rule`` "none")."""
        return self.exit_rule is not None

    @property
    def exits(self):
        """The engine's exit rule (``served_rule``), checked against this model; None at fixed
        depth (or where only requests set one)."""
        if self.exit_min_depth < 1 or self.exit_min_depth > self.depth:
            raise ValueError(f"exit_min_depth must be in 1..{self.depth}, "
                             f"got {self.exit_min_depth}")
        if self.exit_rule is None or str(self.exit_rule).strip().lower() == "none":
            return None
        return check_exit_rule(served_rule(str(self.exit_rule), int(self.exit_min_depth),
                                           self.depth),
                               self.model_type, self.depth)

    @property
    def wave(self):
        """The plugin's own schedule (a costmodel Schedule: WFD's or DtV's, or AR's with an exit
        rule) at its options; None for AR at fixed depth (vLLM's own forward)."""
        from costmodel.schedules import get

        if self.schedule not in ("ar", "dtv", "wfd"):
            raise ValueError(f"schedule must be ar, dtv or wfd, got {self.schedule!r}")
        if self.schedule == "ar" and not self.serves_exits:
            return None
        if self.commit_ahead < 0:
            raise ValueError(f"commit_ahead must be at least 0, got {self.commit_ahead}")
        if self.schedule == "ar":  # with an exit rule: a skipped shared slot is filled as wfd's
            return get("ar")()
        if self.kv_sharing:
            raise ValueError(f"schedule {self.schedule} keeps a KV slot per depth (kv_sharing "
                             "0): with shared slots its drafts would overwrite what "
                             "verification reads")
        if self.width_cap is not None and self.width_cap < 1:
            raise ValueError(f"width_cap must be at least 1, got {self.width_cap}")
        if self.block_length < 1:
            raise ValueError(f"block_length must be at least 1, got {self.block_length}")
        return get(self.schedule).of(self.drafter[0], self.block_length, self.width_cap)

    @property
    def readout_depths(self) -> list[int]:
        """The depths a token is read out at, each with its own coda caches (slot i for the
        i-th): R first, then the draft depth (DtV, WFD) and every depth an exit may happen at."""
        depth, wave = self.depth, self.wave
        others = set() if wave is None or self.schedule == "ar" else {self.drafter[0]}
        if self.serves_exits:
            _ = self.exits  # a rule or a minimum depth the model cannot run: refused here
            others |= set(range(self.exit_min_depth, depth))
        return [depth, *sorted(others - {depth})]

    @property
    def kv_layers(self) -> int:
        """The attention caches a token passes through, each holding its own KV: what vLLM's
        cache is sized by."""
        return self.looped.kv_layer_slots(self.depth, self.kv_sharing,
                                          len(self.readout_depths))

    @property
    def looped(self) -> ModelConfig:
        return ModelConfig.from_hf({**self.to_dict(), "model_type": self.model_type})


def served_rule(text: str, min_depth: int, depth: int):
    """An exit rule as the plugin takes it: ``RULE[:THRESHOLD]`` (a costmodel ExitRule, checked
    from ``min_depth``), or ``forced:DEPTH:P,...`` (timing on random weights, as `wfd generate
    --force-exits`: each decoded position exits at a depth drawn from the distribution by its
    position, not where a rule fires; its depths are its own, so no minimum depth with it)."""
    from costmodel.exits import ExitRule, ForcedExits

    name, _, depths = text.strip().partition(":")
    if name.strip().lower() != "forced":
        return ExitRule.parse(text, min_depth)
    if min_depth != 1:
        raise ValueError("forced exit depths are their own: leave out exit_min_depth with them")
    return ForcedExits.parse(depths, depth)


def check_exit_rule(rule, model_type: str, depth: int):
    """``rule`` if a model of this type at depth R can run it (the gate needs Ouro's exit gate;
    a minimum depth within 1..R), else a ValueError in one line."""
    if rule.name == "gate" and model_type != "ouro":
        raise ValueError("the gate exit rule needs a model with an exit gate (Ouro); "
                         f"{model_type or 'this model'} has none")
    rule.for_plan(False, depth)  # a minimum depth past R: its own line
    return rule


class RavenConfig(LoopedConfig):
    model_type = "huginn_raven"


class OuroConfig(LoopedConfig):
    model_type = "ouro"


CONFIGS = {RavenConfig.model_type: RavenConfig, OuroConfig.model_type: OuroConfig}
