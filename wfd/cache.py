"""The KV cache of a looped LM: one slot per (depth, layer), position-indexed, static, with
rollback, for one sequence or a batch of them (one region per sequence).

Every attention layer owns K, V of shape [slots, kv_heads, max_len, head_dim], allocated once
per run; a position's key lives at index = its absolute position, so positions at different
depths are written in place and read as views. Slots: one for the prelude; for the core, the
step that brings a position to depth r uses slot r - 1, or (r - 1) mod s with KV sharing over s
slots; for the coda (Huginn), one per readout depth, so draft readouts never touch the verify
path. A position that exits at depth e copies its depth-e KV into the slots it skipped
(``exit``; the "latest" rule), or, with the public Huginn code's rule ("reference"), is absent
from those slots' keys (``presence``, which attention masks by) while the coda keeps one slot
per position, rewritten by each readout; a slot keeps writes beyond its valid prefix, which join
it once the gap is filled.
Sequence b of a batch owns rows b * slots ... b * slots + slots - 1 (``flat``), handed to the
next prompt when it finishes (``release``).

A part keeps one list of per-slot lengths (the valid prefix of each slot), checked and advanced
once per call by ``claim``: a write must extend or overwrite the valid prefix, never leave a
hole, and ``truncate`` rolls back. The tensors are never reallocated, so their shapes stay fixed
for the whole run (what captured execution needs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from costmodel.slots import core_slot


class CacheError(RuntimeError):
    """A write that would leave a hole in a slot, or a cache that is too small."""


@dataclass
class LayerKV:
    keys: torch.Tensor  # [slots, kv_heads, max_len, head_dim]
    values: torch.Tensor
    lengths: list[int]  # valid prefix per slot: one list shared by the layers of a part

    def write(self, slot_index: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store k, v ([n, kv_heads, head_dim]) of each position in its slot: one indexed store,
        no Python loop (the part's ``claim`` checked the writes)."""
        self.keys[slot_index, :, positions] = k.to(self.keys.dtype)
        self.values[slot_index, :, positions] = v.to(self.values.dtype)


class PartKV:
    """The layers of one part (prelude, core or coda) and their shared per-slot lengths."""

    def __init__(self, layers: int, slots: int, overwrite: bool, shape_tail: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device | str, sequences: int = 1):
        self.slots = slots  # per sequence; sequence b owns flat slots b * slots ... + slots - 1
        self.lengths = [0] * (slots * sequences)
        self.ahead: dict[int, set[int]] = {}  # slot -> positions written past its valid prefix
        self._copy_index: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # without sharing a position is written once: a schedule that writes it again forgot to
        # roll back; with sharing, later depths overwrite the slot by design
        self.overwrite = self.rewrites = overwrite
        shape = (slots * sequences, *shape_tail)
        self.layers = [LayerKV(torch.zeros(shape, dtype=dtype, device=device),
                               torch.zeros(shape, dtype=dtype, device=device), self.lengths)
                       for _ in range(layers)]
        # [slots, positions]: False where a position is absent from a slot's keys (the reference
        # exit rule's core; ``track_presence``); None where every written position is present
        self.presence: torch.Tensor | None = None

    def track_presence(self) -> None:
        if self.presence is None and self.layers:
            keys = self.layers[0].keys
            self.presence = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool,
                                       device=keys.device)

    def claim(self, slots: list[int], positions: list[int], max_len: int) -> None:
        """Check and record one call's writes (position p into slot s) for every layer."""
        if not self.layers:  # a part without attention (Ouro's) keeps no KV
            return
        lengths = self.lengths
        new = list(lengths)
        for slot, pos in sorted(zip(slots, positions, strict=True)):
            if pos >= max_len:
                raise CacheError(f"position {pos} beyond the cache's {max_len} positions")
            if pos > new[slot]:
                raise CacheError(f"slot {slot} holds {new[slot]} positions; writing "
                                 f"position {pos} would leave a hole")
            if (pos < new[slot] or pos in self.ahead.get(slot, ())) and not self.overwrite:
                raise CacheError(f"slot {slot} already holds position {pos}; truncate first")
            new[slot] = self._joined(slot, max(new[slot], pos + 1))
        lengths[:] = new  # in place: every layer holds this list

    def _joined(self, slot: int, length: int) -> int:
        """A slot's valid prefix once the positions written ahead of it that now follow on
        join it."""
        ahead = self.ahead.get(slot)
        while ahead and length in ahead:
            ahead.discard(length)
            length += 1
        return length

    def copy_ahead(self, sources: list[int], targets: list[int], position: int) -> None:
        """Copy ``position``'s entries from each source slot into its target slot, in every
        layer (an exited position's KV standing in for the depths it skipped)."""
        if not self.layers or not targets:
            return
        src, dst = self._index(sources, targets)
        for layer in self.layers:
            layer.keys[dst, :, position] = layer.keys[src, :, position]
            layer.values[dst, :, position] = layer.values[src, :, position]
        self._settle(targets, position)

    def mark_absent(self, targets: list[int], position: int) -> None:
        """``position`` is absent from the target slots' keys (an exited position under the
        reference rule): masked where attention reads them, yet counted as held."""
        if not self.layers or not targets:
            return
        self.presence[self._index(targets, targets)[1], position] = False
        self._settle(targets, position)

    def _index(self, sources: list[int], targets: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (tuple(sources), tuple(targets))
        if key not in self._copy_index:  # made once per pattern, on the cache's device
            device = self.layers[0].keys.device
            self._copy_index[key] = (torch.tensor(sources, device=device),
                                     torch.tensor(targets, device=device))
        return self._copy_index[key]

    def _settle(self, targets: list[int], position: int) -> None:
        """The targets hold ``position`` now (the valid prefix or the entries ahead of it)."""
        for slot in targets:
            if position < self.lengths[slot]:
                continue  # already valid there (a shared slot rewritten)
            if position == self.lengths[slot]:
                self.lengths[slot] = self._joined(slot, position + 1)
            else:
                self.ahead.setdefault(slot, set()).add(position)

    def truncate(self, length: int, sequence: int | None = None) -> None:
        """Keep the first ``length`` positions of every slot (of one sequence's slots)."""
        first, last = (0, len(self.lengths)) if sequence is None else (
            sequence * self.slots, (sequence + 1) * self.slots)
        self.lengths[first:last] = [min(n, length) for n in self.lengths[first:last]]
        if self.presence is not None:
            self.presence[first:last, length:] = True
        for slot in range(first, last):
            if self.ahead.get(slot):
                self.ahead[slot] = {p for p in self.ahead[slot] if p < length}

    def fill(self, length: int) -> None:
        """Mark every slot valid up to ``length`` and allow rewrites (timing the same call
        again and again)."""
        self.lengths[:] = [length] * len(self.lengths)
        self.overwrite = True
        if self.presence is not None:
            self.presence.fill_(True)

    def reset(self) -> None:
        """Empty every slot for a new run (the tensors stay: a masked key is never read)."""
        self.lengths[:] = [0] * len(self.lengths)
        self.ahead.clear()
        self.overwrite = self.rewrites
        if self.presence is not None:
            self.presence.fill_(True)


def part_slots(depth: int, kv_sharing: int, readout_depths: list[int],
               exit_kv: str = "latest") -> dict[str, int]:
    """Slots per layer of each part, for one sequence: one in the prelude, R (or the s shared)
    in the core, one per readout depth in the coda (one under the reference exit KV rule)."""
    return {"prelude": 1, "block": depth if kv_sharing == 0 else min(kv_sharing, depth),
            "coda": 1 if exit_kv == "reference" else max(len(set(readout_depths)), 1)}


class KVCache:
    """All layers' KV for one sequence (or ``sequences`` of them), and the slot each depth maps
    to."""

    def __init__(self, *, prelude_layers: int, core_layers: int, coda_layers: int, depth: int,
                 kv_sharing: int, readout_depths: list[int], kv_heads: int, head_dim: int,
                 max_len: int, dtype: torch.dtype, device: torch.device | str,
                 sequences: int = 1, exit_kv: str = "latest"):
        if kv_sharing < 0:
            raise ValueError("kv_sharing must be 0 (one slot per depth) or a slot count >= 1")
        if sequences < 1:
            raise ValueError(f"a cache holds at least one sequence, got {sequences}")
        self.depth = depth
        self.kv_sharing = kv_sharing
        self.max_len = max_len
        self.sequences = sequences
        self.exit_kv = exit_kv
        reference = exit_kv == "reference"
        if reference and kv_sharing:
            raise ValueError("the reference exit KV rule keeps a slot per depth (kv_sharing 0)")
        slots = part_slots(depth, kv_sharing, readout_depths, exit_kv)
        # the reference rule: every readout of a position rewrites its one coda entry
        self.coda_slot_of = {r: 0 if reference else i
                             for i, r in enumerate(sorted(set(readout_depths)))}
        self.parts = {kind: PartKV(layers, slots[kind], kind == "block" and kv_sharing > 0
                                   or kind == "coda" and reference,
                                   (kv_heads, max_len, head_dim), dtype, device, sequences)
                      for kind, layers in (("prelude", prelude_layers), ("block", core_layers),
                                           ("coda", coda_layers))}
        if reference:
            self.parts["block"].track_presence()
        self.prelude = self.parts["prelude"].layers
        self.core = self.parts["block"].layers
        self.coda = self.parts["coda"].layers

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

    def slots(self, kind: str, depths: list[int], sequences: list[int] | None = None
              ) -> list[int]:
        """The slot each position of a call of ``kind`` (prelude, block, coda) writes and reads:
        flat indices into its sequence's region when ``sequences`` (one per position) is given."""
        if kind == "prelude":
            slots = [0] * len(depths)
        elif kind == "block":
            slots = [self.core_slot(r) for r in depths]
        else:
            slots = [self.coda_slot(r) for r in depths]
        if sequences is None:
            return slots
        per_sequence = self.parts[kind].slots
        return [b * per_sequence + s for b, s in zip(sequences, slots, strict=True)]

    def claim(self, kind: str, slots: list[int], positions: list[int]) -> None:
        self.parts[kind].claim(slots, positions, self.max_len)

    def allow_rewrites(self, kind: str) -> None:
        """Let a part's writes rewrite positions it holds until the next ``reset``: adaptive
        drafting reads a position out into the draft slot at each depth its draft rule checks."""
        self.parts[kind].overwrite = True

    def exit(self, position: int, depth: int, sequence: int | None = None) -> None:
        """``position`` exited at ``depth``: its KV there stands in for every deeper depth's,
        in the core slots it never wrote and the coda slots of deeper readout depths (the
        reference rule: it is absent from those core slots' keys)."""
        base = {kind: 0 if sequence is None else sequence * part.slots
                for kind, part in self.parts.items()}
        written = {self.core_slot(r) for r in range(1, depth + 1)}
        skipped = sorted({self.core_slot(r) for r in range(depth + 1, self.depth + 1)} - written)
        if self.exit_kv == "reference":  # absent from deeper keys; its coda entry is final
            self.parts["block"].mark_absent([base["block"] + s for s in skipped], position)
            return
        source = base["block"] + self.core_slot(depth)
        self.parts["block"].copy_ahead([source] * len(skipped),
                                       [base["block"] + s for s in skipped], position)
        if depth in self.coda_slot_of:
            deeper = [i for r, i in self.coda_slot_of.items() if r > depth]
            source = base["coda"] + self.coda_slot_of[depth]
            self.parts["coda"].copy_ahead([source] * len(deeper),
                                          [base["coda"] + s for s in deeper], position)

    def layers(self) -> list[LayerKV]:
        return [*self.prelude, *self.core, *self.coda]

    @property
    def presence(self) -> torch.Tensor | None:
        """The core's [slots, positions] presence of keys (None: every written key present)."""
        return self.parts["block"].presence

    def truncate(self, length: int, sequence: int | None = None) -> None:
        """Roll back every slot (of one sequence's region) to the first ``length`` positions."""
        for part in self.parts.values():
            part.truncate(length, sequence)

    def release(self, sequence: int) -> None:
        """Empty a finished sequence's region for the next prompt."""
        self.truncate(0, sequence)

    def fill(self, length: int) -> None:
        for part in self.parts.values():
            part.fill(length)

    def reset(self) -> None:
        for part in self.parts.values():
            part.reset()

    @property
    def nbytes(self) -> int:
        """Bytes allocated (what the cost model's memory model counts for the same run)."""
        return sum(t.numel() * t.element_size() for layer in self.layers()
                   for t in (layer.keys, layer.values))

    def used_bytes(self) -> int:
        """Bytes of the valid entries (what a cache grown on demand would hold)."""
        return sum(2 * sum(layer.lengths) * layer.keys.shape[1] * layer.keys.shape[3]
                   * layer.keys.element_size() for layer in self.layers())
