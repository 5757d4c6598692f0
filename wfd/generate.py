"""The decoder: executes a schedule's plan (costmodel.plans) with the model's tensors.

The plan says which call comes next; this module runs it against the KV cache and keeps each
position's latest state and injection in buffers indexed by position (every block call of AR,
DtV and WFD covers a contiguous range of positions, so reading them is a view). Readouts become
drafts, verifications (greedy, speculative sampling, or forced outcomes for timing on random
weights) and committed tokens. With ``depth_trace`` an AR run also reads every position out at
every depth r = 1..R (each depth has its own coda KV slot), giving y(p, r) for the depth trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from costmodel.exits import ExitRule, Rule
from costmodel.plans import Call, Executor, Plan
from costmodel.schedules import AR, Schedule
from costmodel.schedules.ar import ARPlan
from costmodel.slots import in_prefill
from costmodel.trace import CallRecord, DepthRecord

from .cache import KVCache
from .checkpoint import DTYPE_NAMES
from .exits import ExitTracker, depth_signals
from .layers import CallPlan
from .options import GenerationError, RunOptions
from .runtime import Runner, check_prompt, make_cache, runner_for
from .sampling import Proposal, Sampling, Verifier
from .settings import RunSetup, widest_lookahead

__all__ = ["GenerationError", "GenerationResult", "Sampling", "full_forward", "generate",
           "make_cache", "prefill"]


@dataclass
class GenerationResult:
    prompt: list[int]
    tokens: list[int]  # generated token ids (including a final stop token, if any)
    wall_s: float
    schedule: str
    records: list[CallRecord]
    depth_records: list[DepthRecord] = field(default_factory=list)
    stats: dict[str, float | int | None] = field(default_factory=dict)
    cache: KVCache | None = None
    outcomes: dict[int, bool] = field(default_factory=dict)  # position -> draft accepted
    # adaptive drafting: position -> the depth its draft rule fired at, per entry (None: not)
    draft_fired: dict[int, list[int | None]] = field(default_factory=dict)

    def acceptance_sequence(self) -> list[bool]:
        """Draft outcomes by decoded position (as ``costmodel.simulate`` replays them); a
        position whose draft was never verified (a DtV bonus position) counts as accepted."""
        start = len(self.prompt)
        return [self.outcomes.get(start + i, True) for i in range(len(self.tokens))]

    @property
    def block_calls(self) -> int:
        return sum(1 for r in self.records if r.kind == "block")

    def call_stats(self) -> dict[str, float | int]:
        """Counts from the call trace: block calls, position-steps, positions per call."""
        blocks = [len(r.positions) for r in self.records if r.kind == "block"]
        steps = sum(blocks)
        return {"block_calls": len(blocks), "position_steps": steps,
                "positions_per_block_call": steps / len(blocks) if blocks else 0.0,
                "block_calls_per_token": len(blocks) / len(self.tokens),
                "tokens_per_block_call": len(self.tokens) / len(blocks) if blocks else 0.0}


def depth_record(position: int, token: int, readouts: dict[int, torch.Tensor],
                 signals: dict[str, list[float]] | None = None) -> DepthRecord:
    depths = sorted(readouts)
    probs = [torch.softmax(readouts[r].float(), -1) for r in depths]
    return DepthRecord(position=position, token=token,
                       predictions=[int(p.argmax()) for p in probs],
                       top1_prob=[float(p.max()) for p in probs], **(signals or {}))


class Decoder(Executor):
    """Executes a plan's events with the model and commits tokens until ``max_new_tokens`` or a
    stop token."""

    def __init__(self, runner: Runner, prompt: Sequence[int], *, max_new_tokens: int,
                 sampling: Sampling, verifier: Verifier,
                 stop_tokens: frozenset[int] = frozenset(), keep_depths: bool = False,
                 on_rollback: Callable[[KVCache, list[int]], None] | None = None,
                 sequence: int | None = None, exit_rule: Rule | None = None,
                 draft_rule: ExitRule | None = None):
        self.runner, self.prompt = runner, list(prompt)
        self.sequence = sequence  # its region of a batched cache (wfd.batch); None: the cache
        self.max_new_tokens, self.stop_tokens = max_new_tokens, stop_tokens
        self.sampling, self.verifier = sampling, verifier
        self.on_rollback = on_rollback
        cfg, param = runner.model.config, next(runner.model.parameters())
        shape = (runner.cache.max_len, cfg.hidden_size)
        self.states = torch.zeros(shape, dtype=param.dtype, device=param.device)
        self.injections = torch.zeros_like(self.states)
        self.token_at = dict(enumerate(self.prompt))  # the token each position enters with
        self.tokens: list[int] = []
        # position -> logits of its latest readout (from the last prompt position on)
        self.readouts: dict[int, torch.Tensor] = {}
        self.exits = ExitTracker(exit_rule, runner.model) if exit_rule else None
        self.drafts_when = ExitTracker(draft_rule, runner.model) if draft_rule else None
        self.exit_depths: list[int] = []  # the depth of each committed decoded token
        self.drafts: dict[int, Proposal] = {}
        # position -> depth -> logits, from the last prompt position on (depth trace, prefill)
        self.keep_depths = keep_depths
        self.depth_logits: dict[int, dict[int, torch.Tensor]] = {}
        self.depth_states: dict[int, dict[int, torch.Tensor]] = {}  # depth 0: the initial state
        self.depth_records: list[DepthRecord] = []
        self.probe: dict[int, torch.Tensor] | None = None  # depth -> the prompt's greedy readouts
        self.last_depths: dict[int, torch.Tensor] = {}
        self.first_token_at: float | None = None

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new_tokens or bool(
            self.tokens and self.tokens[-1] in self.stop_tokens)

    def call(self, call: Call) -> None:
        self.take(call, self.runner.run(call.kind, list(call.positions), list(call.depths),
                                        self.inputs(call), tokens=self.tokens_in(call),
                                        prefill=in_prefill(call.positions, len(self.prompt))))


    def _rows(self, positions: tuple[int, ...]) -> slice | torch.Tensor:
        first = positions[0]
        if positions == tuple(range(first, first + len(positions))):
            return slice(first, first + len(positions))  # every schedule's calls: a view
        return torch.tensor(positions)

    def tokens_in(self, call: Call) -> list[int] | None:
        """The tokens a prelude call of this sequence embeds (host integers); None otherwise."""
        return [self.token_at[p] for p in call.positions] if call.kind == "prelude" else None

    def inputs(self, call: Call) -> list[torch.Tensor]:
        """The tensors a call of this sequence feeds its part: the states and injections (block)
        or the states (coda) of its positions; none for the prelude (``tokens_in``)."""
        if call.kind == "prelude":
            return []
        rows = self._rows(call.positions)
        if call.kind == "block":
            return [self.states[rows], self.injections[rows]]
        return [self.states[rows]]

    def take(self, call: Call, out: torch.Tensor) -> None:
        """Keep a call's output: injections and initial states, new states, or readouts."""
        positions, depths = list(call.positions), list(call.depths)
        rows = self._rows(call.positions)
        last_prompt = len(self.prompt) - 1
        if call.kind == "prelude":
            self.injections[rows] = out
            self.states[rows] = self.runner.model.initial_state(positions, out)
            if positions[0] > last_prompt:
                for tracker in (self.exits, self.drafts_when):
                    if tracker is not None:
                        tracker.enter(positions, self.states[rows])
        elif call.kind == "block":
            self.states[rows] = out
        else:
            keep = [i for i, p in enumerate(positions) if p >= last_prompt]
            self.readouts.update((positions[i], out[i]) for i in keep)
            if self.probe is not None:
                self.probe[depths[0]] = out.argmax(-1)
            if self.keep_depths:
                for i in keep:
                    self.depth_logits.setdefault(positions[i], {})[depths[i]] = out[i]
        if self.keep_depths and call.kind != "coda" and positions[-1] >= last_prompt:
            # the states a depth trace's exit quantities are measured on (depth 0: initial)
            for p, r in zip(positions, depths, strict=True):
                if p >= last_prompt:
                    self.depth_states.setdefault(p, {})[r] = self.states[p].clone()

    def commit(self, position: int, token: int) -> None:
        if not self.tokens:  # the prefill's readout: the time to the first token
            self.first_token_at = time.perf_counter() - self.runner.capture_s
        self.tokens.append(token)
        self.token_at[position + 1] = token
        self.readouts.pop(position, None)
        for tracker in (self.exits, self.drafts_when):
            if tracker is not None:
                tracker.forget(position)
        if self.exits is not None and position >= len(self.prompt):
            self.exit_depths.append(self.exits.exit_depths.pop(position,
                                                                self.runner.cache.depth))

    def check(self, positions: tuple[int, ...], depths: tuple[int, ...], draft: bool = False
              ) -> set[int]:
        """Ask the exit rule (an exiting position's KV stands in for the depths it skips), or
        with ``draft`` the draft rule."""
        readouts = [self.readouts.get(p) for p in positions]
        tracker = self.drafts_when if draft else self.exits
        exited = tracker.check(positions, depths, self.states[self._rows(positions)], readouts)
        if draft:
            return exited
        for p, r in zip(positions, depths, strict=True):
            if p in exited:
                self.runner.cache.exit(p, r, self.sequence)
        return exited

    def draft(self, position: int, final: bool = False) -> None:
        readout = self.readouts[position]
        # a final readout (the position exited by the draft depth) proposes the token it commits
        draft = Proposal(self.sampling.choose(readout, position), None) if final else \
            self.verifier.draft(readout, position)
        self.drafts[position] = draft
        self.token_at[position + 1] = draft.token

    def verify(self, position: int) -> bool:
        ok, token = self.verifier.verify(self.readouts[position], self.drafts.pop(position),
                                         position)
        self.commit(position, token)
        return ok

    def bonus(self, position: int) -> None:
        token = self.sampling.choose(self.readouts[position], position)
        self.commit(position, token)
        if position >= len(self.prompt):
            self.verifier.bonus += 1
        if self.keep_depths:
            self.last_depths = self.depth_logits.pop(position)
            states = self.depth_states.pop(position)
            signals = depth_signals(states, states[0], self.last_depths, self.runner.model) \
                if len(self.last_depths) == self.runner.cache.depth else None
            self.depth_records.append(depth_record(position, token, self.last_depths, signals))

    def rollback(self, length: int) -> None:
        self.runner.cache.truncate(length, self.sequence)
        if self.on_rollback is not None:
            self.on_rollback(self.runner.cache, self.tokens)


def prefill(runner: Runner, prompt: list[int], depth: int, readout_depths: Sequence[int]
            ) -> dict[int, torch.Tensor]:
    """Run a prompt through every depth (the plans' prefill); the last position's logits at each
    readout depth."""
    plan = ARPlan(len(prompt), depth, coda_attends=runner.model.config.coda_layers > 0,
                  readout_depths=readout_depths)
    decoder = Decoder(runner, prompt, max_new_tokens=1, sampling=Sampling(),
                      verifier=Verifier(Sampling()), keep_depths=True)
    with torch.inference_mode():
        decoder.run(plan.steps())
    return decoder.last_depths


def prompt_acceptance(argmax_by_depth: dict[int, torch.Tensor], depth: int
                      ) -> dict[int, float]:
    """The acceptance each draft depth would have had over the prompt: the agreement of its
    greedy readout with depth R's, estimated as its posterior mean under a uniform prior,
    (agreeing + 1) / (positions + 2). A short prompt whose positions all agree then says 0.9 or
    so, not a certain 1.0, which would send the search to the longest drafts it has (k = 32)."""
    final = argmax_by_depth[depth]
    positions = final.numel()
    return {d: (int((readout == final).sum()) + 1) / (positions + 2)
            for d, readout in sorted(argmax_by_depth.items()) if d < depth}


def choose(model: nn.Module, hardware, acceptance: dict[int, float], prompt_length: int,
           max_new_tokens: int, depth: int, kv_sharing: int):
    """The fastest configuration the cost model predicts for this run (``--schedule auto``)."""
    from costmodel.recommend import recommend
    from costmodel.workload import Workload

    dtype = DTYPE_NAMES[next(model.parameters()).dtype]
    workload = Workload(context_length=prompt_length, new_tokens=max_new_tokens, dtype=dtype,
                        depth=depth, kv_sharing=kv_sharing)
    return recommend(model.config, hardware, acceptance, workload, top=1, quick=True)[0]


def generate(model: nn.Module, prompt: list[int], options: RunOptions | None = None, *,
             depth_trace: bool = False, record: bool = True, hardware=None,
             on_rollback: Callable[[KVCache, list[int]], None] | None = None,
             **settings) -> GenerationResult:
    """Decode ``prompt`` with the run ``options`` (a wfd.options.RunOptions), or the same
    settings as keywords (``schedule="wfd", max_new_tokens=32, ...``) over them. The schedule: a
    registered one, or "auto": the prefill reads every prompt position out at every depth, and
    the cost model with ``hardware`` (a calibrated HardwareSpec) picks the fastest configuration
    for that acceptance by depth (``stats["auto"]`` says which and why). ``depth_trace`` (AR):
    every position read out at every depth. ``mode``: eager, static or graphs
    (wfd.runtime.Runner; graphs on CUDA, eager elsewhere by default; static and graphs reuse the
    shapes earlier runs of the model prepared, wfd.graphs). Forced acceptance replaces
    verification by seeded outcomes (timing on random weights; flagged in the stats). An exit
    rule: adaptive depth, each decoded position stops at the first depth the rule fires
    (costmodel.exits); a draft rule (dtv, wfd): a position drafts at the first depth below the
    draft depth where this (looser) rule fires."""
    options = RunOptions.of(options, settings)
    setup = RunSetup.of(model, options, AR() if options.auto else None)
    depth = setup.depth
    check_prompt(prompt, model.config.vocab_size)
    if options.auto and (hardware is None or depth < 2):
        raise GenerationError("--schedule auto needs a calibration profile and a depth of at "
                              "least 2")
    if depth_trace and setup.exit_rule is not None:  # an exit would cut readouts short
        raise GenerationError("a depth trace is recorded at full depth (every position read out "
                              "at every depth): leave out the exit rule; the trace gives every "
                              "rule's exits (costmodel predict --exit)")
    readouts = range(1, depth + 1) if depth_trace and setup.schedule.name == AR.name else ()
    if options.auto:  # the probe reads the prompt out at the draft depths the quick search tries
        from costmodel.recommend import QUICK_DEPTHS

        readouts = [d for d in QUICK_DEPTHS if d < depth]
    plan = setup.plan(len(prompt), readouts)
    # auto: room for any schedule's lookahead (DtV's k + 1, WFD's W + 1)
    runner = runner_for(model, mode=options.mode, record=record, prompt_len=len(prompt),
                        max_new_tokens=options.max_new_tokens, depth=depth,
                        kv_sharing=options.kv_sharing, readout_depths=plan.readout_depths,
                        lookahead=widest_lookahead(depth) if options.auto else plan.lookahead,
                        exit_kv=setup.exit_kv)
    if options.draft_rule is not None:
        runner.cache.allow_rewrites("coda")
    verifier = setup.verifier(len(prompt), options.max_new_tokens, options.seed)
    decoder = Decoder(runner, prompt, max_new_tokens=options.max_new_tokens,
                      sampling=verifier.sampling, verifier=verifier,
                      stop_tokens=options.stop_tokens, keep_depths=bool(readouts),
                      on_rollback=on_rollback, exit_rule=setup.exit_rule,
                      draft_rule=options.draft_rule)
    start = time.perf_counter()
    chosen, decision = setup.schedule, {}
    with torch.inference_mode():
        if options.auto:
            chosen, plan, decision = _decide(decoder, plan, setup, hardware)
        decoder.run(plan.steps())
    # capture and warm-up are paid once per shape, reported apart (stats["capture_s"])
    wall = time.perf_counter() - start - runner.capture_s
    stats = chosen.run_stats(plan, verifier.stats())
    if decision:
        stats["auto"] = decision
    stats.update(_exit_stats(setup.exit_rule, decoder.exit_depths), **runner.mode_stats())
    stats["kv_bytes_allocated"] = runner.cache.nbytes
    # prefill and first token; the rest of wall_s is the decode proper
    stats["time_to_first_token_s"] = decoder.first_token_at - start
    return GenerationResult(prompt=list(prompt), tokens=decoder.tokens, wall_s=wall,
                            schedule=chosen.name, records=runner.records,
                            depth_records=decoder.depth_records, stats=stats,
                            cache=runner.cache, outcomes=verifier.outcomes,
                            draft_fired=decoder.drafts_when.fired if options.draft_rule else {})


def _decide(decoder: Decoder, probe: Plan, setup: RunSetup, hardware
            ) -> tuple[Schedule, Plan, dict[str, object]]:
    """``--schedule auto``: run the probe's prefill, reading the prompt out at every depth it
    asks, and choose the fastest configuration for the acceptance by depth seen there; the
    chosen schedule, its plan for the rest of the run, and why."""
    decoder.probe = {}
    decoder.run(probe.prefill_steps(every_position=True))
    decided = time.perf_counter()
    acceptance = prompt_acceptance(decoder.probe, setup.depth)
    options, prompt_length = setup.options, len(decoder.prompt)
    choice = choose(decoder.runner.model, hardware, acceptance, prompt_length,
                    options.max_new_tokens, setup.depth, options.kv_sharing)
    decoder.probe = None
    chosen = choice.schedule_spec()
    plan = chosen.plan(prompt_length, setup.depth, coda_attends=setup.coda_attends,
                       prefill=False)
    return chosen, plan, {"choice": choice.label, "flags": choice.flags,
                          "predicted_tokens_per_s": choice.tokens_per_s,
                          "predicted_speedup_vs_ar": choice.speedup_vs_ar,
                          "acceptance_by_depth": acceptance, "hardware": hardware.name,
                          "decide_s": time.perf_counter() - decided}


def _exit_stats(rule: Rule | None, exit_depths: list[int]) -> dict[str, object]:
    """What a run with an exit rule reports of it (nothing without one)."""
    if rule is None:
        return {}
    return {"exit_rule": rule.label, "forced_exits": rule.name == "forced",
            "mean_exit_depth": sum(exit_depths) / max(len(exit_depths), 1),
            "exit_depths": exit_depths}


@torch.inference_mode()
def full_forward(model: nn.Module, tokens: list[int], depth: int | None = None,
                 readout_depths: list[int] | None = None) -> dict[int, torch.Tensor]:
    """Logits of every position at each readout depth from one pass over the whole sequence,
    without a KV cache (the reference computation incremental decoding must reproduce)."""
    depth = depth or model.config.depth
    readout_depths = readout_depths or [depth]
    positions = list(range(len(tokens)))
    device = next(model.parameters()).device
    plan = CallPlan.uncached(positions, model.config, device)
    e = model.prelude(torch.tensor(tokens, device=device), plan, None)
    state = model.initial_state(positions, e)
    out = {}
    for r in range(1, depth + 1):
        state = model.block(state, e, plan, None)
        if r in readout_depths:
            out[r] = model.coda(state, plan, None)
    return out
