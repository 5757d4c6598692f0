"""Ouro on vLLM, read top to bottom as ``wfd/ouro.py`` (same tensor names), from vLLM's layers:

    h_0 = embed_tokens[tokens]                            embedding, no scaling
    h_t = norm(layers(h_{t-1}))                           every layer, then the final norm
    y   = lm_head(h_R)                                    the head

At a fixed depth the exit gate is loaded and not read; the gate exit rule reads it.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.utils import maybe_prefix

from wfd.config import ModelConfig

from .common import (
    LoopedForCausalLM,
    Norm,
    SiluMul,
    attend,
    attention_projections,
    heads_per_rank,
    rotary,
)


class OuroAttention(nn.Module):
    def __init__(self, arch: ModelConfig, quant_config, prefix: str):
        super().__init__()
        self.heads, self.kv_heads = heads_per_rank(arch)
        self.head_dim = arch.head_dim
        self.qkv_proj, self.o_proj = attention_projections(arch, quant_config, prefix,
                                                           "qkv_proj", "o_proj")
        self.rotary = rotary(arch, neox_style=True)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: Attention
                ) -> torch.Tensor:
        qkv, _ = self.qkv_proj(x)
        out, _ = self.o_proj(attend(qkv, positions, self.rotary, cache, self.heads,
                                    self.kv_heads, self.head_dim))
        return out


class OuroMLP(nn.Module):
    def __init__(self, arch: ModelConfig, quant_config, prefix: str):
        super().__init__()
        h, i = arch.hidden_size, arch.mlp_size
        self.gate_up_proj = MergedColumnParallelLinear(h, [i, i], bias=False,
                                                       quant_config=quant_config,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.act = SiluMul()
        self.down_proj = RowParallelLinear(i, h, bias=False, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act(gate_up))
        return out


class OuroDecoderLayer(nn.Module):
    """Sandwich norm: the *_2 norms act on each sub-layer's output before the residual add."""

    def __init__(self, arch: ModelConfig, quant_config, prefix: str):
        super().__init__()
        eps, h = arch.norm_eps, arch.hidden_size
        self.input_layernorm = Norm(h, eps=eps)
        self.self_attn = OuroAttention(arch, quant_config, f"{prefix}.self_attn")
        self.input_layernorm_2 = Norm(h, eps=eps)
        self.post_attention_layernorm = Norm(h, eps=eps)
        self.mlp = OuroMLP(arch, quant_config, f"{prefix}.mlp")
        self.post_attention_layernorm_2 = Norm(h, eps=eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: Attention
                ) -> torch.Tensor:
        x = x + self.input_layernorm_2(self.self_attn(self.input_layernorm(x), positions, cache))
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


class OuroInner(nn.Module):
    def __init__(self, arch: ModelConfig, quant_config, prefix: str):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(OuroDecoderLayer(arch, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(arch.core_layers))
        self.norm = Norm(arch.hidden_size, eps=arch.norm_eps)
        self.early_exit_gate = ReplicatedLinear(arch.hidden_size, 1, bias=True,
                                                prefix=f"{prefix}.early_exit_gate")


class OuroForCausalLM(LoopedForCausalLM):
    STACKED = ((".qkv_proj.", ".q_proj.", "q"), (".qkv_proj.", ".k_proj.", "k"),
               (".qkv_proj.", ".v_proj.", "v"), (".gate_up_proj.", ".gate_proj.", 0),
               (".gate_up_proj.", ".up_proj.", 1))

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        cfg, quant = self.config, vllm_config.quant_config
        self.model = OuroInner(self.arch, quant, maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, quant_config=quant,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if cfg.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def prelude(self, input_ids, positions, inputs_embeds=None, caches=None) -> torch.Tensor:
        return self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds

    def initial_state(self, positions: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return e

    def step(self, state, e, positions, caches: list[Attention]) -> torch.Tensor:
        x = state
        for layer, cache in zip(self.model.layers, caches, strict=True):
            x = layer(x, positions, cache)
        return self.model.norm(x)

    def readout(self, state: torch.Tensor, positions: torch.Tensor, caches=None) -> torch.Tensor:
        return state

    def exit_lambda(self, state: torch.Tensor) -> torch.Tensor:
        """The gate's per-step exit hazard sigmoid(gate(h_t)) (wfd.ouro's), for the gate rule."""
        gate, _ = self.model.early_exit_gate(state)
        return torch.sigmoid(gate).squeeze(-1).float()
