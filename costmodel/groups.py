"""Call groups: the closed forms' currency. Each schedule (costmodel.schedules) gives the
expected calls per committed token under i.i.d. acceptance alpha as a list of call groups (a call
shape and its expected count per token, a count times a basis in alpha), priced by
``cost.call_cost``. The closed forms are the independent check of the event simulator
(simulate.py), which must agree with them on i.i.d. inputs; docs/costmodel.md ("Schedules")
derives each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np

Basis = tuple  # hashable: ("const",), ("dtv", k), ("wfd-ramp",), ("wfd-tail", n, V)


@dataclass(frozen=True)
class CallGroup:
    """Calls of one shape, and how many of them a committed token costs on average:
    ``count * basis_value(basis, alpha)``. Groups of one schedule share few bases, so a sweep
    evaluates each basis once."""

    part: str  # "prelude" | "block" | "coda"
    positions: int  # per sequence
    slots: int  # distinct KV slots read, per sequence
    count: float
    basis: Basis = ("const",)
    # the calls follow a call of another part (a CPU's cache then holds what is left of the
    # whole model's weights, not this part's: cost.call_cost); only block calls ever repeat
    after_other_part: bool = True

    def weight(self, alpha: np.ndarray) -> np.ndarray:
        return self.count * basis_value(self.basis, np.asarray(alpha, dtype=float))


def expected_tokens_per_round(alpha: np.ndarray, block_length: int) -> np.ndarray:
    """DtV: sum_{i=0..k} alpha^i (k drafts, plus the correction or the bonus token)."""
    return _geometric_sum(np.asarray(alpha, dtype=float), block_length + 1)


def _geometric_sum(alpha: np.ndarray, terms: int) -> np.ndarray:
    """sum_{i < terms} alpha^i, by Horner's rule (no powers)."""
    total = np.ones_like(alpha)
    for _ in range(terms - 1):
        total = 1.0 + alpha * total
    return total


def basis_value(basis: Basis, alpha: np.ndarray) -> np.ndarray:
    kind = basis[0]
    if kind == "const":
        return np.ones_like(alpha)
    if kind == "dtv":  # per round, divided by the expected tokens per round
        return 1.0 / expected_tokens_per_round(alpha, basis[1])
    if kind == "wfd-ramp":  # the first R ticks of a wave, once per wave of 1/(1-alpha) tokens
        return 1.0 - alpha
    if kind == "wfd-tail":  # a steady-state tick after n verifies, V verifies per period
        _, verifies_before, verifies_per_period = basis
        return alpha**verifies_before / _geometric_sum(alpha, verifies_per_period)
    raise ValueError(f"unknown basis {basis!r}")


def merge_groups(groups: list[CallGroup]) -> list[CallGroup]:
    """Add up the counts of groups with the same shape and basis."""
    merged: dict[tuple, float] = {}
    for g in groups:
        if g.count:
            key = (g.part, g.positions, g.slots, g.basis, g.after_other_part)
            merged[key] = merged.get(key, 0.0) + g.count
    return [CallGroup(part, n, slots, count, basis, after)
            for (part, n, slots, basis, after), count in merged.items()]


def block_calls_per_token(groups: list[CallGroup], alpha: np.ndarray) -> np.ndarray:
    alpha = np.asarray(alpha, dtype=float)
    return sum(g.weight(alpha) for g in groups if g.part == "block")


def binomial(n: int, p: float) -> np.ndarray:
    """P(X = i), i = 0..n, X ~ Binomial(n, p)."""
    p = min(max(p, 0.0), 1.0)
    i = np.arange(n + 1)
    return _combinations(n) * p**i * (1 - p) ** (n - i)


@cache
def _combinations(n: int) -> np.ndarray:
    return np.array([math.comb(n, i) for i in range(n + 1)], dtype=float)
