"""Ouro (ByteDance/Ouro-1.4B, -2.6B): the whole layer stack looped, shared final norm after every
pass, untied head, exit gate.

Read top to bottom (the architecture as the public release implements it; docs/models.md):

    h_0 = embed_tokens[tokens]                            P: embedding, no scaling
    h_t = norm(layers(h_{t-1}))                           B: every layer, then the final norm
    y   = lm_head(h_T)                                    C: the head (no further norm)
    exit: lambda_t = sigmoid(gate(h_t)); p(t) = lambda_t prod_{j<t}(1 - lambda_j), p(T) = rest

Tensor names are the release's (model.embed_tokens, model.layers.{i}.self_attn.q_proj, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache, LayerKV
from .config import ModelConfig
from .layers import CallPlan, RMSNorm, attend, rope_rotate_half


class OuroAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)

    def forward(self, x, plan: CallPlan, kv: LayerKV | None):
        q = self.q_proj(x).unflatten(-1, (self.heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        # q and k side by side: one RoPE for both (elementwise: the same values, fewer kernels)
        qk = rope_rotate_half(torch.cat((q, k), dim=-2), *plan.rotate_half_tables(x.dtype))
        q, k = qk.split((self.heads, self.kv_heads), dim=-2)
        return self.o_proj(attend(q, k, v, plan, kv).flatten(-2))


class OuroMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.mlp_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.mlp_size, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OuroDecoderLayer(nn.Module):
    """Sandwich norm: the *_2 norms act on each sub-layer's output before the residual add."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = OuroAttention(cfg)
        self.input_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = OuroMLP(cfg)
        self.post_attention_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x, plan: CallPlan, kv: LayerKV | None):
        x = x + self.input_layernorm_2(self.self_attn(self.input_layernorm(x), plan, kv))
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


class OuroInner(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(cfg) for _ in range(cfg.core_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1, bias=True)


class OuroModel(nn.Module):
    family = "ouro"

    def __init__(self, cfg: ModelConfig, init_scale: float = 1.0, seed: int = 0):
        super().__init__()
        self.config = cfg
        self.model = OuroInner(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tied_head:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Ouro has no random initial state; kept so both families share one interface.
        self.init_scale, self.seed = init_scale, seed

    def prelude(self, tokens: torch.Tensor, plan: CallPlan, cache: KVCache | None):
        """e: the embedding (no injection: it is only the initial state)."""
        return self.model.embed_tokens(tokens)

    def initial_state(self, positions: list[int], e: torch.Tensor) -> torch.Tensor:
        return e

    def block(self, state, e, plan: CallPlan, cache: KVCache | None):
        """One pass of the whole stack for each position, bringing it to the depth its slot
        stands for."""
        x = state
        for i, layer in enumerate(self.model.layers):
            x = layer(x, plan, cache.core[i] if cache else None)
        return self.model.norm(x)

    def coda(self, state, plan: CallPlan, cache: KVCache | None) -> torch.Tensor:
        return self.lm_head(state).float()

    def exit_lambda(self, state: torch.Tensor) -> torch.Tensor:
        """The gate's per-step exit hazard lambda_t = sigmoid(gate(h_t)): [n]."""
        return torch.sigmoid(self.model.early_exit_gate(state)).squeeze(-1).float()
