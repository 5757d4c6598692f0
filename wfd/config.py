"""Model configuration: the cost model's architecture description, read from and written to
each family's config.json keys (Huginn's RavenConfig, Ouro's OuroConfig)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator

from costmodel.errors import validation_message
from costmodel.model import LoopedModelSpec


class ConfigError(ValueError):
    """A config.json that does not describe a Huginn or Ouro model."""


class ModelConfig(LoopedModelSpec):
    """The cost model's architecture description plus what the decoder alone needs (RoPE base,
    norm epsilon) and the mapping to each family's config.json keys."""

    name: str = "checkpoint"
    tied_head: bool = False
    default_acceptance: float = Field(default=0.9, ge=0, le=1)
    rope_base: float
    norm_eps: float = 1e-6

    @property
    def depth(self) -> int:
        """The default recurrence depth R."""
        return self.default_depth

    @model_validator(mode="after")
    def _check_decoder(self) -> ModelConfig:
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if self.family == "huginn" and self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError("Huginn's head_dim is hidden_size / num_heads")
        if self.qk_bias and self.num_kv_heads != self.num_heads:
            # the release's qk_bias is [2, 1, heads, head_dim]: one shape for q and k
            raise ValueError("qk_bias needs as many key/value heads as query heads")
        return self

    # -- Huginn's keys (raven_config_minimal.RavenConfig) ---------------------------------------
    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        kind = raw.get("model_type")
        try:
            if kind == "huginn_raven":
                h, heads = int(raw["n_embd"]), int(raw["n_heads"])
                return cls(
                    family="huginn", hidden_size=h, num_heads=heads,
                    num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                    head_dim=int(raw.get("head_dim") or h // heads),
                    mlp_size=int(raw["intermediate_size"]),
                    vocab_size=int(raw.get("padded_vocab_size") or raw["vocab_size"]),
                    prelude_layers=int(raw["n_layers_in_prelude"]),
                    core_layers=int(raw["n_layers_in_recurrent_block"]),
                    coda_layers=int(raw["n_layers_in_coda"]),
                    default_depth=int(raw.get("mean_recurrence", 32)),
                    default_draft_depth=raw.get("default_draft_depth"),
                    max_position_embeddings=int(raw.get("block_size", 4096)),
                    rope_base=float(raw.get("rope_base", 50000.0)),
                    norm_eps=float(raw.get("norm_eps", 1e-6)),
                    qk_bias=bool(raw.get("qk_bias", True)),
                    tied_head=bool(raw.get("tie_embeddings", True)),
                )
            if kind == "ouro":
                h, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
                return cls(
                    family="ouro", hidden_size=h, num_heads=heads,
                    num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                    head_dim=int(raw.get("head_dim") or h // heads),
                    mlp_size=int(raw["intermediate_size"]), vocab_size=int(raw["vocab_size"]),
                    prelude_layers=0, core_layers=int(raw["num_hidden_layers"]), coda_layers=0,
                    default_depth=int(raw.get("total_ut_steps", 4)),
                    default_draft_depth=raw.get("default_draft_depth"),
                    max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                    rope_base=float(raw.get("rope_theta", 10000.0)),
                    norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                    tied_head=bool(raw.get("tie_word_embeddings", False)), exit_gate=True,
                )
        except KeyError as exc:
            raise ConfigError(f"config.json of a {kind} model lacks {exc.args[0]!r}") from None
        except ValidationError as exc:
            raise ConfigError(f"config.json has a bad value: {validation_message(exc)}") \
                from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config.json has a bad value: {exc}") from None
        raise ConfigError(f"config.json has model_type {kind!r}; this decoder reads "
                          "'huginn_raven' (Huginn) and 'ouro' (Ouro)")

    def to_hf(self) -> dict[str, Any]:
        if self.family == "huginn":
            return {
                "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
                "n_embd": self.hidden_size, "n_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "intermediate_size": self.mlp_size, "vocab_size": self.vocab_size,
                "padded_vocab_size": self.vocab_size,
                "n_layers": self.prelude_layers + self.core_layers + self.coda_layers,
                "n_layers_in_prelude": self.prelude_layers,
                "n_layers_in_recurrent_block": self.core_layers,
                "n_layers_in_coda": self.coda_layers, "mean_recurrence": self.depth,
                "mean_backprop_depth": min(8, self.depth),
                # this project's key (the release has none): the draft depth the model is
                # measured at, ceil(R / 8) unless its card chose another
                "default_draft_depth": self.default_draft_depth,
                "block_size": self.max_position_embeddings,
                "rope_base": self.rope_base, "norm_eps": self.norm_eps, "qk_bias": self.qk_bias,
                "tie_embeddings": self.tied_head, "bias": False,
                "norm_class_name": "RMSNorm_llama", "block_class_name": "SandwichBlock",
                "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "injection_type": "linear",
                "state_init": "like-init",
            }
        return {
            "architectures": ["OuroForCausalLM"], "model_type": "ouro",
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.mlp_size, "vocab_size": self.vocab_size,
            "num_hidden_layers": self.core_layers, "total_ut_steps": self.depth,
            "default_draft_depth": self.default_draft_depth,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_base, "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tied_head, "hidden_act": "silu",
            "early_exit_threshold": 1.0, "use_sliding_window": False, "rope_scaling": None,
        }

    # -- the cost model's view -------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: LoopedModelSpec) -> ModelConfig:
        return cls(**spec.model_dump(),
                   rope_base=50000.0 if spec.family == "huginn" else 1e6)

    def to_spec(self, name: str) -> LoopedModelSpec:
        """The architecture alone, named (profiles store it)."""
        fields = self.model_dump(exclude={"rope_base", "norm_eps"})
        return LoopedModelSpec(**{**fields, "name": name})
