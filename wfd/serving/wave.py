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
draft ahead of the request's last block), moved into the paged cache once vLLM allocates it;
attention runs through vLLM's CPU kernels over every layer's cache as one (``wave_kv``).

vLLM internals relied on (docs/serving.md): the forward context's attention metadata (block
table, sequence and query lengths by request), each ``Attention`` layer's ``kv_cache`` tensor in
the CPU backend's layout, and the model runner's ``_model_forward`` (the batch's request ids)
and ``_update_states`` (finished, aborted and preempted requests), which ``hook.install_hooks``
wraps.
"""

from __future__ import annotations

import sys

import torch

from costmodel.plans import Bonus, Call, Check, Draft, Rollback, Verify
from wfd.exits import ExitTracker

from .ahead import proposals
from .exits import EngineExits, WaveExits, request_rule
from .hook import ARRIVALS, BATCH, BOUNDS, FORGOTTEN, REQUESTS, arrival_flag, arrived, install_hooks
from .wave_kv import PagedKV, StepCalls, allocated
from .wave_state import Wave, between_tokens, forget, kind_of


def counters(model) -> dict[str, int]:
    """The wave's counters of a model of the plugin (``LLM.apply_model(counters)``)."""
    return model.wave.counters()


class WaveDecoder:
    """A drafting schedule's plan (WFD's wave, or DtV's rounds) for every request of the
    engine's batches, on a model of the plugin (``LoopedForCausalLM``: its parts, its head, its
    caches: the coda's for readouts at R, slot 0, or at d, slot 1)."""

    def __init__(self, model, schedule):
        self.model = model
        self.schedule = schedule
        schedule.check(model.depth)
        self.waves: dict[str, Wave] = {}
        self.rules: dict[str, object] = {}  # each request's exit rule, worked out once
        self.paged: PagedKV | None = None
        self.calls = StepCalls()  # what a step's calls' attention needs, reused in the step
        # a prompt's readouts below R still to make: (wave, position, depth, state)
        self.deferred: list[tuple[Wave, int, int, torch.Tensor]] = []
        self.scale = model.arch.head_dim ** -0.5
        # each readout depth's coda slot; the engine's exit rule, what a request's is checked by
        self.coda_slot = {r: i for i, r in enumerate(model.readout_depths)}
        self.engine_exits = EngineExits.of(model.config)
        self.exit_work = WaveExits(self)
        self.totals = {"verified": 0, "accepted": 0, "flushed_positions": 0, "block_calls": 0,
                       "readout_calls": 0, "restarts": 0, "decoded_tokens": 0,
                       "decoded_depths": 0, "handed_back": 0}
        install_hooks()
        from vllm.distributed import get_tensor_model_parallel_world_size

        # ranks that each heard of an arrival at a call of their own would part ways
        ARRIVALS[0] = arrival_flag() if get_tensor_model_parallel_world_size() == 1 else None

    def counters(self) -> dict[str, int]:
        """Drafts verified and accepted, positions flushed, block calls (ticks), readout (coda)
        calls, the tokens committed after a prompt with the sum of their depths (exit depths or
        R), waves handed back to vLLM's forward, the rows attended by vLLM's kernel and by
        plain torch, so far."""
        return {**self.totals, **self.calls.rows}

    # -- the engine step -----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata
                ) -> torch.Tensor:
        """Every request's rows of this step: a prompt starts a wave, decoded tokens go on with
        one; each row's hidden state is its readout at R (the last row's is what vLLM samples
        the next token from; the others' verify the tokens committed ahead)."""
        self.calls.clear()  # new blocks come between steps (``runs`` checked the batch's ids)
        out = torch.zeros(len(input_ids), self.model.arch.hidden_size,
                          dtype=self.model.lm_head.weight.dtype)
        starts = metadata.query_start_loc.tolist()
        waves, rows, prompted = [], [], False
        for i, req in enumerate(BATCH):
            rows.append(range(starts[i], starts[i + 1]))
            tokens, where = input_ids[rows[-1]].tolist(), positions[rows[-1]].tolist()
            prompted |= where[0] == 0
            waves.append(self.begin(req, tokens, where, metadata.block_table[i]))
        if prompted:
            # a step with a prompt commits nothing ahead: the newcomer's first token waits for
            # no wave's run ahead (the step ends at every wave's due readout)
            self.stop_ahead(waves)
        self.run(waves)
        for wave, at in zip(waves, rows, strict=True):
            first = wave.scheduled - len(at) + 1
            for row, p in zip(at, range(first, wave.scheduled + 1), strict=True):
                # a prompt's rows carry their readouts at R too (prompt logprobs; with no coda
                # the readout is the state at R); a row past a token vLLM will reject (one the
                # wave did not commit), none: a state there may be shallower than R
                readout = wave.readouts.get(p, wave.states.get(p) if wave.fresh else None)
                if readout is not None:
                    out[row] = readout
            wave.fresh = False
            self.prune(wave, first)
        return out

    def runs(self, metadata) -> bool:
        """Whether this step runs as waves: a drafting schedule's always; AR's (with exits)
        where a request of the step has an exit rule, or a wave it cannot hand back yet.
        Otherwise vLLM's forward at R takes the step: it writes the KV a rule-free request's
        wave would (a token at every depth, read out at R), without the waves' bookkeeping."""
        for req in FORGOTTEN:
            self.waves.pop(req, None)
            self.rules.pop(req, None)
        FORGOTTEN.clear()
        if len(BATCH) != len(metadata.seq_lens):
            raise RuntimeError("WFD on vLLM: the batch's request ids were not published")
        if self.schedule.drafts or any(self.rule(req) is not None for req in BATCH):
            return True
        # rule-free requests only: their waves (joined while a ruled request shared their
        # steps) go back to vLLM's forward once each is between tokens, all of them at once
        starts, lengths = metadata.query_start_loc.tolist(), metadata.seq_lens.tolist()
        waved = [(req, i) for i, req in enumerate(BATCH) if req in self.waves]
        if not all(starts[i + 1] - starts[i] == 1 and between_tokens(
                self.waves[req], lengths[i] - 1) for req, i in waved):
            return True
        for req, _ in waved:
            del self.waves[req]
            self.totals["handed_back"] += 1
        return False

    def rule(self, req: str):
        """The request's exit rule: its own, or the engine's; None: fixed depth."""
        if req not in self.rules:
            state = (REQUESTS[0] or {}).get(req)  # vLLM's: its sampling parameters
            try:
                self.rules[req] = request_rule(
                    self.engine_exits, state.sampling_params.extra_args if state else None)
            except ValueError:  # refused where vLLM admitted it: not reached
                self.rules[req] = self.engine_exits.rule
        return self.rules[req]

    def prune(self, wave: Wave, first: int) -> None:
        """Forget what positions before ``first`` (the step's first, vLLM's newest sample) hold:
        vLLM has committed them, they are at R, and nothing the plan does reads them again
        (their KV stays in the cache). The step's later positions are kept until vLLM says
        how many of them it accepted."""
        forget(wave, lambda p: p < first)
        wave.kept = first

    def begin(self, req: str, tokens: list[int], where: list[int], block_row: torch.Tensor
              ) -> Wave:
        """The request's wave, its newest tokens delivered: a prompt (from position 0) starts
        one (anew after a preemption); decoded tokens (vLLM's sample, then the tokens the wave
        committed ahead, as vLLM scheduled them) go on with one, which restarts from vLLM's
        tokens where they are not the wave's."""
        wave = self.waves.get(req)
        if where[0] == 0:
            wave = self.start(req, tokens)
        elif wave is None and len(tokens) == 1 and self.rule(req) is None:
            wave = self.resume(req, tokens[0], where[0])  # vLLM's forward decoded it so far
        elif wave is None or where != list(range(where[0], where[0] + len(tokens))):
            raise RuntimeError(f"WFD on vLLM decodes whole prompts; request {req} came with "
                               f"positions {where[0]}..{where[-1]} and no wave (leave chunked "
                               "prefill's token budget above the prompts)")
        elif not self.agrees(wave, where[0], tokens[0]):
            self.totals["restarts"] += 1
            wave = self.start(req, [wave.token_at[p] for p in range(where[0])] + tokens)
        else:
            wave.scheduled = where[-1]
        wave.block_row = block_row  # new blocks come as the sequence grows
        wave.blocks = block_row.tolist()
        self.settle(wave)
        ahead, wave.last = BOUNDS.get(req, (0, sys.maxsize))
        wave.limit = min(wave.scheduled + 1 + ahead, wave.last) if ahead else wave.scheduled
        return wave

    def start(self, req: str, tokens: list[int]) -> Wave:
        """A wave whose prompt is ``tokens``, all scheduled."""
        model, attends = self.model, self.model.arch.coda_layers > 0
        state = (REQUESTS[0] or {}).get(req)  # vLLM's: its own prompt
        rule = self.rule(req)
        plan = self.schedule.plan(len(tokens), model.depth, coda_attends=attends,
                                  exits=None if rule is None else rule.for_plan(attends,
                                                                                model.depth))
        # a request's prompt again with its decoded tokens (preempted, or restarted): those
        # stop where they stopped, so the KV is as it was (``Plan.exits_from``)
        own = len(state.prompt_token_ids or ()) if state is not None else 0
        prompt_length = min(own or len(tokens), len(tokens))
        plan.exits_from = prompt_length
        wave = Wave(plan.steps(), dict(enumerate(tokens)), len(tokens) - 1,
                    committed=len(tokens) - 1, prompt_length=prompt_length,
                    exits=None if rule is None else ExitTracker(rule, model))
        self.waves[req] = wave
        return wave

    def resume(self, req: str, token: int, position: int) -> Wave:
        """A wave for a rule-free request that vLLM's forward decoded so far (its KV at every
        depth written), from its newest token on: AR's plan without a prefill."""
        plan = self.schedule.plan(position, self.model.depth, prefill=False,
                                  coda_attends=self.model.arch.coda_layers > 0)
        wave = Wave(plan.steps(), {position: token}, position, committed=position,
                    prompt_length=position, fresh=False)
        self.waves[req] = wave
        return wave

    def agrees(self, wave: Wave, position: int, token: int) -> bool:
        """Whether vLLM's token at ``position`` (the first it scheduled this step) goes on with
        the wave: a token the wave committed ahead (vLLM may have accepted fewer than it
        scheduled: tokens it drafted itself, as its zeros near the longest sequence), or vLLM's
        sample for the commit the wave is paused at."""
        if not wave.kept <= position <= wave.scheduled + 1:
            return False
        if position <= wave.committed:
            return wave.token_at[position] == token
        if wave.pending is None or wave.pending.position != position - 1:
            return False
        self.answer(wave, token)
        return True

    def ahead(self, lengths: list[int], newest: list[int], most: int) -> list[list[int]]:
        """The tokens committed ahead that the step's requests propose (``ahead.proposals``)."""
        return proposals(self.waves, BATCH, lengths, newest, most)

    def settle(self, wave: Wave) -> None:
        """What the wave wrote past its request's blocks moves into the paged cache where vLLM
        has since allocated the block (scheduled or not: a draft's slot there is the wave's)."""
        block = self.paged_kv().block if wave.ahead else 0
        keys = [key for key in wave.ahead if allocated(wave, key[1], block)]
        if keys:
            moved = [wave.ahead.pop(key) for key in keys]
            self.paged_kv().write(torch.tensor([layer for layer, _ in keys]),
                                  wave.block_row[None].expand(len(keys), -1),
                                  torch.tensor([p for _, p in keys]),
                                  torch.stack([k for k, _ in moved]),
                                  torch.stack([v for _, v in moved]))

    def run(self, waves: list[Wave]) -> None:
        """Every wave's events up to a commit it may not make itself (the readout at R that
        vLLM samples from, or past its bound ahead; with several requests, past the step's R
        block calls), the calls of the same part over several waves run as one: exit checks
        before a coda call before a prelude call before a block call, so that waves in step
        share every call of a tick."""
        calls = {id(wave): self.next_call(wave) for wave in waves}
        ticks, stopping = 0, False
        while any(calls.values()):
            kind = next(k for k in ("check", "coda", "prelude", "block")
                        if any(c is not None and kind_of(c) == k for c in calls.values()))
            together = [w for w in waves if calls[id(w)] is not None
                        and kind_of(calls[id(w)]) == kind]
            if kind == "check":
                self.exit_work.check([(w, calls[id(w)]) for w in together])
            elif kind == "coda":
                self.read_out([(w, calls[id(w)]) for w in together])
            else:
                self.call(kind, [(w, calls[id(w)]) for w in together])
            ticks += kind == "block"
            if ticks == self.model.depth and len(waves) > 1 or arrived():
                # several requests: past an AR step's block calls, no more commits ahead, so a
                # request waiting to start waits about as long as behind AR's step; one that
                # arrived mid-step ends it at every wave's due readout, to start in the next
                self.stop_ahead(waves)
                stopping = True
            for wave in together:
                calls[id(wave)] = self.next_call(wave)
            # once every wave has its due readout, one past it waits for the next step where it
            # is; till then it rides along in the others' calls (DtV's rounds out of phase)
            if stopping and not any(calls[id(w)] is not None and w.committed <= w.scheduled
                                    for w in waves):
                for wave in waves:
                    if calls[id(wave)] is not None and wave.committed > wave.scheduled:
                        wave.held, calls[id(wave)] = calls[id(wave)], None
        if self.deferred:  # a prompt's readouts that no later readout of the step took along
            self.read_out([])

    @staticmethod
    def stop_ahead(waves: list[Wave]) -> None:
        """No wave commits further ahead this step: each pauses at its next commit past its due
        readout (``run``: one that has made it stops at its next call, resumed next step)."""
        for wave in waves:
            wave.limit = min(wave.limit, max(wave.scheduled, wave.committed))

    def next_call(self, wave: Wave) -> Call | Check | None:
        """The wave's events up to its next call or exit check (returned, not run), or None
        where it is paused at a commit it may not make itself (``wave.pending``)."""
        if wave.held is not None:  # the call it stopped at when the last step ended
            event, wave.held = wave.held, None
            return event
        while True:
            if wave.pending is not None and not self.commit(wave):
                return None
            if wave.committed >= wave.last:  # the request's last token: nothing follows it
                return None
            event = wave.steps.send(wave.reply)
            wave.reply = None
            if isinstance(event, Call | Check):
                return event
            if isinstance(event, Draft):
                wave.drafts[event.position] = self.argmax(wave, event.position)
                wave.token_at[event.position + 1] = wave.drafts[event.position]
            elif isinstance(event, Verify | Bonus):
                wave.pending = event
            elif isinstance(event, Rollback):
                self.totals["flushed_positions"] += event.flushed
                self.rollback(wave, event.length)

    def commit(self, wave: Wave) -> bool:
        """Commit the token the wave is paused at itself (the argmax of its readout at R), if
        its bound allows."""
        if wave.pending.position + 1 > wave.limit:
            return False
        self.answer(wave, self.argmax(wave, wave.pending.position))
        return True

    def answer(self, wave: Wave, token: int) -> None:
        """The commit the wave is paused at is ``token``: a verification's outcome is sent to
        the plan next."""
        event, wave.pending = wave.pending, None
        if isinstance(event, Verify):
            wave.reply = wave.drafts.pop(event.position) == token
            self.totals["verified"] += 1
            self.totals["accepted"] += wave.reply
        wave.token_at[event.position + 1] = token
        wave.committed = event.position + 1
        if event.position >= wave.prompt_length:  # a decoded token, at its exit depth or R
            depth = self.model.depth if wave.exits is None else wave.exits.exit_depths.pop(
                event.position, self.model.depth)
            self.totals["decoded_tokens"] += 1
            self.totals["decoded_depths"] += depth
        if wave.exits is not None:
            wave.exits.forget(event.position)

    def argmax(self, wave: Wave, position: int) -> int:
        token = wave.argmaxes.get(position)  # made with the readout (``read_out``)
        if token is None:
            token = int(self.model.compute_logits(wave.readouts[position][None]).argmax(-1))
        return token

    # -- calls ---------------------------------------------------------------------------------
    def call(self, kind: str, calls: list[tuple[Wave, Call]]) -> None:
        """One prelude or block call over the rows of several waves (each its positions and
        depths); readouts: ``read_out``."""
        model = self.model
        rows = [(wave, p) for wave, call in calls for p in call.positions]
        depths = [r for _, call in calls for r in call.depths]
        where = torch.tensor([p for _, p in rows])
        if kind == "prelude":
            tokens = torch.tensor([wave.token_at[p] for wave, p in rows])
            layers = [[j] * len(rows) for j in range(model.prelude_layers)]
            e = model.prelude(tokens, where, caches=self.stand_ins(rows, where, layers))
            states = model.initial_state(where, e)
            for i, (wave, p) in enumerate(rows):
                wave.injections[p], wave.states[p] = e[i], states[i]
            for wave, call in calls:  # a decoded position enters its exit rule afresh
                entering = [p for p in call.positions if p >= wave.prompt_length]
                if wave.exits is not None and entering:
                    wave.exits.enter(entering, [wave.states[p] for p in entering])
            return
        self.totals["block_calls"] += 1
        states = torch.stack([wave.states[p] for wave, p in rows])
        layers = [[model.core_layer_index(r, j) for r in depths] for j in range(model.core_layers)]
        e = torch.stack([wave.injections[p] for wave, p in rows])
        new = model.step(states, e, where, self.stand_ins(rows, where, layers))
        for i, (wave, p) in enumerate(rows):
            wave.states[p] = new[i]

    def read_out(self, calls: list[tuple[Wave, Call]]) -> None:
        """Coda calls over the rows of several waves (none: the readouts still waiting). A
        prompt's readouts below R make its coda KV at those depths, which only later positions'
        readouts attend over: they wait, their states kept, and join the step's next readout,
        so a prompt read out at every depth an exit may happen at (or at the draft depth and R)
        is one coda call, not one per depth."""
        model = self.model
        now = []
        for wave, call in calls:
            waits = wave.fresh and call.positions[-1] < wave.prompt_length and max(
                call.depths) < model.depth
            (self.deferred if waits else now).extend(
                (wave, p, r, wave.states[p]) for p, r in zip(call.positions, call.depths,
                                                              strict=True))
        if calls and not now:
            return
        waited = len(self.deferred)  # rows whose readouts only write KV: not kept
        rows, self.deferred = self.deferred + now, []
        self.totals["readout_calls"] += 1
        where = torch.tensor([p for _, p, _, _ in rows])
        layers = [[model.coda_layer_index(self.coda_slot[r], j) for _, _, r, _ in rows]
                  for j in range(model.arch.coda_layers)]
        out = model.readout(torch.stack([state for *_, state in rows]), where,
                            caches=self.stand_ins([(w, p) for w, p, _, _ in rows], where, layers))
        kept = rows[waited:]
        # the greedy tokens a draft or commit may read (the prompt's last position's on): one
        # logits call for the rows, but those a rule's exit check reads (it takes them there)
        read = [i for i, (wave, p, _, _) in enumerate(kept) if p >= wave.prompt_length - 1
                and not (wave.exits is not None and wave.exits.rule.reads_readouts)]
        tokens = self.model.compute_logits(out[waited:][read]).argmax(-1).tolist() \
            if read else []
        for (wave, p, _, _), readout in zip(kept, out[waited:], strict=True):
            wave.readouts[p] = readout
            wave.argmaxes.pop(p, None)
        for i, token in zip(read, tokens, strict=True):
            kept[i][0].argmaxes[kept[i][1]] = token

    def stand_ins(self, rows: list[tuple[Wave, int]], where: torch.Tensor,
                  layers: list[list[int]]) -> list:
        """The caches a part's layers attend with in this call (its rows at positions
        ``where``): layer j's rows each in the cache ``layers[j][row]``; none for a part
        without attention (Ouro's prelude, its embedding)."""
        if not layers:
            return []
        return self.calls.stand_ins(self.paged_kv(), rows, where, layers, self.model.caches[0],
                                    self.scale)

    def rollback(self, wave: Wave, length: int) -> None:
        """Positions from ``length`` on are discarded (their KV ahead dropped; what they wrote in
        the paged cache is written again when they re-enter)."""
        for key in [key for key in wave.ahead if key[1] >= length]:
            del wave.ahead[key]
        forget(wave, lambda p: p >= length)

    # -- KV ------------------------------------------------------------------------------------
    def paged_kv(self) -> PagedKV:
        caches = [cache.kv_cache for cache in self.model.caches]
        if self.paged is None or self.paged.pointer != caches[0].data_ptr():
            self.paged = PagedKV(caches)
        return self.paged
