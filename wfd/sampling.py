"""Sampling and verification: the token a readout commits, the draft it proposes, and the
decision on each draft (greedy equality, speculative sampling, or forced outcomes for timing).

Speculative sampling: accept a draft with min(1, p/q), else draw from norm(max(0, p - q)); every
draw is seeded by (seed, position), so a schedule's tokens do not depend on the order its calls
run in, and the committed tokens are distributed as AR's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .options import SEEDS, GenerationError


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < float("inf"):  # NaN too: it sampled token 255 alone
            raise GenerationError(f"temperature must be a finite number >= 0, got "
                                  f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < SEEDS:
            raise GenerationError(f"the seed must be in 0..{SEEDS - 1}, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampling draws from: softmax(logits / T), cut to the top-p nucleus;
        fp32 on the CPU so that draws do not depend on the device."""
        probs = torch.softmax(logits.detach().float().cpu() / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < self.top_p
            keep[..., 0] = True
            mask = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep)
            probs = torch.where(mask, probs, 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def uniform(self, position: int, stream: int = 0) -> float:
        """A uniform draw that depends only on (seed, position, stream)."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + position) * 8 + stream)
        return float(torch.rand((), generator=gen))

    def draw(self, probs: torch.Tensor, position: int, stream: int = 0) -> int:
        """Inverse-CDF draw from probs with the (seed, position, stream) uniform."""
        cdf = probs.cumsum(-1)
        u = self.uniform(position, stream) * float(cdf[-1])
        return int(min(torch.searchsorted(cdf, torch.tensor([u])).item(), probs.numel() - 1))

    def choose(self, logits: torch.Tensor, position: int) -> int:
        """The token committed from ``position``'s logits."""
        if self.greedy:
            return int(logits.argmax())
        return self.draw(self.probs(logits), position)


# Independent uniform streams per (seed, position).
DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 1, 2, 3


@dataclass
class Proposal:
    """A drafted token, and the distribution it was drawn from (what verification weighs it
    against; costmodel.plans.Draft is the plan's event that asks for one)."""

    token: int
    probs: torch.Tensor | None  # q, the draft distribution (sampling only)


class Verifier:
    """Decides each drafted token: greedy equality, speculative sampling, or forced outcomes."""

    def __init__(self, sampling: Sampling, forced: Sequence[bool] | None = None,
                 first_position: int = 0):
        """``forced[i]``: the outcome of the draft made from position ``first_position + i``
        (the simulator's acceptance sequence, so both replay the same outcomes)."""
        self.sampling = sampling
        self.forced = list(forced) if forced is not None else None
        self.first_position = first_position
        self.verified = 0
        self.outcomes: dict[int, bool] = {}  # position -> whether its draft was accepted
        self.accepted = self.corrections = self.bonus = 0

    def draft(self, logits: torch.Tensor, position: int) -> Proposal:
        """The token drafted from ``position``'s shallow readout (for position + 1)."""
        if self.sampling.greedy:
            return Proposal(int(logits.argmax()), None)
        q = self.sampling.probs(logits)
        return Proposal(self.sampling.draw(q, position, DRAFT_STREAM), q)

    def verify(self, target_logits: torch.Tensor, draft: Proposal, position: int
               ) -> tuple[bool, int]:
        """(accepted, the token committed for position + 1)."""
        self.verified += 1
        if self.forced is not None:
            index = position - self.first_position
            if not 0 <= index < len(self.forced):
                raise GenerationError(f"the forced acceptance sequence has {len(self.forced)} "
                                      f"entries; the run verified position {position}")
            ok = bool(self.forced[index])
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
        self.accepted += ok
        self.corrections += not ok
        return ok, token

    def stats(self) -> dict[str, float | int | bool | None]:
        return {
            "acceptance": self.accepted / self.verified if self.verified else None,
            "drafts_verified": self.verified, "accepted": self.accepted,
            "corrections": self.corrections, "bonus": self.bonus,
            "forced_acceptance": self.forced is not None,
        }


