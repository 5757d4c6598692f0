"""WaveFront Decoding inside vLLM (``hf_overrides={"schedule": "wfd", "draft_depth": d}``).

Each request keeps a wave across engine steps: ``costmodel.schedules.wfd``'s plan, the one the
decoder and the simulator execute, run here against vLLM's KV cache. An engine step schedules
one token per request (the one vLLM sampled last step); the wave runs its ticks (one block call
over every position in flight, each at its own depth; the newest drafts at d, the oldest reaches
R) until the position of that token has been read out at R, and hands that readout to vLLM,
whose sampler commits the next token. The step after, the wave compares that token with the
draft it made for the position: equal, the position is already deep in the wave (the work the
wave saved); not, the younger positions are flushed and the token re-enters at depth 0. The
committed tokens are vLLM's samples from depth-R readouts, as in AR, so greedy and sampled
decoding are exact by construction; drafts are greedy (argmax at d).

KV: position p at recurrence step r writes the cache of its (step, layer), as in AR; the
positions vLLM has scheduled write its paged cache at their slots, the positions ahead of them
(drafts in flight, which vLLM has not given slots yet) a buffer of the wave's own, moved into
the paged cache when vLLM schedules them. Attention is computed here in plain torch over the
paged layout of vLLM's CPU backend (``PagedKV``), keys of each position's own depth.

vLLM internals relied on (docs/serving.md): the forward context's attention metadata (block
table, sequence and query lengths by request), each ``Attention`` layer's ``kv_cache`` tensor in
the CPU backend's layout, and the model runner's ``_model_forward`` (the batch's request ids)
and ``_update_states`` (finished, aborted and preempted requests), which ``install_hooks``
wraps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.model_executor.models.config import VerifyAndUpdateConfig

from costmodel.plans import Bonus, Call, Check, Draft, Rollback, Verify
from costmodel.schedules import get

# The engine step's request ids in batch order, published by the runner hook before each
# forward; the requests to forget (finished, aborted, preempted) before the next.
_BATCH: list[str] = []
_FORGOTTEN: set[str] = set()


def install_hooks() -> None:
    """Wrap the model runner's forward (to publish the batch's request ids) and its state
    update (to hear which requests ended or were preempted); once per process."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_wfd_hooks", False):
        return
    forward, update = GPUModelRunner._model_forward, GPUModelRunner._update_states

    def _model_forward(self, *args, **kwargs):
        _BATCH[:] = list(self.input_batch.req_ids)
        return forward(self, *args, **kwargs)

    def _update_states(self, scheduler_output):
        _FORGOTTEN.update(scheduler_output.finished_req_ids)
        _FORGOTTEN.update(getattr(scheduler_output, "preempted_req_ids", None) or ())
        return update(self, scheduler_output)

    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner._update_states = _update_states
    GPUModelRunner._wfd_hooks = True


def counters(model) -> dict[str, int]:
    """The wave's counters of a model of the plugin (``LLM.apply_model(counters)``)."""
    return model.wave.counters()


class PagedKV:
    """One layer's paged cache in vLLM's CPU layout: [blocks, kv heads, block, 2 x head dim],
    each (block, head) page holding its keys transposed ([head dim, block]) then its values
    ([block, head dim])."""

    def __init__(self, kv_cache: torch.Tensor):
        blocks, heads, size, twice = kv_cache.shape
        dim = twice // 2
        page = kv_cache.view(blocks, heads, size * twice)
        self.keys = page[..., :size * dim].unflatten(-1, (dim, size))  # [n, h, d, b]
        self.values = page[..., size * dim:].unflatten(-1, (size, dim))  # [n, h, b, d]
        self.block = size

    def _where(self, block_row: torch.Tensor, positions: torch.Tensor):
        return block_row[positions // self.block].long(), positions % self.block

    def write(self, block_row: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """k, v: [positions, kv heads, head dim]."""
        n, b = self._where(block_row, positions)
        self.keys[n, :, :, b] = k
        self.values[n, :, b, :] = v

    def read(self, block_row: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..length-1: [length, kv heads, head dim]."""
        n, b = self._where(block_row, torch.arange(length))
        return self.keys[n, :, :, b], self.values[n, :, b, :]


@dataclass
class Wave:
    """One request's wave: its plan's events, paused where a token is committed (vLLM samples
    it), and what the plan's calls have computed so far."""

    steps: object  # the plan's generator
    token_at: dict[int, int]
    scheduled: int  # the newest position vLLM has scheduled (it holds a slot)
    block_row: torch.Tensor | None = None
    pending: Verify | Bonus | None = None
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    injections: dict[int, torch.Tensor] = field(default_factory=dict)
    readouts: dict[int, torch.Tensor] = field(default_factory=dict)
    drafts: dict[int, int] = field(default_factory=dict)
    ahead: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)  # (layer, position) -> k, v of a position vLLM has not scheduled


class WaveAttention:
    """Stands in for a vLLM ``Attention`` layer in one call of a wave: each row's k and v
    written to the cache of its own layer (its recurrence step's), and attention over that
    layer's keys up to the row's position (causal)."""

    def __init__(self, decoder: WaveDecoder, wave: Wave, positions: list[int],
                 layers: list[int]):
        self.decoder, self.wave, self.positions, self.layers = decoder, wave, positions, layers

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        some = self.decoder.model.caches[self.layers[0]]
        heads, kv_heads, dim = some.num_heads, some.num_kv_heads, some.head_size
        q = q.view(-1, heads, dim)
        k, v = k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
        for i, (p, layer) in enumerate(zip(self.positions, self.layers, strict=True)):
            self.decoder.store(self.wave, layer, p, k[i], v[i])
        out = torch.empty_like(q)
        for layer in dict.fromkeys(self.layers):  # rows of one layer attend together
            rows = [i for i, lay in enumerate(self.layers) if lay == layer]
            last = max(self.positions[i] for i in rows)
            keys, values = self.decoder.keys(self.wave, layer, last + 1)
            group = heads // kv_heads
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            index = torch.tensor(rows)
            own = torch.tensor([self.positions[i] for i in rows])
            mask = torch.arange(last + 1)[None, :] <= own[:, None]  # [rows, keys]
            scores = torch.einsum("rhd,khd->hrk", q[index], keys) * self.decoder.scale
            scores = scores.masked_fill(~mask[None], float("-inf"))
            out[index] = torch.einsum("hrk,khd->rhd", scores.softmax(-1), values)
        return out.flatten(1)


class ScheduleHook(VerifyAndUpdateConfig):
    """vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``), run where the engine's
    config is made: a schedule the checkpoint cannot run is refused there, in one line, and WFD
    gets whole prompts (no chunked prefill: a wave starts from the whole prompt) and no prefix
    caching (a new request's prefill must start from position 0, where its wave starts)."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        cfg = vllm_config.model_config.hf_config
        if vllm_config.speculative_config is not None:
            _ = cfg.drafter  # a draft depth the checkpoint cannot run: refused here
        if getattr(cfg, "wave", None) is None:
            return
        if vllm_config.speculative_config is not None:
            raise ValueError("schedule wfd drafts for itself: leave out speculative_config")
        vllm_config.cache_config.enable_prefix_caching = False
        scheduler = vllm_config.scheduler_config
        scheduler.enable_chunked_prefill = False
        scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens,
                                               vllm_config.model_config.max_model_len)


class WaveDecoder:
    """WFD(d, cap) for every request of the engine's batches, on a model of the plugin
    (``LoopedForCausalLM``: its parts, its head, its caches; ``coda_caches(slot)`` the coda's
    caches for readouts at R (slot 0) or at d (slot 1))."""

    def __init__(self, model, draft_depth: int, width_cap: int | None):
        self.model = model
        self.schedule = get("wfd").of(draft_depth, None, width_cap)
        self.schedule.check(model.depth)
        self.waves: dict[str, Wave] = {}
        self.paged: dict[int, PagedKV] = {}
        self.scale = model.arch.head_dim ** -0.5
        self.totals = {"verified": 0, "accepted": 0, "flushed_positions": 0, "block_calls": 0}
        install_hooks()

    def counters(self) -> dict[str, int]:
        """Drafts verified and accepted, positions flushed and block calls (ticks) so far."""
        return dict(self.totals)

    # -- the engine step -----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata
                ) -> torch.Tensor:
        """Every request's rows of this step: a prompt starts a wave, a decoded token goes on
        with one; the hidden state of each request's last row is the readout vLLM samples
        from."""
        for req in _FORGOTTEN:
            self.waves.pop(req, None)
        _FORGOTTEN.clear()
        if len(_BATCH) != len(metadata.seq_lens):
            raise RuntimeError("WFD on vLLM: the batch's request ids were not published")
        out = torch.zeros(len(input_ids), self.model.arch.hidden_size,
                          dtype=self.model.lm_head.weight.dtype)
        starts = metadata.query_start_loc.tolist()
        for i, req in enumerate(_BATCH):
            rows = slice(starts[i], starts[i + 1])
            tokens, where = input_ids[rows].tolist(), positions[rows].tolist()
            wave = self.begin(req, tokens, where, metadata.block_table[i])
            out[starts[i + 1] - 1] = self.run(wave)
        return out

    def begin(self, req: str, tokens: list[int], where: list[int], block_row: torch.Tensor
              ) -> Wave:
        """The request's wave, its newest token delivered: a prompt (from position 0) starts
        one (anew after a preemption); a decoded token answers the event it paused at."""
        if where[0] == 0:
            plan = self.schedule.plan(len(tokens), self.model.depth,
                                      coda_attends=self.model.arch.coda_layers > 0)
            self.waves[req] = Wave(plan.steps(), dict(enumerate(tokens)), len(tokens) - 1,
                                   block_row)
            return self.waves[req]
        wave = self.waves.get(req)
        if wave is None or len(tokens) != 1 or where[0] != wave.scheduled + 1:
            raise RuntimeError(f"WFD on vLLM decodes whole prompts and one token per step; "
                               f"request {req} came with positions {where[0]}..{where[-1]} "
                               "(leave chunked prefill's token budget above the prompts)")
        position, token = where[0], tokens[0]
        wave.block_row = block_row  # new blocks come as the sequence grows
        wave.token_at[position] = token
        wave.scheduled = position
        if isinstance(wave.pending, Verify):
            ok = wave.drafts.pop(wave.pending.position) == token
            self.totals["verified"] += 1
            self.totals["accepted"] += ok
            wave.pending = ok  # the outcome the plan is sent
        else:
            wave.pending = None
        for layer, p in [key for key in wave.ahead if key[1] == position]:
            self.paged_kv(layer).write(wave.block_row, torch.tensor([p]),
                                       *(t[None] for t in wave.ahead.pop((layer, p))))
        return wave

    def run(self, wave: Wave) -> torch.Tensor:
        """The wave's events up to its next commit; the readout at R that commit samples."""
        reply, wave.pending = wave.pending, None
        while True:
            event = wave.steps.send(reply)
            reply = None
            if isinstance(event, Call):
                self.call(wave, event)
            elif isinstance(event, Draft):
                token = int(self.model.compute_logits(wave.readouts[event.position][None])
                            .argmax(-1))
                wave.drafts[event.position] = token
                wave.token_at[event.position + 1] = token
            elif isinstance(event, Verify | Bonus):
                wave.pending = event
                return wave.readouts[event.position]
            elif isinstance(event, Rollback):
                self.totals["flushed_positions"] += event.flushed
                self.rollback(wave, event.length)
            elif isinstance(event, Check):  # pragma: no cover - no exit rule in this mode
                raise RuntimeError("WFD on vLLM runs without exit rules")

    # -- calls ---------------------------------------------------------------------------------
    def call(self, wave: Wave, call: Call) -> None:
        model, positions = self.model, list(call.positions)
        where = torch.tensor(positions)
        if call.kind == "prelude":
            tokens = torch.tensor([wave.token_at[p] for p in positions])
            layers = [[j] * len(positions) for j in range(model.prelude_layers)]
            e = model.prelude(tokens, where, caches=self.stand_ins(wave, positions, layers))
            states = model.initial_state(where, e)
            for i, p in enumerate(positions):
                wave.injections[p], wave.states[p] = e[i], states[i]
        elif call.kind == "block":
            self.totals["block_calls"] += 1
            layers = [[model.core_layer_index(r, j) for r in call.depths]
                      for j in range(model.core_layers)]
            states = torch.stack([wave.states[p] for p in positions])
            e = torch.stack([wave.injections[p] for p in positions])
            new = model.step(states, e, where, self.stand_ins(wave, positions, layers))
            for i, p in enumerate(positions):
                wave.states[p] = new[i]
        else:
            slots = [0 if r == model.depth else 1 for r in call.depths]
            layers = [[model.coda_layer_index(s, j) for s in slots]
                      for j in range(model.arch.coda_layers)]
            states = torch.stack([wave.states[p] for p in positions])
            out = model.readout(states, where, caches=self.stand_ins(wave, positions, layers))
            for i, p in enumerate(positions):
                wave.readouts[p] = out[i]

    def stand_ins(self, wave: Wave, positions: list[int], layers: list[list[int]]
                  ) -> list[WaveAttention]:
        """The caches a part's layers attend with in this call: layer j's rows each in the
        cache ``layers[j][row]``."""
        return [WaveAttention(self, wave, positions, rows) for rows in layers]

    def rollback(self, wave: Wave, length: int) -> None:
        """Positions from ``length`` on are discarded (their KV ahead dropped; what they wrote in
        the paged cache is written again when they re-enter)."""
        for key in [key for key in wave.ahead if key[1] >= length]:
            del wave.ahead[key]
        for kept in (wave.states, wave.injections, wave.readouts):
            for p in [p for p in kept if p >= length]:
                del kept[p]

    # -- KV ------------------------------------------------------------------------------------
    def paged_kv(self, layer: int) -> PagedKV:
        cache = self.model.caches[layer].kv_cache
        known = self.paged.get(layer)
        if known is None or known.keys.data_ptr() != cache.data_ptr():
            known = self.paged[layer] = PagedKV(cache)
        return known

    def store(self, wave: Wave, layer: int, position: int, k: torch.Tensor,
              v: torch.Tensor) -> None:
        if position <= wave.scheduled:
            self.paged_kv(layer).write(wave.block_row, torch.tensor([position]), k[None],
                                       v[None])
        else:
            wave.ahead[(layer, position)] = (k.clone(), v.clone())

    def keys(self, wave: Wave, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..length-1 in ``layer``: the scheduled ones from the
        paged cache, those ahead from the wave's own."""
        keys, values = self.paged_kv(layer).read(wave.block_row,
                                                 min(length, wave.scheduled + 1))
        ahead = [wave.ahead[(layer, p)] for p in range(wave.scheduled + 1, length)]
        if ahead:
            keys = torch.cat([keys, torch.stack([k for k, _ in ahead])])
            values = torch.cat([values, torch.stack([v for _, v in ahead])])
        return keys, values
