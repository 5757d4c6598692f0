"""WaveFront Decoding inside vLLM (``hf_overrides={"schedule": "wfd", "draft_depth": d}``), and
DtV with nested reuse by the same machinery (``"schedule": "dtv"``, ``"block_length": k``).

Each request keeps a wave across engine steps: ``costmodel.schedules.wfd``'s plan, the one the
decoder and the simulator execute, run here against vLLM's KV cache. An engine step schedules
one token per request (the one vLLM sampled last step); the wave runs its ticks (one block call
over every position in flight, each at its own depth; the newest drafts at d, the oldest reaches
R) until the position of that token has been read out at R, and hands that readout to vLLM,
whose sampler commits the next token. The step after, the wave compares that token with the
draft it made for the position: equal, the position is already deep in the wave (the work the
wave saved); not, the younger positions are flushed and the token re-enters at depth 0. The
committed tokens are vLLM's samples from depth-R readouts, as in AR, so greedy and sampled
decoding are exact by construction; drafts are greedy (argmax at d). DtV's plan runs the same
way: a round drafts k positions one by one at d, continues them all to R in R - d block calls
(one copy of the weights, the drafts' latents and KV reused), and its verifications and bonus
then commit a token a step, from readouts already made.

KV: position p at recurrence step r writes the cache of its (step, layer), as in AR, in vLLM's
paged cache where p's block is allocated, in a buffer of the wave's own where it is not yet (a
draft ahead of the request's last block), moved into the paged cache when vLLM schedules p;
attention runs through vLLM's CPU kernels over every layer's cache as one (``wave_kv``).

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

from .wave_kv import CallKV, LayerAttention, PagedKV

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


def _forget(wave: Wave, gone) -> None:
    """Drop the states, injections and readouts of the positions ``gone(position)`` names."""
    for kept in (wave.states, wave.injections, wave.readouts):
        for p in [p for p in kept if gone(p)]:
            del kept[p]


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
            raise ValueError(f"schedule {cfg.schedule} drafts for itself: leave out "
                             "speculative_config")
        device = getattr(vllm_config.device_config, "device_type", "cpu")
        if device != "cpu":  # it reads the paged cache in the CPU backend's layout
            raise ValueError(f"schedule {cfg.schedule} runs on vLLM's CPU build for now, not "
                             f"on {device}")
        vllm_config.cache_config.enable_prefix_caching = False
        scheduler = vllm_config.scheduler_config
        scheduler.enable_chunked_prefill = False
        scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens,
                                               vllm_config.model_config.max_model_len)


class WaveDecoder:
    """A drafting schedule's plan (WFD's wave, or DtV's rounds) for every request of the
    engine's batches, on a model of the plugin (``LoopedForCausalLM``: its parts, its head, its
    caches: the coda's for readouts at R, slot 0, or at d, slot 1)."""

    def __init__(self, model, schedule):
        self.model = model
        self.schedule = schedule
        schedule.check(model.depth)
        self.waves: dict[str, Wave] = {}
        self.paged: PagedKV | None = None
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
        waves = []
        for i, req in enumerate(_BATCH):
            rows = slice(starts[i], starts[i + 1])
            tokens, where = input_ids[rows].tolist(), positions[rows].tolist()
            waves.append(self.begin(req, tokens, where, metadata.block_table[i]))
        self.run(waves)
        for i, wave in enumerate(waves):
            first, last = starts[i], starts[i + 1] - 1
            out[last] = wave.readouts[wave.pending.position]
            for p in range(last - first):  # a prompt's other rows: their readouts at R too
                # (prompt logprobs); with no coda the readout is the state
                out[first + p] = wave.readouts.get(p, wave.states[p])
            self.prune(wave)
        return out

    def prune(self, wave: Wave) -> None:
        """Forget what positions before the newest scheduled one hold: they are committed and
        at R, and nothing the plan does reads them again (their KV stays in the cache)."""
        _forget(wave, lambda p: p < wave.scheduled)

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
        self.settle(wave, position)
        return wave

    def settle(self, wave: Wave, position: int) -> None:
        """``position`` is scheduled now: what it wrote ahead moves into its slot of the paged
        cache."""
        keys = [key for key in wave.ahead if key[1] == position]
        if keys:
            moved = [wave.ahead.pop(key) for key in keys]
            self.paged_kv().write(torch.tensor([layer for layer, _ in keys]),
                                  wave.block_row[None].expand(len(keys), -1),
                                  torch.tensor([p for _, p in keys]),
                                  torch.stack([k for k, _ in moved]),
                                  torch.stack([v for _, v in moved]))

    def run(self, waves: list[Wave]) -> None:
        """Every wave's events up to its next commit (the readout at R that vLLM samples the
        token from), the calls of the same part over several waves run as one: a coda call
        before a prelude call before a block call, so that waves in step share every call of
        a tick."""
        calls = {id(wave): self.next_call(wave) for wave in waves}
        while any(calls.values()):
            kind = next(k for k in ("coda", "prelude", "block")
                        if any(c is not None and c.kind == k for c in calls.values()))
            together = [w for w in waves if calls[id(w)] is not None
                        and calls[id(w)].kind == kind]
            self.call(kind, [(w, calls[id(w)]) for w in together])
            for wave in together:
                calls[id(wave)] = self.next_call(wave)

    def next_call(self, wave: Wave) -> Call | None:
        """The wave's events up to its next call (returned, not run), or None where it commits
        a token (``wave.pending``: vLLM samples it)."""
        reply, wave.pending = wave.pending, None
        while True:
            event = wave.steps.send(reply)
            reply = None
            if isinstance(event, Call):
                return event
            if isinstance(event, Draft):
                token = int(self.model.compute_logits(wave.readouts[event.position][None])
                            .argmax(-1))
                wave.drafts[event.position] = token
                wave.token_at[event.position + 1] = token
            elif isinstance(event, Verify | Bonus):
                wave.pending = event
                return None
            elif isinstance(event, Rollback):
                self.totals["flushed_positions"] += event.flushed
                self.rollback(wave, event.length)
            elif isinstance(event, Check):  # pragma: no cover - no exit rule in this mode
                raise RuntimeError("WFD on vLLM runs without exit rules")

    # -- calls ---------------------------------------------------------------------------------
    def call(self, kind: str, calls: list[tuple[Wave, Call]]) -> None:
        """One call of a part over the rows of several waves (each its positions and depths)."""
        model = self.model
        rows = [(wave, p) for wave, call in calls for p in call.positions]
        depths = [r for _, call in calls for r in call.depths]
        where = torch.tensor([p for _, p in rows])
        if kind == "prelude":
            tokens = torch.tensor([wave.token_at[p] for wave, p in rows])
            layers = [[j] * len(rows) for j in range(model.prelude_layers)]
            e = model.prelude(tokens, where, caches=self.stand_ins(rows, layers))
            states = model.initial_state(where, e)
            for i, (wave, p) in enumerate(rows):
                wave.injections[p], wave.states[p] = e[i], states[i]
            return
        states = torch.stack([wave.states[p] for wave, p in rows])
        if kind == "block":
            self.totals["block_calls"] += 1
            layers = [[model.core_layer_index(r, j) for r in depths]
                      for j in range(model.core_layers)]
            e = torch.stack([wave.injections[p] for wave, p in rows])
            new = model.step(states, e, where, self.stand_ins(rows, layers))
            for i, (wave, p) in enumerate(rows):
                wave.states[p] = new[i]
            return
        slots = [0 if r == model.depth else 1 for r in depths]
        layers = [[model.coda_layer_index(s, j) for s in slots]
                  for j in range(model.arch.coda_layers)]
        out = model.readout(states, where, caches=self.stand_ins(rows, layers))
        for i, (wave, p) in enumerate(rows):
            wave.readouts[p] = out[i]

    def stand_ins(self, rows: list[tuple[Wave, int]], layers: list[list[int]]
                  ) -> list[LayerAttention]:
        """The caches a part's layers attend with in this call: layer j's rows each in the
        cache ``layers[j][row]``."""
        some = self.model.caches[0]
        call = CallKV(self.paged_kv(), rows, some.num_heads, some.num_kv_heads, some.head_size,
                      self.scale, some.isa)
        return [call.layer(own) for own in layers]

    def rollback(self, wave: Wave, length: int) -> None:
        """Positions from ``length`` on are discarded (their KV ahead dropped; what they wrote in
        the paged cache is written again when they re-enter)."""
        for key in [key for key in wave.ahead if key[1] >= length]:
            del wave.ahead[key]
        _forget(wave, lambda p: p >= length)

    # -- KV ------------------------------------------------------------------------------------
    def paged_kv(self) -> PagedKV:
        caches = [cache.kv_cache for cache in self.model.caches]
        if self.paged is None or self.paged.pointer != caches[0].data_ptr():
            self.paged = PagedKV(caches)
        return self.paged
