"""Pricing adaptive depth (early exit): the exit depths each position stops at, drawn from a
distribution (``--exit-depths``, with acceptance alpha for drafts that go on) or from a depth
trace under a rule (``--depth-trace FILE --exit RULE``: each position's exit depth and whether its
draft equals its final readout, together), as the schedules' exit-aware closed forms read them
(``Schedule.exit_groups``: AR's and DtV's, where a DtV continuation call at depth r holds
Binomial(k + 1, P(e >= r)) positions). A wave's width and flushes depend on the whole sequence of
exits, so WFD is simulated call by call with the decoder's plan (``simulate.simulate_exits``).
docs/adaptive-depth.md says more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .exits import ExitRule, check_exit_depths, reads_every_depth
from .model import LoopedModelSpec
from .plans import EarlyExit
from .workload import Workload


@dataclass(frozen=True)
class ExitProfile:
    """Exit depths as the pricing reads them: the probability of each depth 1..R, whether a
    draft at d equals its position's final token (per depth a position exits at: P(accept | e)),
    and what the plan needs of the rule."""

    depth: int
    probs: tuple[float, ...]  # P(e = r), r = 1..R
    accept_given_exit: tuple[float, ...]  # P(y(p, d) == y(p, e) | e = r), r = 1..R
    exits: EarlyExit
    # (exit depth, accepted) per position, for simulation; empty: draw from the probabilities
    pairs: tuple[tuple[int, bool], ...] = ()

    @classmethod
    def from_distribution(cls, dist: dict[int, float], depth: int, acceptance: float,
                          every_depth: bool, kv: str = "latest") -> ExitProfile:
        probs = tuple(dist.get(r, 0.0) for r in range(1, depth + 1))
        first = min(r for r, p in dist.items() if p > 0)
        return cls(depth, probs, (acceptance,) * depth, EarlyExit(first, every_depth, kv))

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[int, bool]], depth: int, exits: EarlyExit
                   ) -> ExitProfile:
        if not pairs:
            raise ValueError("no decoded positions to read exit depths from")
        counts = np.zeros(depth)
        accepted = np.zeros(depth)
        for e, ok in pairs:
            counts[e - 1] += 1
            accepted[e - 1] += ok
        probs = counts / counts.sum()
        given = np.divide(accepted, counts, out=np.ones(depth), where=counts > 0)
        return cls(depth, tuple(probs), tuple(given), exits, tuple(pairs))

    @property
    def mean_depth(self) -> float:
        return sum(r * p for r, p in enumerate(self.probs, start=1))

    @cached_property
    def _tails(self) -> tuple[float, ...]:
        return tuple(float(t) for t in np.cumsum(self.probs[::-1])[::-1]) + (0.0,)

    def at_least(self, r: int) -> float:
        """P(e >= r)."""
        return self._tails[r - 1]

    def acceptance(self, draft_depth: int) -> float:
        """P(a position's draft is its token): it exits by d, or its draft equals its final."""
        return sum(p * (1.0 if r <= draft_depth else a) for r, (p, a) in enumerate(
            zip(self.probs, self.accept_given_exit, strict=True), start=1))

    def draft_acceptance(self, draft_depth: int) -> float | None:
        """P(draft accepted | the position goes past d): what the verifier sees."""
        past = self.at_least(draft_depth + 1)
        if past == 0:
            return None
        return sum(p * a for p, a in zip(self.probs[draft_depth:],
                                         self.accept_given_exit[draft_depth:], strict=True)
                   ) / past

    def draws(self, count: int, seed: int) -> tuple[list[int], list[bool]]:
        """Exit depths and draft outcomes for ``count`` decoded positions: the recorded pairs
        drawn with replacement, or independent draws from the probabilities."""
        rng = np.random.default_rng(seed)
        if self.pairs:
            picked = rng.integers(0, len(self.pairs), count)
            return ([self.pairs[i][0] for i in picked], [self.pairs[i][1] for i in picked])
        depths = rng.choice(np.arange(1, self.depth + 1), size=count, p=np.asarray(self.probs))
        accept = rng.random(count) < np.asarray(self.accept_given_exit)[depths - 1]
        return [int(e) for e in depths], [bool(a) for a in accept]

    def reads(self, schedule):
        """Whether the schedule's plan (a costmodel.schedules.Schedule's) reads a position still
        going out after its step r (before knowing whether it exits there): the plan's own rule
        (``Plan.read_at``)."""
        return schedule.plan(1, self.depth, coda_attends=False, exits=self.exits).read_at


def exit_profile(model: LoopedModelSpec, workload: Workload, depth: int, draft_depth: int
                 ) -> ExitProfile | None:
    """The workload's exit depths (None at fixed depth), checked against R."""
    if not workload.adaptive:
        return None
    coda_attends = model.coda_layers > 0
    kv = workload.exit_kv
    rule = ExitRule.parse(workload.exit_rule, workload.exit_min_depth, kv) \
        if workload.exit_rule else None
    if rule is not None and rule.name == "gate" and not model.exit_gate:
        raise ValueError(f"the gate rule needs a model with an exit gate; {model.name} has none")
    if workload.exit_depths is not None:
        dist = workload.exit_depths
        check_exit_depths(dist, depth)
        alpha = model.default_acceptance if workload.acceptance is None else workload.acceptance
        # without a rule, depths known without readouts (as forced exits are)
        every = rule.for_plan(coda_attends, depth).every_depth if rule else \
            reads_every_depth(False, coda_attends, kv)
        return ExitProfile.from_distribution(dist, depth, alpha, every, kv)
    from .trace import read_depth_trace

    trace = read_depth_trace(workload.depth_trace)
    if trace.header.depth != depth:
        raise ValueError(f"the depth trace was recorded at R = {trace.header.depth}, the "
                         f"prediction is for R = {depth}")
    return ExitProfile.from_pairs(trace.exit_pairs(rule, draft_depth), depth,
                                  rule.for_plan(coda_attends, depth))
