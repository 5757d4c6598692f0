"""Huginn on vLLM, read top to bottom as ``wfd/huginn.py`` (same tensor names), from vLLM's
layers:

    e   = prelude(wte[tokens] * sqrt(h))                  embedding + prelude sandwich blocks
    s_0 = wfd.huginn.initial_state_chunk tables           a function of (seed, position)
    s_r = core(adapter(concat[s_{r-1}, e]))               adapter + core sandwich blocks
    y   = head(ln_f(coda(ln_f(s_R))))                     final norm, coda, final norm, head
"""

from __future__ import annotations

import math

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
from wfd.huginn import STATE_CHUNK, initial_state_chunk

from .common import (
    LoopedForCausalLM,
    Norm,
    SiluMul,
    attend,
    attention_projections,
    head_sharded_loader,
    heads_per_rank,
    rotary,
)


class HuginnAttention(nn.Module):
    def __init__(self, arch: ModelConfig, quant_config, prefix: str):
        super().__init__()
        self.heads, self.kv_heads = heads_per_rank(arch)
        self.head_dim = arch.head_dim
        self.Wqkv, self.proj = attention_projections(arch, quant_config, prefix, "Wqkv", "proj")
        # added to q and k before RoPE: [2, 1, heads, head_dim], q's then k's, this rank's heads
        self.qk_bias = head_sharded_loader(nn.Parameter(
            torch.zeros(2, 1, self.heads, arch.head_dim)), dim=2) if arch.qk_bias else None
        self.rotary = rotary(arch, neox_style=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: Attention
                ) -> torch.Tensor:
        qkv, _ = self.Wqkv(x)
        out, _ = self.proj(attend(qkv, positions, self.rotary, cache, self.heads, self.kv_heads,
                                  self.head_dim, self.qk_bias))
        return out


class GatedMLP(nn.Module):
    def __init__(self, arch: ModelConfig, quant_config, prefix: str):
        super().__init__()
        h, i = arch.hidden_size, arch.mlp_size
        self.fc = MergedColumnParallelLinear(h, [i, i], bias=False, quant_config=quant_config,
                                             prefix=f"{prefix}.fc")  # [gate | up] on disk
        self.act = SiluMul()
        self.proj = RowParallelLinear(i, h, bias=False, quant_config=quant_config,
                                      prefix=f"{prefix}.proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.fc(x)
        out, _ = self.proj(self.act(gate_up))
        return out


class SandwichBlock(nn.Module):
    def __init__(self, arch: ModelConfig, quant_config, prefix: str):
        super().__init__()
        eps, h = arch.norm_eps, arch.hidden_size
        self.norm_1 = Norm(h, eps=eps)
        self.attn = HuginnAttention(arch, quant_config, f"{prefix}.attn")
        self.norm_2 = Norm(h, eps=eps)
        self.mlp = GatedMLP(arch, quant_config, f"{prefix}.mlp")
        self.norm_3 = Norm(h, eps=eps)
        self.norm_4 = Norm(h, eps=eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: Attention
                ) -> torch.Tensor:
        x = self.norm_2(x + self.attn(self.norm_1(x), positions, cache))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


class HuginnTransformer(nn.Module):
    def __init__(self, arch: ModelConfig, quant_config, prefix: str):
        super().__init__()

        def blocks(name: str, n: int) -> nn.ModuleList:
            return nn.ModuleList(SandwichBlock(arch, quant_config, f"{prefix}.{name}.{i}")
                                 for i in range(n))

        self.wte = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size,
                                          prefix=f"{prefix}.wte")
        self.prelude = blocks("prelude", arch.prelude_layers)
        self.adapter = ReplicatedLinear(2 * arch.hidden_size, arch.hidden_size, bias=False,
                                        quant_config=quant_config, prefix=f"{prefix}.adapter")
        self.core_block = blocks("core_block", arch.core_layers)
        self.coda = blocks("coda", arch.coda_layers)
        self.ln_f = Norm(arch.hidden_size, eps=arch.norm_eps)


class RavenForCausalLM(LoopedForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        cfg, quant = self.config, vllm_config.quant_config
        self.transformer = HuginnTransformer(self.arch, quant, maybe_prefix(prefix, "transformer"))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, quant_config=quant,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if cfg.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.transformer.wte)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        # every position's initial state, drawn as wfd draws it (not a parameter)
        positions = cfg.max_position_embeddings
        chunks = [initial_state_chunk(cfg.hidden_size, cfg.init_scale, cfg.state_seed, c)
                  for c in range(-(-positions // STATE_CHUNK))] if cfg.init_scale else [
            torch.zeros(positions, cfg.hidden_size, device="cpu")]
        self.register_buffer("initial_states", torch.cat(chunks)[:positions].to(
            vllm_config.device_config.device), persistent=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(input_ids) * self.embed_scale

    def prelude(self, input_ids, positions, inputs_embeds=None, caches=None) -> torch.Tensor:
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        caches = self.prelude_caches() if caches is None else caches
        for block, cache in zip(self.transformer.prelude, caches, strict=True):
            x = block(x, positions, cache)
        return x

    def initial_state(self, positions: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.initial_states[positions].to(e.dtype)

    def step(self, state, e, positions, caches: list[Attention]) -> torch.Tensor:
        x, _ = self.transformer.adapter(torch.cat([state, e], dim=-1))
        for block, cache in zip(self.transformer.core_block, caches, strict=True):
            x = block(x, positions, cache)
        return x

    def readout(self, state: torch.Tensor, positions: torch.Tensor, caches=None) -> torch.Tensor:
        x = self.transformer.ln_f(state)
        caches = self.coda_caches() if caches is None else caches
        for block, cache in zip(self.transformer.coda, caches, strict=True):
            x = block(x, positions, cache)
        return self.transformer.ln_f(x)
