"""Building blocks shared by both families: RMSNorm, the two RoPE conventions, and attention over
positions that may sit at different depths (each reading its own KV slot)."""

from __future__ import annotations

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


def rope_interleaved(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Huginn: rotate adjacent pairs (2j, 2j+1), computed in fp32. x: [n, heads, head_dim]."""
    x32 = x.float().unflatten(-1, (-1, 2))
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x0, x1 = x32[..., 0], x32[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)


def rope_rotate_half(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Ouro (HF Llama style): rotate the two halves; cos/sin cast to the activation dtype."""
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int],
           kv: LayerKV | None, slots: list[int] | None) -> torch.Tensor:
    """Causal attention of n positions (q, k, v: [n, heads or kv_heads, head_dim], after RoPE).

    With a cache, each position writes its k, v into its slot and attends over that slot's
    positions 0..p: one batched kernel for all positions, whatever their slots (one slot: a view
    of the cache; several: gathered, one row per position). Without a cache, the n positions
    attend over each other only (a full forward).
    """
    n, heads, head_dim = q.shape
    pos = torch.tensor(positions, device=q.device)
    if kv is None:
        keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, kvh, n, hd]
        key_pos = pos
    else:
        kv.write(slots, positions, k, v)
        keys, values = kv.read(slots, positions)  # [1 or n, kvh, T, hd]
        key_pos = torch.arange(keys.shape[2], device=q.device)
    groups = heads // keys.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    mask = key_pos[None, :] <= pos[:, None]  # [n, T]
    if keys.shape[0] == 1:  # all positions share the key set: [1, heads, n, hd] queries
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values,
                                             attn_mask=mask[None, None])
        return out[0].transpose(0, 1)  # [n, heads, hd]
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values,
                                         attn_mask=mask[:, None, None, :])
    return out[:, :, 0]
