"""Building blocks shared by both families: RMSNorm, the two RoPE conventions, and attention over
positions that may sit at different depths (each reading its own KV slot)."""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .cache import LayerKV

try:  # the attention kernels PyTorch can choose among, by name
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # an older PyTorch: its own choice, unreported
    SDPBackend = sdpa_kernel = None


class RMSNorm(nn.Module):
    """Normalize in fp32, cast back to the input dtype, then scale (Huginn and Ouro/HF order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one operation where the release casts to fp32, computes x * rsqrt(mean(x^2) + eps) in
        # four and casts back: it normalizes in fp32 and rounds to x's dtype once, giving on a
        # CPU exactly the release's values (tests/test_models.py); the scale stays outside, in
        # x's dtype, as in the release
        return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)


def rope_frequencies(head_dim: int, base: float, device: torch.device | str) -> torch.Tensor:
    """1 / base^(2j / head_dim), in fp32: [head_dim / 2]. A constant of the model, made once
    (by the Runner, outside any captured graph) rather than in every call."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device)[
        : head_dim // 2].float() / head_dim))


def rope_angles(positions: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """angle[p, j] = p * frequencies[j], in fp32: [n, head_dim / 2]."""
    return torch.outer(positions.float(), frequencies)


def rope_interleaved(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Huginn: rotate adjacent pairs (2j, 2j+1) in fp32, as one complex product per pair,
    (x0 + i x1)(cos + i sin): the release's x0 cos - x1 sin and x1 cos + x0 sin in one kernel
    instead of seven (on a CPU the same values when head_dim is a multiple of 16, as Huginn's 96
    is; past the last multiple, pairs may differ in the last bit). x: [..., n, heads,
    head_dim]; rotations: CallPlan.rotations()."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotations).flatten(-2).to(x.dtype)


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Ouro (HF Llama style): rotate the two halves. x: [n, heads, head_dim]; cos, sin: [n, 1,
    head_dim], already in the activation dtype (CallPlan.rotate_half_tables)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def allowed_backends(device: torch.device) -> list | None:
    """The scaled-dot-product kernels the decoder lets PyTorch choose among on ``device``: on
    CUDA every one but cuDNN's, which builds an execution plan per key length (an eager decode's
    key length grows every token) and raises on a shape it cannot plan instead of falling back;
    the flash kernel takes no additive mask, so a masked call runs the memory-efficient kernel.
    None elsewhere: PyTorch's own choice (a CPU has no plan to build)."""
    if device.type != "cuda" or SDPBackend is None:
        return None
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_policy(device: torch.device) -> contextlib.AbstractContextManager:
    """A context in which attention runs only the kernels ``allowed_backends`` allows."""
    backends = allowed_backends(device)
    return contextlib.nullcontext() if backends is None else sdpa_kernel(backends)


BACKEND_NAMES = {"MATH": "math", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient",
                 "CUDNN_ATTENTION": "cudnn", "OVERRIDEABLE": "overrideable", "ERROR": "none"}


def backend_for(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                allowed: list | None = None) -> str:
    """The kernel scaled-dot-product attention runs for these queries, keys (as values too) and
    mask (math, flash, efficient, cudnn), as PyTorch dispatches it: under the device's policy,
    or among the ``allowed`` kernels when given."""
    if SDPBackend is None:
        return "unknown"
    with attention_policy(q.device) if allowed is None else sdpa_kernel(allowed):
        try:
            choice = torch._fused_sdp_choice(q, k, k, mask, 0.0, False, scale=None,
                                             enable_gqa=q.shape[1] != k.shape[1])
        except (RuntimeError, TypeError, AttributeError):  # a private call: may change
            return "unknown"
    return BACKEND_NAMES.get(SDPBackend(choice).name, str(choice))


def chosen_backend(model: nn.Module, kind: str, slots: list[int], span: int) -> str:
    """The attention kernel a call of ``kind`` runs (``none`` for a part without attention): one
    group of queries of this call's shape (slot_layout) over ``span`` keys, in the model's dtype
    and on its device."""
    cfg = model.config
    layers = {"prelude": cfg.prelude_layers, "block": cfg.core_layers,
              "coda": cfg.coda_layers}[kind]
    if not layers:
        return "none"
    param = next(model.parameters())
    per_group = slot_layout(tuple(slots), progressions=param.device.type == "cpu")[3]
    like = dict(dtype=param.dtype, device=param.device)
    q = torch.zeros(1, cfg.num_heads, per_group, cfg.head_dim, **like)
    k = torch.zeros(1, cfg.num_kv_heads, span, cfg.head_dim, **like)
    return backend_for(q, k, torch.zeros(1, 1, per_group, span, **like))


@functools.lru_cache(maxsize=4096)
def slot_layout(slots: tuple[int, ...], progressions: bool = True
                ) -> tuple[str, tuple | None, bool, int]:
    """How a call's positions read their slots, as (access, slot range, descending, queries per
    group). Positions form groups, runs of equal slots, each one group of queries over one key set
    (AR: one group; DtV's verification: one per sequence; a WFD wave: one per position). Distinct
    slots in equally long runs are read as ("one", None, False, q) for a single group, ("range",
    (first, last, step), descending, q) for an arithmetic progression (a strided view), ("ranges",
    ((first group, groups, first slot, step, descending), ...), False, q) for a few of them (a batch
    of WFD waves), or ("gather", None, False, q) otherwise; any other mix gathers one key set per
    position ("gather", None, False, 1), or, distinct slots in runs of unequal lengths (prompts of
    unequal lengths prefilled together), as ("runs", ((first position, length, slot), ...), False,
    1): a kernel per run over its own slot. Gathering copies every key set read (in that mix, a
    position's each: a whole context per prompt token), which costs a CPU more than a kernel per
    progression or run; a GPU pays the host per kernel instead, so ``progressions=False``
    (CallPlan on a GPU) gathers there."""
    runs: list[list[int]] = []
    for slot in slots:
        if runs and runs[-1][0] == slot:
            runs[-1][1] += 1
        else:
            runs.append([slot, 1])
    heads = [slot for slot, _ in runs]
    sizes = {size for _, size in runs}
    if len(set(heads)) != len(heads):
        return "gather", None, False, 1
    if len(sizes) != 1:  # runs of unequal lengths (prompts of a batch, prefilled together)
        if not progressions:
            return "gather", None, False, 1
        starts = [0, *itertools.accumulate(size for _, size in runs[:-1])]
        return "runs", tuple((start, size, slot) for start, (slot, size) in
                             zip(starts, runs, strict=True)), False, 1
    per_group = sizes.pop()
    if len(heads) == 1:
        return "one", None, False, per_group
    runs = arithmetic_runs(heads)
    if len(runs) == 1:
        _, length, first, step, descending = runs[0]
        return "range", (first, first + (length - 1) * step, step), descending, per_group
    if progressions and len(runs) <= len(heads) // 2:
        return "ranges", runs, False, per_group
    return "gather", None, False, per_group


def arithmetic_runs(heads: list[int]) -> tuple[tuple[int, int, int, int, bool], ...]:
    """``heads`` cut into maximal arithmetic progressions, each as (index of its first element,
    its length, its least slot, its step's magnitude, whether it descends)."""
    runs: list[list[int]] = []  # [start, length, step]
    for i, slot in enumerate(heads):
        if runs and (runs[-1][1] == 1 or slot - heads[i - 1] == runs[-1][2]):
            runs[-1][2] = slot - heads[i - 1]
            runs[-1][1] += 1
        else:
            runs.append([i, 1, 0])
    return tuple((start, length, min(heads[start], heads[start + length - 1]), abs(step) or 1,
                  step < 0) for start, length, step in runs)


@dataclass
class CallPlan:
    """What every attention layer of one call shares, computed once per call from tensors only
    (so a captured call recomputes it on replay): the positions, the KV slot each writes and
    reads (flat indices into a batch's regions: wfd.cache), RoPE angles and the causal mask over
    ``span`` keys per slot.

    ``span`` is the number of key positions attention reads per slot: the call's max position + 1
    (eager), or the cache's static length (static shapes: the same for every call of a run, with
    the mask hiding the keys after each position)."""

    positions: torch.Tensor  # [n] absolute positions
    slots: tuple[int, ...] | None  # None: no cache (the positions attend over each other)
    slot_index: torch.Tensor | None  # [n] the slots as a tensor
    cos: torch.Tensor  # [n, head_dim / 2] of the RoPE angles
    sin: torch.Tensor
    mask: torch.Tensor  # [n, span]: key j visible to position i iff j <= p_i
    layout: str = "none"  # "none" (no cache), "one", "range", "ranges", "runs", "gather"
    # "range": (first, last, step); "ranges": the progressions; "runs": (start, length, slot)s
    slot_range: tuple | None = None
    descending: bool = False  # a range read in descending slot order: queries flipped to match
    per_group: int = 1  # consecutive positions sharing one key set (see slot_layout)
    # "ranges", "runs": the keys each progression or run reads, its own positions' latest + 1 (a
    # sequence of a batch reads its own context, not the batch's longest); None otherwise
    progression_spans: tuple[int, ...] | None = None
    _tables: dict = field(default_factory=dict)  # the RoPE tables, made on first use

    @classmethod
    def make(cls, positions: torch.Tensor, slots: tuple[int, ...] | None,
             slot_index: torch.Tensor | None, frequencies: torch.Tensor,
             span: int | None = None, presence: torch.Tensor | None = None) -> CallPlan:
        """``presence``: [slots, positions], False where a key is absent from a slot (the
        reference exit KV rule's exited positions), masked like a later position's."""
        angles = rope_angles(positions, frequencies)
        if slots is None:
            keys = positions
            layout, slot_range, descending, per_group = "none", None, False, 1
        else:
            keys = torch.arange(span, device=positions.device)
            layout, slot_range, descending, per_group = slot_layout(
                slots, progressions=positions.device.type == "cpu")
        spans = None
        if layout in ("ranges", "runs"):  # a CPU's: reading its positions costs nothing
            latest = positions.tolist()
            spans = tuple(min(len(keys), 1 + max(latest[start * per_group:
                                                         (start + length) * per_group]))
                          for start, length, *_ in slot_range)
        mask = keys[None, :] <= positions[:, None]
        if presence is not None:
            mask = mask & presence[slot_index, :mask.shape[-1]]
        return cls(positions=positions, slots=slots, slot_index=slot_index, cos=angles.cos(),
                   sin=angles.sin(), mask=mask, layout=layout,
                   slot_range=slot_range, descending=descending, per_group=per_group,
                   progression_spans=spans)

    def rotations(self) -> torch.Tensor:
        """cos + i sin of each position's angles ([n, 1, head_dim / 2], complex fp32): what
        rope_interleaved multiplies by, made once per call for all its layers."""
        if "interleaved" not in self._tables:
            self._tables["interleaved"] = torch.complex(self.cos, self.sin)[:, None, :]
        return self._tables["interleaved"]

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The causal mask as an additive one in ``dtype`` (0 where visible, -inf elsewhere),
        shaped as the call's attention reads it ([groups, 1, per_group, span] with a cache, in
        the queries' group order; [n, n] without), made once per call for all its layers:
        scaled-dot-product attention turns a boolean mask into this in every layer otherwise
        (the same values: a CPU gives bitwise the same outputs)."""
        key = ("mask", dtype)
        if key not in self._tables:
            additive = torch.full(self.mask.shape, float("-inf"), dtype=dtype,
                                  device=self.mask.device).masked_fill_(self.mask, 0.0)
            if self.slots is not None:
                additive = additive.unflatten(0, (-1, self.per_group))[:, None]
                if self.descending:
                    additive = additive.flip(0)
            self._tables[key] = additive
        return self._tables[key]

    def rotate_half_tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin over the whole head ([n, 1, head_dim], both halves) in ``dtype``: what
        rope_rotate_half multiplies by, made once per call for all its layers."""
        key = ("halves", dtype)
        if key not in self._tables:
            self._tables[key] = tuple(torch.cat((t, t), dim=-1).to(dtype)[:, None, :]
                                      for t in (self.cos, self.sin))
        return self._tables[key]

    @classmethod
    def uncached(cls, positions: list[int], config, device: torch.device) -> CallPlan:
        """A full forward's plan (``config``: the model's): the positions attend over each other,
        no cache."""
        return cls.make(torch.tensor(positions, device=device), None, None,
                        rope_frequencies(config.head_dim, config.rope_base, device))


def progression(kv: LayerKV, first: int, last: int, step: int, span: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the slots first, first + step, ..., last: a strided view of the cache
    ([slots, kv_heads, span, head_dim]), nothing copied."""
    return kv.keys[first:last + 1:step, :, :span], kv.values[first:last + 1:step, :, :span]


def read_slots(kv: LayerKV, plan: CallPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values each group of positions attends over: [groups, kv_heads, span,
    head_dim]."""
    span = plan.mask.shape[-1]
    if plan.layout == "one":
        s = plan.slots[0]
        return kv.keys[s, :, :span].unsqueeze(0), kv.values[s, :, :span].unsqueeze(0)
    if plan.layout == "range":
        return progression(kv, *plan.slot_range, span)
    groups = plan.slot_index[::plan.per_group]
    return kv.keys[groups, :, :span], kv.values[groups, :, :span]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CallPlan,
           kv: LayerKV | None) -> torch.Tensor:
    """Causal attention of n positions (q: [..., n, heads, head_dim], k, v: [..., n, kv_heads,
    head_dim], after RoPE): one scaled-dot-product kernel per layer and call.

    With a cache, each position writes its k, v into its slot and attends over that slot's
    positions 0..p, whatever the mix of slots and sequences: the positions form groups with one
    key set each (slot_layout), a view of the cache where the slots allow, gathered otherwise.
    Without a cache, the n positions attend over each other only (a full forward; leading batch
    dimensions allowed, for training).
    """
    gqa = q.shape[-2] != k.shape[-2]
    if kv is None:
        out = F.scaled_dot_product_attention(q.movedim(-3, -2), k.movedim(-3, -2),
                                             v.movedim(-3, -2),
                                             attn_mask=plan.attention_mask(q.dtype),
                                             enable_gqa=gqa)
        return out.movedim(-2, -3)  # [..., n, heads, hd]
    kv.write(plan.slot_index, plan.positions, k, v)
    if plan.layout == "runs":
        return attend_runs(q, kv, plan, gqa)
    per_group = plan.per_group
    # [groups, heads, per_group, hd] queries, [groups, 1, per_group, span] masks
    q = q.unflatten(0, (-1, per_group)).transpose(1, 2)
    if plan.layout == "ranges":
        return attend_progressions(q, kv, plan, gqa).transpose(1, 2).flatten(0, 1)
    keys, values = read_slots(kv, plan)
    if plan.descending:
        q = q.flip(0)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.attention_mask(q.dtype),
                                         enable_gqa=gqa)
    if plan.descending:
        out = out.flip(0)
    return out.transpose(1, 2).flatten(0, 1)  # [n, heads, hd]


def attend_runs(q: torch.Tensor, kv: LayerKV, plan: CallPlan, gqa: bool) -> torch.Tensor:
    """Attention of a "runs" plan: each run of positions (a sequence's, one slot) one kernel
    over its own slot's keys, up to its own latest position (q and out: [n, heads, hd])."""
    mask = plan.attention_mask(q.dtype)  # [n, 1, 1, span]
    outs = []
    for (start, length, slot), span in zip(plan.slot_range, plan.progression_spans,
                                           strict=True):
        queries = q[start:start + length].transpose(0, 1)[None]  # [1, heads, length, hd]
        masks = mask[start:start + length, 0, :, :span].transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(
            queries, kv.keys[slot, :, :span][None], kv.values[slot, :, :span][None],
            attn_mask=masks, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def attend_progressions(q: torch.Tensor, kv: LayerKV, plan: CallPlan, gqa: bool) -> torch.Tensor:
    """Attention of the groups of a "ranges" plan: each progression of slots a strided view of
    the cache and one kernel over that progression's own span (q: [groups, heads, per_group,
    hd]; out: the same shape)."""
    mask = plan.attention_mask(q.dtype)
    outs = []
    for (start, length, first, step, descending), span in zip(plan.slot_range,
                                                              plan.progression_spans, strict=True):
        queries, masks = q[start:start + length], mask[start:start + length, ..., :span]
        if descending:  # the view runs up the cache: the queries and masks turned to match
            queries, masks = queries.flip(0), masks.flip(0)
        keys, values = progression(kv, first, first + (length - 1) * step, step, span)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=masks,
                                             enable_gqa=gqa)
        outs.append(out.flip(0) if descending else out)
    return torch.cat(outs)
