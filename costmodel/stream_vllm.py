"""vLLM's scheduler, step by step (`costmodel serving --fidelity steps --token-budget N`): a
token budget per engine step shared by decoding and chunked prefills, KV cache taken as tokens
come, and the newest request preempted when it runs out, as vLLM's V1 scheduler does.

Each step: every decoding sequence's token first (one a sequence: its share of a DtV or WFD
round, as in ``costmodel.stream``), then the prefills under way, then requests that have arrived
(first come first served, while there is a place, budget and KV for their first chunk), each a
chunk of its prompt as long as the budget left allows. A step whose sequences' next tokens do
not fit the KV left preempts the sequence admitted last: its KV is freed and it goes back to the
head of the line, to prefill its prompt and the tokens it had made again (vLLM's recompute).

A step costs its decoding sequences' step (``costmodel.stream.step_times``) plus its chunks'
prefill less the one pass over the weights the two share (a prefill of one token); a step of
chunks alone, their prefill and the engine's step; either, the engine's time on prompts
(``EngineOverheads.prompt_s``). A chunk is priced as a prompt of its length: the keys of the
chunks before it, which its attention also reads, are left out. Between arrivals, finishes and
the step at which the KV would run out, a batch that only decodes jumps ahead as
``costmodel.stream`` does.

The plugin's waves (a drafting schedule) end a step at their next commit for a request that
arrives (its arrival flag) or for a prompt in the step (its prefill's R block calls shared
with their calls), so a newcomer waits about a token, as behind AR. But a wave's first step
after its prompt commits nothing until its pipeline fills (``Schedule.fill_ticks``): a WFD
wave's R block calls to its first readout at R, one token committed in them; a DtV wave's first
round, its accepted drafts and bonus token committed at its end. No newcomer shortens that
step; it is priced as the tokens those block calls make in the steady state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .engines import EngineOverheads
from .groups import block_calls_per_token
from .hardware import HardwareSpec
from .model import LoopedModelSpec
from .requests import Request
from .schedules.base import Schedule
from .stream import (
    StreamExits,
    _Prefills,
    decoding_run,
    elapsed_times,
    round_tokens,
    stream_readouts,
)


@dataclass
class _Sequence:
    index: int
    prefill_left: int  # prompt tokens (after a preemption, and its own) still to prefill
    context: int  # tokens whose KV it holds
    left: int  # output tokens still to commit
    started: bool = False  # its first token out
    filling: bool = False  # a wave whose pipeline fills in its next step


class _Scheduler:
    """The line, the running sequences (in the order they were admitted) and their KV."""

    def __init__(self, requests: Sequence[Request], ready: list[float], *, max_batch: int,
                 token_budget: int, kv_budget: int, kv_per_token: int, ahead: int,
                 filled_tokens: int = 0):
        self.requests, self.ready = requests, ready
        # the tokens a wave's first step after its prompt commits (its pipeline filled); 0
        # where its first step is as any other (AR)
        self.filled_tokens = filled_tokens
        self.max_batch, self.token_budget = max_batch, token_budget
        self.kv_budget, self.kv_per_token, self.ahead = kv_budget, kv_per_token, ahead
        self.line: deque[_Sequence] = deque(_Sequence(i, r.prompt_tokens, 0, r.output_tokens)
                                            for i, r in enumerate(requests))
        self.running: list[_Sequence] = []
        self.preemptions = 0

    def held(self) -> int:
        return sum(s.context + self.ahead for s in self.running) * self.kv_per_token

    def schedule(self, now: float) -> tuple[list[_Sequence], list[tuple[_Sequence, int]]]:
        """The step's decoding sequences and prefill chunks: decoding first, then the prefills
        under way, then newcomers, under the token budget; then, while their tokens do not fit
        the KV left, the newest sequence preempted."""
        decoding = [s for s in self.running if not s.prefill_left]
        budget = self.token_budget - len(decoding)
        chunks: list[tuple[_Sequence, int]] = []
        for s in self.running:
            if s.prefill_left and budget > 0:
                chunks.append((s, min(s.prefill_left, budget)))
                budget -= chunks[-1][1]
        line = self.line
        while (line and budget > 0 and len(self.running) < self.max_batch
               and self.ready[line[0].index] <= now
               and self.held() + (min(line[0].prefill_left, budget) + self.ahead)
               * self.kv_per_token <= self.kv_budget):
            self.running.append(line.popleft())
            chunks.append((self.running[-1], min(self.running[-1].prefill_left, budget)))
            budget -= chunks[-1][1]
        while self.running and self.held() + (len(decoding) + sum(
                n for _, n in chunks)) * self.kv_per_token > self.kv_budget:
            s = self.running.pop()  # vLLM's recompute: back to the head of the line
            self.preemptions += 1
            decoding = [d for d in decoding if d is not s]
            chunks = [(c, n) for c, n in chunks if c is not s]
            request = self.requests[s.index]
            s.prefill_left = request.prompt_tokens + request.output_tokens - s.left
            s.context = 0
            line.appendleft(s)
        return decoding, chunks

    def advance(self, decoding, chunks, steps: int, now: float, served: list[dict]) -> None:
        """The step's tokens committed at ``now``: ``steps`` of each decoding sequence's (one
        in a step with chunks; a wave filling its pipeline, ``filled_tokens``), one of a
        finished prefill's (its readout; a wave then fills, where its schedule's does); and
        the sequences with none left finished."""
        for s in decoding:  # beside a prompt a wave stops at its next token
            made = min(self.filled_tokens if s.filling else 1 if chunks else steps, s.left)
            s.left -= made
            s.context += made
            s.filling = False
        for s, n in chunks:
            s.prefill_left -= n
            s.context += n
            if not s.prefill_left:
                s.left -= 1
                s.filling = self.filled_tokens > 0
                if not s.started:
                    s.started = True
                    served[s.index]["first_token_s"] = now
        for s in [s for s in self.running if s.left <= 0 and not s.prefill_left]:
            served[s.index]["finish_s"] = now
            self.running.remove(s)


def serve_vllm_steps(model: LoopedModelSpec, hw: HardwareSpec, schedule: Schedule,
                     requests: Sequence[Request], *, max_batch: int, acceptance: float,
                     depth: int, kv_budget: int, kv_per_token: int, token_budget: int,
                     kv_sharing: int = 0, dtype: str = "bf16",
                     engine: EngineOverheads | None = None, exits: StreamExits | None = None
                     ) -> tuple[list[dict], float, int]:
    """Each request's arrival, first token and finish under vLLM's scheduling, the mean number
    of sequences a step serves, and how many preemptions there were."""
    engine = engine or EngineOverheads()
    elapsed = elapsed_times(model, hw, schedule, requests, acceptance=acceptance, depth=depth,
                            kv_sharing=kv_sharing, dtype=dtype, max_batch=max_batch,
                            engine=engine, exits=exits)
    # the plugin's waves read a prompt out at all its readout depths (d and R; with exits,
    # every depth a token may stop at) in one call
    readouts = stream_readouts(schedule, depth, exits)
    prefill = _Prefills(model, hw, depth, dtype, kv_sharing, readouts, together=True,
                        engine=engine)
    served = [{"arrival_s": r.arrival_s, "output_tokens": r.output_tokens} for r in requests]
    ready = [r.arrival_s + engine.request_s for r in requests]
    fill = _fill(model, schedule, acceptance, depth, kv_sharing)
    engine_line = _Scheduler(requests, ready, max_batch=max_batch, token_budget=token_budget,
                             kv_budget=kv_budget, kv_per_token=kv_per_token,
                             ahead=schedule.lookahead(depth),
                             filled_tokens=round_tokens(schedule, acceptance) if fill else 0)
    line, running = engine_line.line, engine_line.running
    now, busy, weighed, woke = 0.0, 0.0, 0.0, 0.0
    while line or running:
        decoding, chunks = engine_line.schedule(now)
        if not decoding and not chunks:
            if running:  # preempted this step: schedule what is left again
                continue
            if ready[line[0].index] <= now:
                raise ValueError(f"request {line[0].index} needs more KV than the engine has")
            woke, now = engine.wake_after(now, ready[line[0].index]), ready[line[0].index]
            continue
        steps, took = _steps(decoding, chunks, line, ready, now, elapsed, engine_line.held(),
                             kv_budget, kv_per_token, max_batch, len(running), prefill, fill)
        took, woke = took + woke, 0.0  # the first step after an idle runs the slower
        busy, weighed = busy + took, weighed + took * (len(decoding) + len(chunks))
        now += took
        engine_line.advance(decoding, chunks, steps, now, served)
    return served, weighed / busy if busy else 0.0, engine_line.preemptions


def _fill(model, schedule: Schedule, acceptance: float, depth: int, kv_sharing: int) -> int:
    """Tokens whose time a wave's pipeline filling takes: its ``fill_ticks`` block calls at the
    schedule's steady block calls per token (none for AR, whose first step is as any other)."""
    fill_ticks = schedule.fill_ticks(depth)
    if not fill_ticks:
        return 0
    ticks = float(block_calls_per_token(schedule.call_groups(depth, kv_sharing),
                                        np.asarray(acceptance)))
    return max(1, round(fill_ticks / ticks))


def _steps(decoding, chunks, line, ready, now, elapsed, held, kv_budget, kv_per_token,
           max_batch, running, prefill, fill: int) -> tuple[int, float]:
    """(steps to take, their time): with chunks, or a wave filling its pipeline, one step (a
    token of each decoding sequence's; a filling wave's first block calls, ``fill`` tokens'
    time); decoding alone, up to the next finish, the next arrival that could start, or the
    step at which the KV would run out."""
    b = len(decoding)
    context = round(np.mean([s.context for s in decoding])) if b else 0
    times = elapsed[b - 1] if b else None
    if chunks and not b:
        return 1, prefill.step([n for _, n in chunks])
    filling = any(s.filling for s in decoding)
    if chunks or filling:
        steps = min(len(times) - 1 - context, fill if filling else 1)
        took = float(times[context + steps] - times[context])
        return steps, took + (prefill.step([n for _, n in chunks], decoding=True)
                              if chunks else 0.0)
    most = min(min(s.left for s in decoding), max(1, (kv_budget - held) // (b * kv_per_token)))
    arrives = line and running < max_batch and ready[line[0].index] > now
    return decoding_run(times, context, most, ready[line[0].index] - now if arrives else None)
