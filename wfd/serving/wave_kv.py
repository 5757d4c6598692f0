"""The wave's KV cache and attention on vLLM's CPU build: one view over every layer's paged
cache, a side buffer for positions whose block vLLM has not allocated yet, and attention through
vLLM's own CPU kernels where every key lies in the paged cache (plain torch otherwise).

Position p at recurrence step r writes the cache of its (step, layer) at p's slot in its
request's blocks, as AR does; a position ahead of those vLLM has scheduled (a draft in flight)
writes there too when its block is already allocated (the rest of the request's last block),
and the wave's side buffer when it is not, moved into the paged cache once vLLM allocates the
block. So the side buffer holds only positions past a request's blocks, and only rows there
attend in plain torch: a call's other rows go through the kernel (``StepCalls``: a call split
in two).

vLLM lays the layers' caches back to back in one buffer, so all of them read as one cache of
layers x blocks blocks: block b of layer l is block l x blocks + b there. A call's rows, each in
its own layer (its recurrence step's), then attend in one kernel call per layer of the part:
each run of rows (``runs_of``: one wave's consecutive positions in one layer, a prompt's) a
request of the kernel, causal, up to its last position (``seq_lens`` p + 1), its block table
its request's shifted to its layer; a lone row, a request of one query.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _ops():
    """vLLM's custom ops (imported at first use: not on a call's path each time)."""
    from vllm import _custom_ops

    return _custom_ops


class PagedKV:
    """Every layer's paged cache in vLLM's CPU layout, as one view: vLLM allocates the layers'
    caches back to back in one buffer, each [blocks, kv heads, block, 2 x head dim], a (block,
    head) page holding its keys transposed ([head dim, block]) then its values ([block, head
    dim])."""

    def __init__(self, caches: list[torch.Tensor]):
        first = caches[0]
        blocks, heads, size, twice = first.shape
        step = first.numel()
        regular = all(c.shape == first.shape and c.is_contiguous()
                      and c.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                      and c.data_ptr() - first.data_ptr() == i * step * c.element_size()
                      for i, c in enumerate(caches))
        if not regular:
            raise RuntimeError("the plugin's schedules read vLLM's KV caches as one buffer, "
                               "layer after layer; this vLLM lays them out otherwise")
        dim = twice // 2
        page = (heads * size * twice, size * twice, twice, 1)
        whole = first.as_strided((len(caches) * blocks, heads, size, twice), page)
        # what vLLM's CPU kernels take: keys and values of every block of every layer
        self.key_cache, self.value_cache = whole.view(-1, heads, 2 * size, dim).chunk(2, dim=2)
        pages = whole.view(len(caches), blocks, heads, size * twice)
        self.keys = pages[..., :size * dim].unflatten(-1, (dim, size))  # [l, n, h, d, b]
        self.values = pages[..., size * dim:].unflatten(-1, (size, dim))  # [l, n, h, b, d]
        self.block, self.blocks = size, blocks
        self.pointer = first.data_ptr()

    def write(self, layers: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Row i's k, v ([kv heads, head dim]) in layer ``layers[i]`` at ``positions[i]`` of the
        sequence whose block table is ``tables[i]``."""
        n = tables.gather(1, (positions // self.block)[:, None])[:, 0].long()
        b = positions % self.block
        self.keys[layers, n, :, :, b] = k
        self.values[layers, n, :, b, :] = v

    def copy(self, sources: torch.Tensor, targets: torch.Tensor, blocks: torch.Tensor,
             offsets: torch.Tensor) -> None:
        """Entry i: the keys and values at ``offsets[i]`` of paged block ``blocks[i]``, layer
        ``sources[i]``'s into layer ``targets[i]``'s (one indexed copy for all)."""
        self.keys[targets, blocks, :, :, offsets] = self.keys[sources, blocks, :, :, offsets]
        self.values[targets, blocks, :, offsets, :] = self.values[sources, blocks, :, offsets, :]

    def read(self, layers: torch.Tensor, tables: torch.Tensor, written: torch.Tensor,
             length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..length-1 ([rows, length, kv heads, head dim]) of row
        i's layer and sequence, read up to position ``written[i]`` (past it: a copy of that
        one's, for the caller to replace)."""
        at = torch.minimum(torch.arange(length)[None, :], written[:, None])
        n = tables.gather(1, at // self.block).long()
        b = at % self.block
        layer = layers[:, None].expand_as(n)
        return self.keys[layer, n, :, :, b], self.values[layer, n, :, b, :]


def allocated(wave, position: int, block: int) -> int:
    """The paged block holding ``position`` of the wave's request, 0 where vLLM has not allocated
    it yet (its null block)."""
    n = position // block
    return wave.blocks[n] if n < len(wave.blocks) else 0


def runs_of(rows: list, layers: list[list[int]]) -> list[tuple[int, int]]:
    """A call's rows ((wave, position) pairs) in runs (start, end): consecutive rows of one
    wave at consecutive positions, in one layer in every layer of the part (a prompt's, a DtV
    verification's), which attend as one request of vLLM's kernel, not one each."""
    runs, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i][0] is not rows[i - 1][0] or (
                rows[i][1] != rows[i - 1][1] + 1) or any(own[i] != own[i - 1] for own in layers):
            runs.append((start, i))
            start = i
    return runs


class CallKV:
    """The rows of one call of a part (each a wave's position, with the wave's block table),
    what their attention needs worked out once for all the part's layers: their slots, whether
    vLLM's kernel can read all their keys, and its scheduling metadata."""

    def __init__(self, paged: PagedKV, rows: list, where: torch.Tensor, heads: int,
                 kv_heads: int, head_dim: int, scale: float, isa: str,
                 runs: list[tuple[int, int]], table_cache: dict | None = None):
        self.paged, self.rows, self.where = paged, rows, where
        # the runs' shifted block tables by their waves and layers, kept for the step's later
        # calls (the block tables change only between steps): a WFD wave's ticks repeat one
        # pattern of depths
        self.table_cache = {} if table_cache is None else table_cache
        self.heads, self.kv_heads, self.head_dim, self.scale, self.isa = (
            heads, kv_heads, head_dim, scale, isa)
        block = paged.block
        self.one_wave = len({id(wave) for wave, _ in rows}) == 1
        # a slot exists where the position's block is allocated; in Python: a call has a few
        # rows, and a torch op costs more than a row. Where every row has one, every key they
        # read is in the paged cache (the side buffer holds only positions past the blocks);
        # otherwise none has (``StepCalls`` splits a call with rows on both sides)
        blocks = [allocated(wave, p, block) for wave, p in rows]
        self.slot_list = [b * block + p % block for b, (_, p) in zip(blocks, rows, strict=True)]
        self.kernel = all(blocks)
        self.torch_rows = 0 if self.kernel else len(rows)
        if self.kernel:
            ops = _ops()
            # each run of rows (one wave's consecutive positions in one layer: a prompt, a
            # verification; ``runs_of``) one request of the kernel, its queries the run's,
            # causal; its metadata worked out once for all the part's layers
            self.firsts = [start for start, _ in runs]
            self.first_waves = tuple(id(rows[f][0]) for f in self.firsts)
            self.seq_lens = torch.tensor([rows[end - 1][1] + 1 for _, end in runs],
                                         dtype=torch.int32)
            self.starts = torch.tensor([0] + [end for _, end in runs], dtype=torch.int32)
            self.metadata = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(runs), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                seq_lens=self.seq_lens, dtype=paged.key_cache.dtype,
                query_start_loc=self.starts, causal=True, sliding_window_size=-1, isa=isa,
                enable_kv_split=False)
        else:  # rows past their blocks: their sequences' block tables, [rows, width]
            self.tables = (rows[0][0].block_row.expand(len(rows), -1) if self.one_wave
                           else torch.stack([wave.block_row for wave, _ in rows]))

    def layers(self, layers: list[list[int]]) -> list:
        """The part's layers' stand-ins (``layers[j][row]``: row's cache in layer j); on the
        kernel's path each layer's slot mapping and block tables made here for all the part's
        layers at once (two tensors), not in each layer's call."""
        if not self.kernel:
            return [LayerAttention(self, torch.tensor(own)) for own in layers]
        paged = self.paged
        stride = paged.blocks * paged.block  # a layer's slots in the one cache
        mapping = torch.tensor([[layer * stride + slot for layer, slot in
                                 zip(own, self.slot_list, strict=True)] for own in layers])
        firsts = self.firsts
        key = (self.first_waves, tuple(tuple(own[f] for f in firsts) for own in layers))
        tables = self.table_cache.get(key)
        if tables is None:
            rows = self.rows
            # the runs' block tables, each shifted to its layer's first block
            runs = (rows[0][0].block_row[None].expand(len(firsts), -1) if self.one_wave
                    else torch.stack([rows[f][0].block_row for f in firsts]))
            shifts = torch.tensor([[own[f] * paged.blocks for f in firsts] for own in layers],
                                  dtype=torch.int32)
            tables = self.table_cache[key] = (runs[None] + shifts[:, :, None]).unbind(0)
        return [LayerAttention(self, mapping=m, tables=t)
                for m, t in zip(mapping.unbind(0), tables, strict=True)]

    def kernel_attend(self, mapping: torch.Tensor, tables: torch.Tensor, q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rows' k and v written at ``mapping`` (their slots in the one cache), then each run's
        attention through vLLM's CPU kernel over its block table shifted to its layer."""
        ops, paged = _ops(), self.paged
        ops.cpu_attn_reshape_and_cache(k, v, paged.key_cache, paged.value_cache, mapping,
                                       self.isa)
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=paged.key_cache, value_cache=paged.value_cache, output=out,
            query_start_loc=self.starts, seq_lens=self.seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=tables, softcap=0.0,
            scheduler_metadata=self.metadata, s_aux=None)
        return out

    def attend(self, layers: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """Row i's k and v written in layer ``layers[i]``, then its attention over that layer's
        keys of its sequence up to its position ([rows, heads, head dim]), in plain torch: rows
        past their request's blocks, whose k and v go to their wave's side buffer (the kernel's
        path: ``kernel_attend``); a wave's several rows in one layer (a prompt) over its keys
        gathered once, single rows together."""
        rows = self.rows
        for i, (wave, p) in enumerate(rows):
            wave.ahead[(int(layers[i]), p)] = (k[i].clone(), v[i].clone())
        out = torch.empty_like(q)
        count: dict[tuple[int, int], list[int]] = {}  # (wave, layer) -> its rows
        for i, (wave, _) in enumerate(rows):
            count.setdefault((id(wave), int(layers[i])), []).append(i)
        singles = [own[0] for own in count.values() if len(own) == 1]
        groups = [own for own in count.values() if len(own) > 1] + ([singles] if singles else [])
        for group in groups:
            index = torch.tensor(group)
            out[index] = self._attention(group, layers, q[index])
        return out

    def _attention(self, group: list[int], layers: torch.Tensor, q: torch.Tensor
                   ) -> torch.Tensor:
        """Causal attention of the rows ``group`` (all of one wave and layer, or each of its
        own) over their layers' keys."""
        own = self.where[group]
        length = int(own.max()) + 1
        one_wave = len({(id(self.rows[i][0]), int(layers[i])) for i in group}) == 1
        keys_of = group[:1] if one_wave else group
        # each row's sequence read up to the last position its allocated blocks hold
        allocated = (self.tables[keys_of] != 0).sum(1) * self.paged.block - 1
        keys, values = self.paged.read(layers[keys_of], self.tables[keys_of], allocated, length)
        for j, i in enumerate(keys_of):
            wave, layer = self.rows[i][0], int(layers[i])
            for a in range(wave.scheduled + 1, length):
                if (layer, a) in wave.ahead:
                    keys[j, a], values[j, a] = wave.ahead[(layer, a)]
        repeat = q.shape[1] // keys.shape[2]
        keys, values = keys.repeat_interleave(repeat, 2), values.repeat_interleave(repeat, 2)
        mask = torch.arange(length)[None, :] <= own[:, None]  # [rows, keys]
        if one_wave:
            scores = torch.einsum("rhd,khd->rhk", q, keys[0])
        else:
            scores = torch.einsum("rhd,rkhd->rhk", q, keys)
        scores = (scores * self.scale).masked_fill(~mask[:, None, :], float("-inf"))
        if one_wave:
            return torch.einsum("rhk,khd->rhd", scores.softmax(-1), values[0])
        return torch.einsum("rhk,rkhd->rhd", scores.softmax(-1), values)


class LayerAttention:
    """Stands in for a vLLM ``Attention`` layer in one call over the waves of a step: each row's
    k and v written to the cache of its own layer (its recurrence step's) in its own request's
    sequence, and attention over that layer's keys up to the row's position (causal). On the
    kernel's path it holds its rows' slots in the one cache (``mapping``) and its runs' block
    tables, made for the call (``CallKV.layers``); otherwise its rows' layers (plain torch)."""

    def __init__(self, call: CallKV, layers: torch.Tensor | None = None,
                 mapping: torch.Tensor | None = None, tables: torch.Tensor | None = None):
        self.call, self.layers, self.mapping, self.tables = call, layers, mapping, tables

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        call = self.call
        q = q.view(-1, call.heads, call.head_dim)
        k, v = k.view(-1, call.kv_heads, call.head_dim), v.view(-1, call.kv_heads, call.head_dim)
        if self.mapping is None:
            return call.attend(self.layers, q, k, v).flatten(1)
        return call.kernel_attend(self.mapping, self.tables, q, k, v).flatten(1)


class SplitCall:
    """A call whose rows' blocks are allocated but for some (drafts past a request's last
    block, ``inside[i]`` false): those attend in plain torch, the rest through vLLM's kernel,
    each set a ``CallKV`` (the kernel's first: a row past the blocks may read keys the others
    write)."""

    def __init__(self, paged: PagedKV, rows: list, where: torch.Tensor,
                 layers: list[list[int]], inside: list[bool], shape: tuple, table_cache: dict):
        self.parts, self.torch_rows = [], inside.count(False)
        for side in (True, False):
            own = [i for i, flag in enumerate(inside) if flag == side]
            part = [rows[i] for i in own]
            runs = runs_of(part, [[layer[i] for i in own] for layer in layers])
            self.parts.append((torch.tensor(own), own,
                               CallKV(paged, part, where[own], *shape, runs, table_cache)))

    def layers(self, layers: list[list[int]]) -> list:
        made = [(index, call.layers([[layer[i] for i in own] for layer in layers]))
                for index, own, call in self.parts]
        return [SplitAttention([(index, each[j]) for index, each in made])
                for j in range(len(layers))]


class SplitAttention:
    """A layer's stand-in over a ``SplitCall``: each set of rows through its own."""

    def __init__(self, parts: list[tuple[torch.Tensor, LayerAttention]]):
        self.parts = parts

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        for index, attention in self.parts:
            out[index] = attention(q[index], k[index], v[index])
        return out


class StepCalls:
    """What the attention of a step's calls needs, made once and reused within the step: the
    last call's (a tick's block calls, a prompt's calls at every depth have their rows in runs
    of one shape, so their slots and the kernel's metadata are the same), and the runs' block
    tables shifted to their layers (a WFD wave's ticks repeat one pattern of depths). Both hold
    for one engine step only: vLLM allocates blocks between steps (``clear``)."""

    def __init__(self):
        self.rows = {"kernel_rows": 0, "torch_rows": 0}  # the calls' rows by path, all steps
        self.clear()

    def clear(self) -> None:
        self.last: tuple[tuple, CallKV | SplitCall] | None = None
        self.tables: dict = {}

    def stand_ins(self, paged: PagedKV, rows: list, where: torch.Tensor,
                  layers: list[list[int]], attention, scale: float) -> list:
        """Layer j's stand-in for a vLLM ``Attention`` (``attention``: one of the model's, for
        its shapes), its rows each in the cache ``layers[j][row]``."""
        runs = runs_of(rows, layers)
        key = ([(id(wave), p) for wave, p in rows], runs)
        if self.last is None or self.last[0] != key:
            shape = (attention.num_heads, attention.num_kv_heads, attention.head_size, scale,
                     attention.isa)
            inside = [bool(allocated(wave, p, paged.block)) for wave, p in rows]
            self.last = (key, SplitCall(paged, rows, where, layers, inside, shape, self.tables)
                         if any(inside) and not all(inside)
                         else CallKV(paged, rows, where, *shape, runs, self.tables))
        call = self.last[1]
        self.rows["torch_rows"] += call.torch_rows
        self.rows["kernel_rows"] += len(rows) - call.torch_rows
        return call.layers(layers)
