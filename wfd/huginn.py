"""Huginn (tomg-group-umd/huginn-0125): prelude, recurrent core, coda.

Read top to bottom (the architecture as the public release implements it; docs/models.md):

    e   = prelude(wte[tokens] * sqrt(h))                  P: embedding + prelude sandwich blocks
    s_0 = sqrt(h) * TruncNormal(0, sigma * init_scale)    a function of (seed, position)
    s_r = core(adapter(concat[s_{r-1}, e]))               B: adapter + core sandwich blocks
    y   = head(ln_f(coda(ln_f(s_R))))                     C: final norm, coda, final norm, head

Tensor names are the release's (transformer.wte, transformer.prelude.{i}, ...).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .cache import KVCache, LayerKV
from .config import ModelConfig
from .layers import CallPlan, RMSNorm, attend, rope_interleaved

STATE_CHUNK = 64  # positions per table of initial states


def initial_state_chunk(hidden_size: int, init_scale: float, seed: int, chunk: int
                        ) -> torch.Tensor:
    """The initial states of positions chunk * STATE_CHUNK ... + STATE_CHUNK - 1, in fp32:
    sqrt(h) * truncated normal(0, sqrt(2 / 5h) * init_scale, +-3 std), drawn at once from a
    generator seeded by (seed, chunk). Every decoder of this project (wfd, its vLLM plugin) reads
    its states from here, so a position starts from the same state in each."""
    std = math.sqrt(2 / (5 * hidden_size)) * init_scale
    gen = torch.Generator().manual_seed(seed * 1_000_003 + chunk)
    table = torch.empty(STATE_CHUNK, hidden_size, dtype=torch.float32, device="cpu")
    nn.init.trunc_normal_(table, 0.0, std, -3 * std, 3 * std, generator=gen)
    return table * math.sqrt(hidden_size)


class HuginnAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.Wqkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=False)
        # added to q and k before RoPE; [0] is q's, [1] is k's
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, cfg.num_heads, cfg.head_dim)) \
            if cfg.qk_bias else None
        self.proj = nn.Linear(q, cfg.hidden_size, bias=False)

    def forward(self, x, plan: CallPlan, kv: LayerKV | None):
        # q and k side by side, as heads + kv_heads heads: one bias add and one RoPE for both
        # (the release rotates them concatenated too)
        heads = self.heads + self.kv_heads
        qk, v = self.Wqkv(x).split((heads * self.head_dim, self.kv_heads * self.head_dim), dim=-1)
        qk = qk.unflatten(-1, (heads, self.head_dim))
        v = v.unflatten(-1, (self.kv_heads, self.head_dim))
        if self.qk_bias is not None:  # [2, 1, heads, hd] -> [1, 2 heads, hd]: q's, then k's
            qk = (qk + self.qk_bias.transpose(0, 1).flatten(1, 2)).to(qk.dtype)
        q, k = rope_interleaved(qk, plan.rotations()).split((self.heads, self.kv_heads), dim=-2)
        out = attend(q, k, v, plan, kv)
        return self.proj(out.flatten(-2))


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, 2 * cfg.mlp_size, bias=False)  # [gate | up]
        self.proj = nn.Linear(cfg.mlp_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class SandwichBlock(nn.Module):
    """Pre-norm and post-norm around both sub-layers; the residual stream is renormalized."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm_1 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = HuginnAttention(cfg)
        self.norm_2 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = GatedMLP(cfg)
        self.norm_3 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.norm_4 = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, x, plan: CallPlan, kv: LayerKV | None):
        x = self.norm_2(x + self.attn(self.norm_1(x), plan, kv))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


class HuginnTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.prelude = nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.prelude_layers))
        self.adapter = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.core_block = nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.core_layers))
        self.coda = nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.coda_layers))
        self.ln_f = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class HuginnModel(nn.Module):
    family = "huginn"

    def __init__(self, cfg: ModelConfig, init_scale: float = 1.0, seed: int = 0):
        super().__init__()
        self.config = cfg
        self.transformer = HuginnTransformer(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tied_head:
            self.lm_head.weight = self.transformer.wte.weight
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.state_std = math.sqrt(2 / (5 * cfg.hidden_size))  # before init_scale
        self.init_scale = init_scale
        self.seed = seed
        self._state_tables: dict[tuple[int, float, int], torch.Tensor] = {}

    # -- P -------------------------------------------------------------------------------------
    def prelude(self, tokens: torch.Tensor, plan: CallPlan, cache: KVCache | None):
        """e: the injection every core step reads (the initial state: ``initial_state``)."""
        x = self.transformer.wte(tokens) * self.embed_scale
        for i, block in enumerate(self.transformer.prelude):
            x = block(x, plan, cache.prelude[i] if cache else None)
        return x

    def initial_state(self, positions: list[int], e: torch.Tensor) -> torch.Tensor:
        """sqrt(h) * truncated normal(0, std * init_scale, +-3 std), a function of (seed,
        position) only: every schedule sees the same state for the same position. Rows come from
        tables of STATE_CHUNK positions, each drawn at once from a generator seeded by (seed,
        chunk), so a call costs one draw per chunk it touches, not one per position."""
        h = self.config.hidden_size
        if self.init_scale == 0:
            return torch.zeros(len(positions), h, dtype=e.dtype, device=e.device)
        chunks = {p // STATE_CHUNK for p in positions}
        tables = {c: self._state_table(c) for c in sorted(chunks)}
        rows = torch.stack([tables[p // STATE_CHUNK][p % STATE_CHUNK] for p in positions]) \
            if len(chunks) > 1 else tables[chunks.pop()][[p % STATE_CHUNK for p in positions]]
        return rows.to(device=e.device, dtype=e.dtype)

    def _state_table(self, chunk: int) -> torch.Tensor:
        """Initial states of positions chunk * STATE_CHUNK ... + STATE_CHUNK - 1 (the most recent
        few tables are kept: decoding walks forward through positions)."""
        key = (self.seed, self.init_scale, chunk)
        if key not in self._state_tables:
            if len(self._state_tables) >= 4:
                self._state_tables.pop(next(iter(self._state_tables)))
            self._state_tables[key] = initial_state_chunk(self.config.hidden_size,
                                                          self.init_scale, self.seed, chunk)
        return self._state_tables[key]

    # -- B -------------------------------------------------------------------------------------
    def block(self, state, e, plan: CallPlan, cache: KVCache | None):
        """One recurrence step for each position, bringing it to the depth its slot stands for."""
        x = self.transformer.adapter(torch.cat([state, e], dim=-1))
        for i, block in enumerate(self.transformer.core_block):
            x = block(x, plan, cache.core[i] if cache else None)
        return x

    # -- C -------------------------------------------------------------------------------------
    def coda(self, state, plan: CallPlan, cache: KVCache | None) -> torch.Tensor:
        """fp32 logits of each position read out (one coda KV slot per readout depth)."""
        x = self.transformer.ln_f(state)
        for i, block in enumerate(self.transformer.coda):
            x = block(x, plan, cache.coda[i] if cache else None)
        return self.lm_head(self.transformer.ln_f(x)).float()
