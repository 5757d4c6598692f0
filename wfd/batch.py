"""Many sequences at once: AR, DtV or WFD over a batch, with continuous batching.

Every sequence runs its own plan against its own region of one KV cache, with its own prompt
length, positions, acceptance and rollbacks; ``costmodel.batching`` decides which sequences'
calls run together (the smallest clock first keeps a schedule's sequences in step) and when a
waiting prompt takes a finished sequence's region. This module runs each merged call with the
model: every sequence's inputs concatenated, one call of the part, the outputs split back, so the
weights are read once for all of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from costmodel.batching import PREFILL, Lane, merged_call, run_batch
from costmodel.schedules import registered
from costmodel.trace import CallRecord

from .generate import Decoder
from .options import GenerationError, RunOptions
from .runtime import Runner, check_prompt, runner_for
from .settings import RunSetup


@dataclass(frozen=True)
class Request:
    index: int  # the prompt's place in its file (results come back by it)
    prompt: list[int]
    max_new_tokens: int
    # its own sampling seed (None: the run's): a prompt sampled many times in one batch
    sampling_seed: int | None = None


@dataclass
class SequenceResult:
    index: int
    prompt: list[int]
    tokens: list[int]
    wall_s: float  # from admission to the last token
    time_to_first_token_s: float
    block_calls: int  # the batch's block calls this sequence took part in
    acceptance: float | None  # accepted / drafts_verified
    forced_acceptance: bool = False
    drafts_verified: int = 0
    accepted: int = 0
    admitted_s: float = 0.0  # from the run's start to the sequence's admission
    # with an exit rule: the depth each decoded token exited at (its own run's: generate's
    # stats["exit_depths"])
    exit_depths: list[int] = field(default_factory=list)


@dataclass
class BatchRun:
    results: list[SequenceResult]  # in the order the sequences finished
    wall_s: float
    prefill_s: float  # the calls of prefills (their own clock)
    records: list[CallRecord]
    stats: dict[str, object] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after each sequence's first (the prefill commits it) over the time outside the
        prefills: the throughput ``costmodel predict --batch`` predicts."""
        decoded = self.tokens - len(self.results)
        return decoded / (self.wall_s - self.prefill_s) if decoded else 0.0


class BatchDecoder(Decoder):
    """A sequence's decoder in a batch: its region, and when it was admitted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.admitted_at = time.perf_counter()
        self.capture_at_admission = self.runner.capture_s

    def result(self, request: Request, block_calls: int) -> SequenceResult:
        stats = self.verifier.stats()
        return SequenceResult(
            index=request.index, prompt=request.prompt, tokens=list(self.tokens),
            wall_s=time.perf_counter() - self.admitted_at - (
                self.runner.capture_s - self.capture_at_admission),
            time_to_first_token_s=(self.first_token_at or 0.0) - self.admitted_at,
            block_calls=block_calls, acceptance=stats.get("acceptance"),
            forced_acceptance=bool(stats.get("forced_acceptance")),
            drafts_verified=stats["drafts_verified"], accepted=stats["accepted"],
            exit_depths=list(self.exit_depths))


def run_together(runner: Runner, lanes: list[Lane]) -> None:
    """One call of one part over the pending positions of ``lanes`` (all at the same clock)."""
    kind, positions, depths, sequences = merged_call(lanes)
    calls = [lane.pending for lane in lanes]
    if len(lanes) == 1:
        inputs = lanes[0].executor.inputs(calls[0])
    else:
        inputs = [torch.cat(parts) for parts in zip(
            *(lane.executor.inputs(c) for lane, c in zip(lanes, calls, strict=True)),
            strict=True)]
    tokens = None if kind != "prelude" else [
        token for lane, c in zip(lanes, calls, strict=True) for token in lane.executor.tokens_in(c)]
    out = runner.run(kind, positions, depths, inputs, sequences, tokens=tokens,
                     prefill=lanes[0].round == PREFILL)
    for lane, call, rows in zip(lanes, calls, out.split([len(c.positions) for c in calls]),
                                strict=True):
        lane.executor.take(call, rows)


def decode_batch(model: nn.Module, requests: Sequence[Request], options: RunOptions | None = None,
                 *, batch_size: int = 8, record: bool = False,
                 on_result: Callable[[SequenceResult], None] | None = None,
                 on_call: Callable[[], None] | None = None,
                 arrivals: Sequence[float] | None = None, **settings) -> BatchRun:
    """Decode ``requests`` with ``batch_size`` sequences in flight (fewer if fewer remain), with
    the run ``options`` or the same settings as keywords (wfd.generate.generate), each request
    with its own number of new tokens. Each sequence's tokens are its own batch-1 run's (same
    plan, sampling seed and forced outcomes, seeded by the seed + its index). ``on_result`` gets
    each sequence as it ends; ``on_call`` is called after every call (progress). The mode: eager
    by default, on any device (wfd.runtime.Runner). An exit rule: adaptive depth per position of
    each sequence: a position that exits leaves the calls while the others go on.
    ``arrivals``: seconds from the run's start at which each request arrives (a stream:
    bench/batch_load.py); a request is admitted no sooner, in order, and an idle batch waits
    for the next."""
    options = RunOptions.of(options, settings)
    if options.auto:
        raise GenerationError(f"a batch decodes with {registered()}, not 'auto'")
    if batch_size < 1:
        raise GenerationError(f"batch size must be at least 1, got {batch_size}")
    if not requests:
        raise GenerationError("no prompts to decode")
    if arrivals is not None and (len(arrivals) != len(requests)
                                 or list(arrivals) != sorted(arrivals)):
        raise GenerationError("arrivals: one time per request, in order")
    for req in requests:
        check_prompt(req.prompt, model.config.vocab_size, f"prompt {req.index}")
        if req.max_new_tokens < 1:
            raise GenerationError(f"prompt {req.index}: max new tokens must be at least 1, "
                                  f"got {req.max_new_tokens}")
    setup = RunSetup.of(model, options)
    probe = setup.plan(len(requests[0].prompt))
    regions = min(batch_size, len(requests))
    longest = max(requests, key=lambda req: len(req.prompt) + req.max_new_tokens)
    # eager unless asked: a batch's calls mix sequences' slots in ever new combinations, so
    # captured shapes would rarely be replayed
    runner = runner_for(model, mode=options.mode or "eager", record=record,
                        prompt_len=len(longest.prompt), max_new_tokens=longest.max_new_tokens,
                        depth=setup.depth, kv_sharing=options.kv_sharing,
                        readout_depths=probe.readout_depths, lookahead=probe.lookahead,
                        sequences=regions, exit_kv=setup.exit_kv)
    if options.draft_rule is not None:
        runner.cache.allow_rewrites("coda")
    return _run(runner, setup, requests, probe, regions, on_result, on_call, arrivals)


def arrived(requests: Sequence[Request], arrivals: Sequence[float] | None, start_s: float):
    """``run_batch``'s admission hook for requests arriving at ``arrivals`` (None: every one
    at once) on the clock that starts at ``start_s``: a request may start once its time has
    passed; with nothing running, the batch sleeps until it has."""
    if arrivals is None:
        return None
    due = {id(req): at for req, at in zip(requests, arrivals, strict=True)}

    def admit(req: Request, lanes: list[Lane]) -> bool:
        wait = start_s + due[id(req)] - time.perf_counter()
        if wait > 0 and not lanes:
            time.sleep(wait)
            return True
        return wait <= 0

    return admit


def _run(runner: Runner, setup: RunSetup, requests: Sequence[Request], probe, regions: int,
         on_result: Callable[[SequenceResult], None] | None,
         on_call: Callable[[], None] | None, arrivals: Sequence[float] | None) -> BatchRun:
    """``decode_batch`` once its runner is ready: the continuous batching loop and its
    report."""
    cache, options = runner.cache, setup.options

    def begin(req: Request, region: int):
        verifier = setup.verifier(len(req.prompt), req.max_new_tokens,
                                  options.seed + req.index, req.sampling_seed)
        decoder = BatchDecoder(runner, req.prompt, max_new_tokens=req.max_new_tokens,
                               sampling=verifier.sampling, verifier=verifier,
                               stop_tokens=options.stop_tokens, sequence=region,
                               exit_rule=setup.exit_rule, draft_rule=options.draft_rule)
        return decoder, setup.plan(len(req.prompt))

    results: list[SequenceResult] = []
    prefill_s, blocks = 0.0, []  # blocks: positions per block call

    def run_call(lanes: list[Lane]) -> None:
        nonlocal prefill_s
        t0, capture0 = time.perf_counter(), runner.capture_s
        run_together(runner, lanes)
        if lanes[0].round == PREFILL:
            prefill_s += time.perf_counter() - t0 - (runner.capture_s - capture0)
        if lanes[0].pending.kind == "block":
            blocks.append(sum(len(lane.pending.positions) for lane in lanes))
        if on_call is not None:
            on_call()

    def finish(lane: Lane) -> None:
        cache.release(lane.region)
        results.append(lane.executor.result(lane.job, lane.block_calls))
        results[-1].admitted_s = lane.executor.admitted_at - start_s
        if on_result is not None:
            on_result(results[-1])

    start_s = time.perf_counter()
    with torch.inference_mode():
        run_batch(requests, regions, begin, run_call, finish,
                  arrived(requests, arrivals, start_s))
    wall = time.perf_counter() - start_s - runner.capture_s
    stats: dict[str, object] = {
        "schedule": setup.schedule.name, "batch_size": regions, "depth": setup.depth,
        "kv_bytes_allocated": cache.nbytes, "lookahead": probe.lookahead,
        "sequence_length": cache.max_len - probe.lookahead, **runner.mode_stats()}
    stats.update(setup.schedule.batch_stats(probe))
    stats.update(block_calls=len(blocks), positions_per_block_call=sum(blocks) / len(blocks))
    if setup.exit_rule is not None:
        depths = [r for result in results for r in result.exit_depths]
        stats.update(exit_rule=setup.exit_rule.label,
                     mean_exit_depth=sum(depths) / max(len(depths), 1))
    return BatchRun(results=results, wall_s=wall, prefill_s=prefill_s, records=runner.records,
                    stats=stats)
