"""Exit rules for adaptive depth, as data: which rule, its threshold, the shallowest exit depth,
and the decision each makes from the quantities a depth trace records.

A rule is checked per position after every step r >= the minimum depth, against what it
remembers from the check before; the first check compares with a fixed start, as the public
Huginn code does. docs/adaptive-depth.md lists the rules, their starts and their defaults: the
public code's, but for ``gate``, whose 1.0 in the released Ouro configs exits only at the last
step (0.5 here, the median of the gate's exit distribution). The decoder (wfd.exits) computes
the quantities with tensors, the simulator reads them from a depth trace (``exit_depth``), and
both decide with ``ExitRule.fires``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .plans import EarlyExit

DEFAULT_THRESHOLDS = {"kl": 1e-3, "entropy-diff": 1e-3, "latent-diff": 0.03,
                      "argmax-stable": 5.0, "gate": 0.5}
READS_READOUTS = frozenset({"kl", "entropy-diff", "argmax-stable"})
ENTROPY_START = 100.0  # nats: the public code's first "previous entropy"
# what later tokens read of an exited token's skipped depths: "latest", its KV at its exit
# depth in every deeper step's slot and a coda slot per readout depth; "reference", the public
# Huginn code's (its default cache): absent from deeper steps' keys, and one coda slot holding
# each token's latest readout (its final one, once it has exited)
EXIT_KV = ("latest", "reference")


def check_exit_kv(kv: str) -> None:
    """An exit KV rule this project knows (EXIT_KV), or a ValueError in one line."""
    if kv not in EXIT_KV:
        raise ValueError(f"the exit KV rule must be {' or '.join(EXIT_KV)}, got {kv!r}")


def reads_every_depth(reads_readouts: bool, coda_attends: bool, kv: str) -> bool:
    """Whether a plan reads a position out at every checked depth: its rule reads readouts or,
    with the latest KV rule, the coda attends (a later position's readout at that depth attends
    over its KV; with the reference's one coda slot, it attends over the final readouts)."""
    return reads_readouts or (coda_attends and kv == "latest")


@dataclass(frozen=True)
class ExitRule:
    name: str
    threshold: float
    min_depth: int = 1
    kv: str = "latest"  # EXIT_KV

    @classmethod
    def parse(cls, text: str, min_depth: int = 1, kv: str = "latest") -> ExitRule:
        """``RULE`` or ``RULE:THRESHOLD``; a bad one raises ValueError in one line."""
        check_exit_kv(kv)
        name, _, value = text.strip().partition(":")
        if name not in DEFAULT_THRESHOLDS:
            raise ValueError(f"unknown exit rule {name!r}; use one of "
                             f"{', '.join(DEFAULT_THRESHOLDS)}")
        threshold = DEFAULT_THRESHOLDS[name]
        if value:
            try:
                threshold = float(value)
            except ValueError:
                raise ValueError(f"exit threshold {value!r} is not a number") from None
        if not (math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"exit threshold must be a positive finite number, got {value}")
        if name == "gate" and threshold > 1:
            raise ValueError(f"the gate's threshold is a probability in (0, 1], got {value}")
        if name == "argmax-stable" and threshold != int(threshold):
            raise ValueError(f"argmax-stable counts checks: a whole number, got {value}")
        if min_depth < 1:
            raise ValueError(f"the minimum exit depth must be at least 1, got {min_depth}")
        return cls(name, threshold, min_depth, kv)

    @property
    def label(self) -> str:
        return f"{self.name}:{self.threshold:g}" + (
            f" from depth {self.min_depth}" if self.min_depth > 1 else "") + (
            ", reference KV" if self.kv == "reference" else "")

    @property
    def reads_readouts(self) -> bool:
        return self.name in READS_READOUTS

    def for_plan(self, coda_attends: bool, depth: int) -> EarlyExit:
        """What a plan needs: its first depth, whether it reads out every checked depth
        (``reads_every_depth``) and the KV rule."""
        if self.min_depth > depth:
            raise ValueError(f"the minimum exit depth must be in 1..{depth}, "
                             f"got {self.min_depth}")
        return EarlyExit(self.min_depth,
                         reads_every_depth(self.reads_readouts, coda_attends, self.kv), self.kv)

    def fires(self, value: float) -> bool:
        """Whether the quantity a check measured exits the position."""
        if self.name in ("argmax-stable", "gate"):  # a count or a probability reaching it
            return value >= self.threshold
        return value < self.threshold

    def exit_depth(self, record, depth: int) -> int:
        """The depth this rule exits a depth trace's position at (R when it never fires), from
        the quantities the record holds (``costmodel.trace.DepthRecord``)."""
        first = self.min_depth
        if self.name == "gate":
            lambdas = _needs(record.exit_lambda, "exit_lambda", self.name)
            survive = 1.0
            for r in range(1, depth):
                survive *= 1.0 - lambdas[r - 1]
                if r >= first and self.fires(1.0 - survive):
                    return r
            return depth
        count = 0
        for r in range(first, depth):
            i = r - 1
            if self.name == "kl":
                kl = _needs(record.kl_start if r == first else record.kl_step, "kl", self.name)
                value = kl[i]
            elif self.name == "entropy-diff":
                entropy = _needs(record.entropy, "entropy", self.name)
                value = abs(entropy[i] - (ENTROPY_START if r == first else entropy[i - 1]))
            elif self.name == "latent-diff":
                value = _needs(record.latent_start if r == first else record.latent_step,
                               "latent change", self.name)[i]
            else:
                same = r > first and record.predictions[i] == record.predictions[i - 1]
                count = count + 1 if same else 0
                value = count
            if self.fires(value):
                return r
        return depth


def _needs(values, what: str, rule: str):
    if values is None:
        raise ValueError(f"this depth trace records no {what}; the {rule} rule needs it "
                         f"(record the trace again with this version)")
    return values


def depth_distribution(depths: list[int]) -> dict[int, float]:
    """Measured exit depths as a distribution (each depth's share, by depth): what
    ``--exit-depths`` and ``Workload.exit_depths`` take."""
    return {r: depths.count(r) / len(depths) for r in sorted(set(depths))}


def parse_exit_depths(text: str, depth: int) -> dict[int, float]:
    """A distribution of exit depths, ``"4:0.3,6:0.5,8:0.2"`` (depth: probability, summing to
    1), each depth in 1..R; ValueError in one line otherwise."""
    dist: dict[int, float] = {}
    for part in text.split(","):
        d, _, p = part.strip().partition(":")
        try:  # float("") refuses a pair without its ":"
            r, prob = int(d), float(p)
        except ValueError:
            raise ValueError(f"exit depths are DEPTH:PROBABILITY pairs, got {part.strip()!r}"
                             ) from None
        check_exit_depths({r: prob}, depth, total=False)
        dist[r] = dist.get(r, 0.0) + prob
    check_exit_depths(dist, depth)
    return dict(sorted(dist.items()))


def check_exit_depths(dist: dict[int, float], depth: int, total: bool = True) -> None:
    """Each exit depth in 1..R with a finite probability >= 0, and (``total``) summing to 1."""
    for r, prob in dist.items():
        if not 1 <= r <= depth:
            raise ValueError(f"exit depth {r} outside 1..{depth}")
        if not (math.isfinite(prob) and prob >= 0):
            raise ValueError(f"probability of exit depth {r} must be >= 0, got {prob:g}")
    if total and abs(sum(dist.values()) - 1) > 1e-6:
        raise ValueError(f"exit depth probabilities sum to {sum(dist.values()):g}, not 1")


@dataclass(frozen=True)
class ForcedExits:
    """Timing on random weights (like forced acceptance): each decoded position exits at a depth
    drawn from ``distribution`` by a draw that depends only on (seed, position), not where a
    rule fires. NOT a real decode; the simulator draws the same depths (``depth_at``)."""

    distribution: tuple[tuple[int, float], ...]  # (depth, probability), depths ascending
    seed: int = 0
    name = "forced"
    reads_readouts = False

    @classmethod
    def parse(cls, text: str, depth: int, seed: int = 0) -> ForcedExits:
        return cls(tuple(parse_exit_depths(text, depth).items()), seed)

    @property
    def min_depth(self) -> int:
        return min(r for r, p in self.distribution if p > 0)

    @property
    def label(self) -> str:
        return "forced " + ",".join(f"{r}:{p:g}" for r, p in self.distribution)

    def for_plan(self, coda_attends: bool, depth: int) -> EarlyExit:
        if max(r for r, _ in self.distribution) > depth:
            raise ValueError(f"forced exit depths must be in 1..{depth}")
        return EarlyExit(self.min_depth, coda_attends)

    def depth_at(self, position: int) -> int:
        u = np.random.default_rng([self.seed, position]).random()
        total = 0.0
        for r, p in self.distribution:
            total += p
            if u < total:
                return r
        return self.distribution[-1][0]


Rule = ExitRule | ForcedExits  # what decides where a position stops
