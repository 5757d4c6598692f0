"""What both families share on vLLM: a KV cache per attention layer a token passes through
(per prelude layer, per (recurrence slot, core layer), per coda layer), the forward pass at a
fixed depth, the head, and weight loading by the checkpoint's own names."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.utils import maybe_prefix

from costmodel.slots import core_slot
from wfd.checkpoint import _OPTIONAL
from wfd.config import ModelConfig

from .configs import LoopedConfig
from .wave import WaveDecoder


class Norm(RMSNorm):
    """vLLM's RMSNorm (its weight and name), run on a CPU by vLLM's own C kernel: the CPU
    build's op dispatch picks the native torch ops there, 24 us a call against 2.4 at the tiny
    models' sizes (a token of huginn-tiny passes about 30 norms)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None and x.device.type == "cpu" and x.is_contiguous() \
                and x.dtype == self.weight.dtype and self.variance_size_override is None:
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, self.weight, self.variance_epsilon)
            return out
        return super().forward(x, residual)


class SiluMul(SiluAndMul):
    """vLLM's SiluAndMul, its torch ops called directly on a CPU (the op dispatch around them
    costs three times the ops at these sizes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_native(x) if x.device.type == "cpu" else super().forward(x)


class CheckpointError(ValueError):
    """A checkpoint whose tensors are not the family's."""


def heads_per_rank(arch: ModelConfig) -> tuple[int, int]:
    """(query heads, key/value heads) on this tensor-parallel rank; KV heads are replicated
    when there are fewer than ranks."""
    tp = get_tensor_model_parallel_world_size()
    if arch.num_heads % tp or (arch.num_kv_heads % tp and tp % arch.num_kv_heads):
        raise ValueError(f"{arch.num_heads} query and {arch.num_kv_heads} key/value heads do "
                         f"not split over {tp} tensor-parallel ranks")
    return arch.num_heads // tp, max(1, arch.num_kv_heads // tp)


def attention_projections(arch: ModelConfig, quant_config, prefix: str, qkv_name: str,
                          out_name: str) -> tuple[QKVParallelLinear, RowParallelLinear]:
    """A layer's fused q, k, v projection and its output projection, under the checkpoint's
    names (split over the tensor-parallel ranks by heads)."""
    qkv = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads,
                            bias=False, quant_config=quant_config,
                            prefix=f"{prefix}.{qkv_name}")
    out = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size, bias=False,
                            quant_config=quant_config, prefix=f"{prefix}.{out_name}")
    return qkv, out


def attend(qkv: torch.Tensor, positions: torch.Tensor, rotary, cache: Attention,
           heads: int, kv_heads: int, head_dim: int, qk_bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """q, k and v split from their fused projection (``qk_bias``: [2, 1, heads, head_dim] added
    to q and k first, Huginn's), q and k rotated, then attention over this step's cache."""
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    if qk_bias is not None:
        q = q + qk_bias[0].flatten()
        k = k + qk_bias[1].flatten()
    q, k = rotary(positions, q, k)
    return cache(q, k, v)


def rotary(arch: ModelConfig, neox_style: bool):
    """vLLM's rotary embedding at the model's base: Huginn rotates adjacent pairs (GPT-J style),
    Ouro the two halves (NeoX style)."""
    return get_rope(arch.head_dim, arch.max_position_embeddings, is_neox_style=neox_style,
                    rope_parameters={"rope_theta": arch.rope_base})


def served(vllm_config: VllmConfig) -> tuple[LoopedConfig, int, int]:
    """(the config, R, KV sharing) a model runs at: the engine's, or as vLLM's draft model
    (DtV: speculative_config's method draft_model), the target's own checkpoint and options at
    its draft depth d, so that its drafts are the target's depth-d readouts (docs/serving.md)."""
    cfg: LoopedConfig = vllm_config.model_config.hf_config
    if vllm_config.model_config.runner_type != "draft":
        return cfg, cfg.depth, cfg.kv_sharing
    target = vllm_config.speculative_config.target_model_config
    if not isinstance(target.hf_config, LoopedConfig) or (
            Path(target.model).resolve() != Path(vllm_config.model_config.model).resolve()):
        raise ValueError("a looped model drafts for itself: give the target's own checkpoint "
                         "as the speculative model (its draft depth: the draft_depth option)")
    return target.hf_config, *target.hf_config.drafter


class LoopedForCausalLM(nn.Module):
    """P, then R steps of B, then C, for every token of the batch (prompt tokens and decoded ones
    alike); each step's core layers write and read the KV cache of the step's slot
    (``costmodel.slots.core_slot``: one per depth, or the shared ones). A family provides
    ``prelude``, ``initial_state``, ``step`` and ``readout``; ``STACKED`` maps the checkpoint's
    separate projections onto vLLM's fused ones."""

    STACKED: tuple[tuple[str, str, str | int], ...] = ()

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        cfg, self.depth, self.kv_sharing = served(vllm_config)
        self.config = cfg
        # the architecture as wfd reads it, parsed once and handed to every layer
        self.arch = arch = cfg.looped
        self.prelude_layers, self.core_layers = arch.prelude_layers, arch.core_layers
        self.core_slots = arch.core_slots(self.depth, self.kv_sharing)
        drafter = vllm_config.model_config.runner_type == "draft"
        wave = None if drafter else cfg.wave
        # the depths a token is read out at, R first (DtV and WFD read out at d too, an exit
        # rule at every depth it may exit at): each with the coda's caches of its own
        self.readout_depths = [self.depth] if drafter else cfg.readout_depths
        readout_slots = len(self.readout_depths)
        heads, kv_heads = heads_per_rank(arch)
        self.caches = nn.ModuleList(
            Attention(heads, arch.head_dim, arch.head_dim ** -0.5, num_kv_heads=kv_heads,
                      cache_config=vllm_config.cache_config,
                      quant_config=vllm_config.quant_config,
                      prefix=maybe_prefix(prefix, f"caches.{i}"))
            for i in range(arch.kv_layer_slots(self.depth, self.kv_sharing, readout_slots)))
        self.logits_processor = LogitsProcessor(arch.vocab_size)
        self.wave = None if wave is None else WaveDecoder(self, wave)

    # -- which cache each layer reads ---------------------------------------------------------
    def prelude_caches(self) -> list[Attention]:
        return list(self.caches[:self.prelude_layers])

    def core_layer_index(self, depth: int, layer: int) -> int:
        """The cache of core layer ``layer`` at recurrence step ``depth`` (1-based)."""
        return self.prelude_layers + core_slot(depth, self.kv_sharing) * self.core_layers + layer

    def core_caches(self, depth: int) -> list[Attention]:
        return [self.caches[self.core_layer_index(depth, j)] for j in range(self.core_layers)]

    def coda_layer_index(self, slot: int, layer: int) -> int:
        """The cache of coda layer ``layer`` for readouts of slot ``slot`` (0: at R; then the
        other ``readout_depths``)."""
        return (self.prelude_layers + self.core_slots * self.core_layers
                + slot * self.arch.coda_layers + layer)

    def coda_caches(self) -> list[Attention]:
        return [self.caches[self.coda_layer_index(0, j)] for j in range(self.arch.coda_layers)]

    # -- the pass ----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor:
        if self.wave is not None:  # a profiling run has no metadata: it runs as AR
            metadata = get_forward_context().attn_metadata
            step = next(iter(metadata.values())) if metadata else None
            if step is not None and self.wave.runs(step):
                return self.wave.forward(input_ids, positions, step)
        e = self.prelude(input_ids, positions, inputs_embeds)
        state = self.initial_state(positions, e)
        for depth in range(1, self.depth + 1):
            state = self.step(state, e, positions, self.core_caches(depth))
        return self.readout(state, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Every tensor by its checkpoint name into the parameter of that name (vLLM's loader
        shards it for this rank; a fused Wqkv or gate-and-up splits itself), separate
        projections into their fused parameter (``STACKED``). A tied head's copy and the
        optional buffers are skipped; any other unknown tensor is an error."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.rsplit(".", 1)[-1] in _OPTIONAL or (
                    name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            shard: str | int | None = None
            for stacked, separate, shard_id in self.STACKED:
                if separate in name:
                    name, shard = name.replace(separate, stacked), shard_id
                    break
            if name not in params:
                raise CheckpointError(f"the checkpoint holds {name!r}, which a "
                                      f"{self.config.model_type} model has no parameter for")
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(name)
        return loaded


def head_sharded_loader(param: nn.Parameter, dim: int):
    """A weight loader that keeps this rank's heads of a per-head tensor (dim ``dim``)."""
    def load(target: nn.Parameter, tensor: torch.Tensor) -> None:
        size = target.shape[dim]
        target.data.copy_(tensor.narrow(dim, get_tensor_model_parallel_rank() * size, size))
    param.weight_loader = load
    return param
