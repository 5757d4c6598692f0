"""Building blocks shared by both families: RMSNorm, the two RoPE conventions, and attention over
positions that may sit at different depths (each reading its own KV slot)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .cache import LayerKV


class RMSNorm(nn.Module):
    """Normalize in fp32, cast back to the input dtype, then scale (Huginn and Ouro/HF order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_angles(positions: torch.Tensor, head_dim: int, base: float) -> torch.Tensor:
    """angle[p, j] = p / base^(2j / head_dim), in fp32: [n, head_dim / 2]."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=positions.device)[
        : head_dim // 2].float() / head_dim))
    return torch.outer(positions.float(), inv_freq)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Huginn: rotate adjacent pairs (2j, 2j+1), computed in fp32. x: [n, heads, head_dim];
    cos, sin: [n, head_dim / 2] of the RoPE angles."""
    x32 = x.float().unflatten(-1, (-1, 2))
    cos, sin = cos[:, None, :], sin[:, None, :]
    x0, x1 = x32[..., 0], x32[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Ouro (HF Llama style): rotate the two halves; cos/sin cast to the activation dtype."""
    cos = torch.cat((cos, cos), dim=-1).to(x.dtype)[:, None, :]
    sin = torch.cat((sin, sin), dim=-1).to(x.dtype)[:, None, :]
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


@dataclass
class CallPlan:
    """What every attention layer of one call shares, computed once per call: the positions, the
    KV slot each reads and writes, RoPE angles, index tensors and the causal mask."""

    positions: list[int]
    slots: list[int] | None  # None: no cache (a full forward)
    cos: torch.Tensor  # [n, head_dim / 2] of the RoPE angles
    sin: torch.Tensor
    mask: torch.Tensor  # [n, T]: key j visible to position i iff j <= p_i
    slot_index: torch.Tensor | None
    pos_index: torch.Tensor
    # Distinct slots in arithmetic progression (a full wave: depths d apart) are read as a strided
    # view of the cache, no copy: (first, last, step) in ascending slot order, and whether the
    # positions come in descending slot order (then queries are flipped to match).
    slot_range: tuple[int, int, int] | None = None
    descending: bool = False

    @classmethod
    def make(cls, positions: list[int], slots: list[int] | None, head_dim: int, base: float,
             device: torch.device) -> CallPlan:
        pos = torch.tensor(positions, device=device)
        keys = pos if slots is None else torch.arange(max(positions) + 1, device=device)
        slot_range, descending = None, False
        if slots is not None and len(slots) > 1 and len(set(slots)) == len(slots):
            steps = {b - a for a, b in zip(slots, slots[1:], strict=False)}
            if len(steps) == 1:
                step = steps.pop()
                descending = step < 0
                slot_range = (min(slots), max(slots), abs(step))
        angles = rope_angles(pos, head_dim, base)
        return cls(positions=positions, slots=slots, cos=angles.cos(), sin=angles.sin(),
                   mask=keys[None, :] <= pos[:, None],
                   slot_index=None if slots is None else torch.tensor(slots, device=device),
                   pos_index=pos, slot_range=slot_range, descending=descending)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CallPlan,
           kv: LayerKV | None) -> torch.Tensor:
    """Causal attention of n positions (q: [..., n, heads, head_dim], k, v: [..., n, kv_heads,
    head_dim], after RoPE).

    With a cache (one sequence), each position writes its k, v into its slot and attends over that
    slot's positions 0..p: one batched kernel for all positions, whatever their slots (one slot: a
    view of the cache; several: gathered, one row per position). Without a cache, the n positions
    attend over each other only (a full forward; leading batch dimensions allowed, for training).
    """
    heads = q.shape[-2]
    if kv is None:
        keys, values = k.movedim(-3, -2), v.movedim(-3, -2)  # [..., kv_heads, n, hd]
        shared = True
    else:
        kv.write(plan.slots, plan.positions, k, v, plan.slot_index, plan.pos_index)
        keys, values = kv.read(plan.slots, plan.positions, plan.slot_index, plan.slot_range)
        shared = keys.shape[0] == 1
        if shared:
            keys, values = keys[0], values[0]
    groups = heads // keys.shape[-3]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=-3)
        values = values.repeat_interleave(groups, dim=-3)
    if shared:  # all positions attend over one key set
        out = F.scaled_dot_product_attention(q.movedim(-3, -2), keys, values,
                                             attn_mask=plan.mask)
        return out.movedim(-2, -3)  # [..., n, heads, hd]
    q, mask = (q.flip(0), plan.mask.flip(0)) if plan.descending else (q, plan.mask)
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values,
                                         attn_mask=mask[:, None, None, :])[:, :, 0]
    return out.flip(0) if plan.descending else out
