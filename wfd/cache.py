"""The KV cache of a looped LM: one slot per (depth, layer), position-indexed, with rollback.

Every attention layer owns a tensor K, V of shape [slots, kv_heads, max_len, head_dim]. A
position's key lives at index = its absolute position, so positions at different depths can be
written and read in one call without moving anything. Which slot a call uses:

- prelude layers: one slot;
- core (block) layers: the step that brings a position to depth r uses slot r - 1, or with KV
  sharing over s slots, (r - 1) mod s (s = 1: one slot per layer; past positions then contribute
  whatever they wrote last into that slot, as in Huginn's compress-s cache);
- coda layers (Huginn): one slot per readout depth, so draft readouts never touch the verify path.

Per-slot lengths count the valid prefix of each slot. A write must extend or overwrite the valid
prefix (never leave a hole), and ``truncate`` rolls every slot back to a prefix of positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from costmodel.plans import core_slot


class CacheError(RuntimeError):
    """A write that would leave a hole in a slot, or a cache that is too small."""


@dataclass
class LayerKV:
    keys: torch.Tensor  # [slots, kv_heads, max_len, head_dim]
    values: torch.Tensor
    lengths: list[int]  # valid prefix per slot
    overwrite: bool  # whether a position may be written again without a truncate (sharing)

    def write(self, slots: list[int], positions: list[int], k: torch.Tensor, v: torch.Tensor,
              slot_index: torch.Tensor | None = None, pos_index: torch.Tensor | None = None
              ) -> None:
        """Store k, v ([n, kv_heads, head_dim]) of each position in its slot (the index tensors
        of slots and positions may be passed in, built once per call)."""
        max_len = self.keys.shape[2]
        lengths = list(self.lengths)
        for slot, pos in sorted(zip(slots, positions, strict=True)):
            if pos >= max_len:
                raise CacheError(f"position {pos} beyond the cache's {max_len} positions")
            if pos > lengths[slot]:
                raise CacheError(f"slot {slot} holds {lengths[slot]} positions; writing "
                                 f"position {pos} would leave a hole")
            if pos < lengths[slot] and not self.overwrite:
                # without sharing, a position is written once: a schedule forgot to roll back
                raise CacheError(f"slot {slot} already holds position {pos}; truncate first")
            lengths[slot] = max(lengths[slot], pos + 1)
        self.lengths = lengths
        if slot_index is None:
            slot_index = torch.tensor(slots, device=self.keys.device)
        if pos_index is None:
            pos_index = torch.tensor(positions, device=self.keys.device)
        self.keys[slot_index, :, pos_index] = k.to(self.keys.dtype)
        self.values[slot_index, :, pos_index] = v.to(self.values.dtype)

    def read(self, slots: list[int], positions: list[int],
             slot_index: torch.Tensor | None = None,
             slot_range: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values each position attends over: [1 or n, kv_heads, T, head_dim] with
        T = max position + 1 (the caller masks keys after each position). One slot, or distinct
        slots in arithmetic progression (given as ``slot_range``, ascending), are views of the
        cache; other mixes are gathered, one row per position."""
        span = max(positions) + 1
        if len(set(slots)) == 1:  # one slot: AR, prefill, DtV verify
            s = slots[0]
            return self.keys[s, :, :span].unsqueeze(0), self.values[s, :, :span].unsqueeze(0)
        if slot_range is not None:  # a wave: depths d apart
            first, last, step = slot_range
            return (self.keys[first:last + 1:step, :, :span],
                    self.values[first:last + 1:step, :, :span])
        if slot_index is None:
            slot_index = torch.tensor(slots, device=self.keys.device)
        return self.keys[slot_index, :, :span], self.values[slot_index, :, :span]

    def truncate(self, length: int) -> None:
        self.lengths = [min(n, length) for n in self.lengths]


class KVCache:
    """All layers' KV for one sequence, and the slot each depth maps to."""

    def __init__(self, *, prelude_layers: int, core_layers: int, coda_layers: int, depth: int,
                 kv_sharing: int, readout_depths: list[int], kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype, device: torch.device | str):
        if kv_sharing < 0:
            raise ValueError("kv_sharing must be 0 (one slot per depth) or a slot count >= 1")
        self.depth = depth
        self.kv_sharing = kv_sharing
        self.max_len = max_len
        core_slots = depth if kv_sharing == 0 else min(kv_sharing, depth)
        self.coda_slot_of = {r: i for i, r in enumerate(sorted(set(readout_depths)))}

        def make(slots: int, overwrite: bool) -> LayerKV:
            shape = (slots, kv_heads, max_len, head_dim)
            return LayerKV(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device), [0] * slots,
                           overwrite)

        self.prelude = [make(1, False) for _ in range(prelude_layers)]
        self.core = [make(core_slots, kv_sharing > 0) for _ in range(core_layers)]
        self.coda = [make(max(len(self.coda_slot_of), 1), False) for _ in range(coda_layers)]

    def core_slot(self, depth: int) -> int:
        """Slot written and read by the step that brings a position to ``depth`` (1-based)."""
        if not 1 <= depth <= self.depth:
            raise CacheError(f"depth {depth} outside 1..{self.depth}")
        return core_slot(depth, self.kv_sharing)

    def coda_slot(self, readout_depth: int) -> int:
        if readout_depth not in self.coda_slot_of:
            raise CacheError(f"no coda slot for readout depth {readout_depth}; this cache "
                             f"reads out at {sorted(self.coda_slot_of)}")
        return self.coda_slot_of[readout_depth]

    def layers(self) -> list[LayerKV]:
        return [*self.prelude, *self.core, *self.coda]

    def truncate(self, length: int) -> None:
        """Roll back every slot to the first ``length`` positions."""
        for layer in self.layers():
            layer.truncate(length)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers()
                   for t in (layer.keys, layer.values))

    def used_bytes(self) -> int:
        """Bytes of the valid entries (what a cache grown on demand would hold)."""
        total = 0
        for layer in self.layers():
            per_position = 2 * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.element_size()
            total += sum(layer.lengths) * per_position
        return total
