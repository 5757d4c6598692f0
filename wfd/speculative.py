"""Draft-then-verify (DtV) and WaveFront Decoding (WFD): the looped model drafts with its own
shallow depth d and verifies at full depth R (DESIGN.md section 3).

DtV(k, d), nested reuse. A round drafts positions t..t+k one after another at depth d (P, d block
calls, a C readout at depth d each; the readouts of t..t+k-1 are the k drafts), continues all k+1
positions from d to R in R - d batched block calls, reads them out at R in one C call, accepts the
longest prefix of matching drafts, commits the correction (or the bonus token when all k match)
and rolls the cache back to the committed prefix.

WFD(d, cap). One tick = one batched block call advancing every in-flight position one step, each
at its own depth and KV slot. After the tick the newest position reaching d is read out (its
draft enters as a new position next tick) and the oldest reaching R is verified, both in one C
call. A rejection commits the correction, flushes every younger position, truncates the cache and
re-enters the correction at depth 0. With a width cap, a draft waits for a free slot.

Verification is greedy equality, or standard speculative sampling (accept with min(1, p/q), else
draw from norm(max(0, p - q))) with draws seeded by (seed, position); or, for timing studies on
random weights, a forced acceptance sequence (not a real decode: flagged in the stats).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .generate import (
    GenerationError,
    GenerationResult,
    Sampling,
    make_cache,
    prefill,
)
from .runtime import Runner

# Independent uniform streams per (seed, position).
DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 1, 2, 3


@dataclass
class Draft:
    token: int
    probs: torch.Tensor | None  # q, the draft distribution (sampling only)


class Verifier:
    """Decides each drafted token: greedy equality, speculative sampling, or forced outcomes."""

    def __init__(self, sampling: Sampling, forced: Sequence[bool] | None):
        self.sampling = sampling
        self.forced = list(forced) if forced is not None else None
        self.verified = 0
        self.outcomes: dict[int, bool] = {}  # position -> whether its draft was accepted
        self.accepted = 0
        self.corrections = 0
        self.bonus = 0

    def draft(self, logits: torch.Tensor, position: int) -> Draft:
        """The token drafted from ``position``'s shallow readout (for position + 1)."""
        if self.sampling.greedy:
            return Draft(int(logits.argmax()), None)
        q = self.sampling.probs(logits)
        return Draft(self.sampling.draw(q, position, DRAFT_STREAM), q)

    def verify(self, target_logits: torch.Tensor, draft: Draft, position: int
               ) -> tuple[bool, int]:
        """(accepted, the token committed for position + 1)."""
        index = self.verified
        self.verified += 1
        if self.forced is not None:
            if index >= len(self.forced):
                raise GenerationError(f"the forced acceptance sequence has {len(self.forced)} "
                                      "entries; the run verified more drafts")
            ok = self.forced[index]
            token = draft.token if ok else int(target_logits.argmax())
        elif self.sampling.greedy:
            token = int(target_logits.argmax())
            ok = token == draft.token
        else:
            p = self.sampling.probs(target_logits)
            q = draft.probs
            ratio = float(p[draft.token]) / max(float(q[draft.token]), 1e-30)
            ok = self.sampling.uniform(position, ACCEPT_STREAM) < min(1.0, ratio)
            if ok:
                token = draft.token
            else:
                residual = torch.clamp(p - q, min=0)
                if float(residual.sum()) <= 0:  # p == q: any draw from p is exact
                    residual = p
                token = self.sampling.draw(residual / residual.sum(), position, RESIDUAL_STREAM)
        self.outcomes[position] = ok
        if ok:
            self.accepted += 1
        else:
            self.corrections += 1
        return ok, token

    def stats(self) -> dict[str, float | int | bool | None]:
        return {
            "acceptance": self.accepted / self.verified if self.verified else None,
            "drafts_verified": self.verified, "accepted": self.accepted,
            "corrections": self.corrections, "bonus": self.bonus,
            "forced_acceptance": self.forced is not None,
        }


class Committer:
    """Collects committed tokens and says when to stop (length or a stop token)."""

    def __init__(self, first: int, max_new_tokens: int, stop_tokens: frozenset[int]):
        self.tokens = [first]
        self.max_new = max_new_tokens
        self.stop_tokens = stop_tokens

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new or self.tokens[-1] in self.stop_tokens

    def commit(self, token: int) -> None:
        if not self.done:
            self.tokens.append(token)


def _check(model: nn.Module, prompt: list[int], max_new_tokens: int, depth: int,
           draft_depth: int) -> None:
    if not prompt:
        raise GenerationError("the prompt is empty")
    if max_new_tokens < 1:
        raise GenerationError(f"max new tokens must be at least 1, got {max_new_tokens}")
    if not 1 <= draft_depth < depth:
        raise GenerationError(f"draft depth must be in 1..{depth - 1} (below R = {depth}), "
                              f"got {draft_depth}")


def _start(model, prompt, max_new_tokens, depth, draft_depth, kv_sharing, lookahead, record,
           sampling):
    """Cache, runner, and the prefill (read out at d and R); returns the first token too."""
    cache = make_cache(model, prompt_len=len(prompt), max_new_tokens=max_new_tokens,
                       depth=depth, kv_sharing=kv_sharing, readout_depths=[draft_depth, depth],
                       lookahead=lookahead)
    runner = Runner(model, cache, record=record)
    logits = prefill(runner, prompt, depth, [draft_depth, depth])
    return runner, sampling.choose(logits[depth], len(prompt) - 1)


def generate_dtv(model: nn.Module, prompt: list[int], *, max_new_tokens: int, block_length: int,
                 draft_depth: int, depth: int | None = None, kv_sharing: int = 0,
                 sampling: Sampling | None = None, stop_tokens: frozenset[int] = frozenset(),
                 forced_acceptance: Sequence[bool] | None = None, record: bool = True
                 ) -> GenerationResult:
    sampling = sampling or Sampling()
    depth = depth or model.config.depth
    k, d = block_length, draft_depth
    _check(model, prompt, max_new_tokens, depth, d)
    if k < 1:
        raise GenerationError(f"block length must be at least 1, got {k}")
    start = time.perf_counter()
    runner, first = _start(model, prompt, max_new_tokens, depth, d, kv_sharing, k + 1, record,
                           sampling)
    verifier = Verifier(sampling, forced_acceptance)
    out = Committer(first, max_new_tokens, stop_tokens)
    cur = len(prompt)  # the position holding the newest committed token
    rounds = 0
    while not out.done:
        rounds += 1
        positions = list(range(cur, cur + k + 1))
        tokens, drafts, states, injections = [out.tokens[-1]], [], [], []
        for pos in positions:  # draft one position at a time at depth d
            e, state = runner.prelude([tokens[-1]], [pos])
            for r in range(1, d + 1):
                state = runner.block(state, e, [pos], [r])
            draft = verifier.draft(runner.coda(state, [pos], [d])[0], pos)
            drafts.append(draft)
            tokens.append(draft.token)
            states.append(state)
            injections.append(e)
        state, e = torch.cat(states), torch.cat(injections)
        for r in range(d + 1, depth + 1):  # nested reuse: continue all positions from d to R
            state = runner.block(state, e, positions, [r] * len(positions))
        targets = runner.coda(state, positions, [depth] * len(positions))
        accepted = 0
        for i in range(k):
            if out.done:
                break
            ok, token = verifier.verify(targets[i], drafts[i], positions[i])
            out.commit(token)
            if not ok:
                break
            accepted += 1
        if accepted == k and not out.done:
            verifier.bonus += 1
            out.commit(sampling.choose(targets[k], positions[k]))
        cur += accepted + 1
        runner.cache.truncate(cur)  # roll back the rejected drafts' KV
    wall = time.perf_counter() - start
    return GenerationResult(prompt=list(prompt), tokens=out.tokens, wall_s=wall, schedule="dtv",
                            records=runner.records, cache=runner.cache,
                            outcomes=verifier.outcomes,
                            stats={**verifier.stats(), "rounds": rounds, "flushed_positions": 0,
                                   "block_length": k, "draft_depth": d})


@dataclass
class InFlight:
    position: int
    depth: int
    draft: Draft | None = None  # the draft this position read out for position + 1


def generate_wfd(model: nn.Module, prompt: list[int], *, max_new_tokens: int, draft_depth: int,
                 width_cap: int | None = None, depth: int | None = None, kv_sharing: int = 0,
                 sampling: Sampling | None = None, stop_tokens: frozenset[int] = frozenset(),
                 forced_acceptance: Sequence[bool] | None = None, record: bool = True,
                 on_flush=None) -> GenerationResult:
    sampling = sampling or Sampling()
    depth = depth or model.config.depth
    d = draft_depth
    _check(model, prompt, max_new_tokens, depth, d)
    if width_cap is not None and width_cap < 1:
        raise GenerationError(f"width cap must be at least 1, got {width_cap}")
    width = -(-depth // d) if width_cap is None else min(width_cap, -(-depth // d))
    start = time.perf_counter()
    runner, first = _start(model, prompt, max_new_tokens, depth, d, kv_sharing, width + 1,
                           record, sampling)
    verifier = Verifier(sampling, forced_acceptance)
    out = Committer(first, max_new_tokens, stop_tokens)
    in_flight: list[InFlight] = []  # oldest first; row i of states/injections is in_flight[i]
    states = injections = None
    waiting: tuple[int, int] | None = (len(prompt), first)  # (position, token) to enter
    ticks = flushed = 0
    while not out.done:
        if waiting is not None and (width_cap is None or len(in_flight) < width_cap):
            pos, token = waiting
            e, state = runner.prelude([token], [pos])
            in_flight.append(InFlight(pos, 0))
            states = state if states is None else torch.cat([states, state])
            injections = e if injections is None else torch.cat([injections, e])
            waiting = None
        for entry in in_flight:
            entry.depth += 1
        states = runner.block(states, injections, [f.position for f in in_flight],
                              [f.depth for f in in_flight])
        ticks += 1
        rows = [i for i in dict.fromkeys((len(in_flight) - 1, 0))  # newest, oldest (maybe one)
                if in_flight[i].depth in (d, depth)]
        if not rows:
            continue
        logits = runner.coda(states[rows], [in_flight[i].position for i in rows],
                             [in_flight[i].depth for i in rows])
        by_depth = {in_flight[i].depth: (in_flight[i], logits[j]) for j, i in enumerate(rows)}
        if d in by_depth:  # draft: the newest position proposes the next token
            newest, draft_logits = by_depth[d]
            newest.draft = verifier.draft(draft_logits, newest.position)
            waiting = (newest.position + 1, newest.draft.token)
        if depth in by_depth:  # verify: the oldest position checks its draft
            oldest, target_logits = by_depth[depth]
            ok, token = verifier.verify(target_logits, oldest.draft, oldest.position)
            out.commit(token)
            in_flight.pop(0)
            states, injections = states[1:], injections[1:]
            if not ok:
                flushed += len(in_flight)
                in_flight.clear()
                states = injections = None
                runner.cache.truncate(oldest.position + 1)
                waiting = (oldest.position + 1, token)  # the correction re-enters at depth 0
                if on_flush is not None:
                    on_flush(runner.cache, out.tokens)
    wall = time.perf_counter() - start
    return GenerationResult(prompt=list(prompt), tokens=out.tokens, wall_s=wall, schedule="wfd",
                            records=runner.records, cache=runner.cache,
                            outcomes=verifier.outcomes,
                            stats={**verifier.stats(), "ticks": ticks,
                                   "flushed_positions": flushed, "draft_depth": d,
                                   "width": width, "width_cap": width_cap})
