"""A request's wave in the vLLM plugin (``wfd.serving.wave``): its plan's events and what the
plan's calls have computed so far, position by position."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from costmodel.plans import Bonus, Call, Check, Verify
from wfd.exits import ExitTracker


@dataclass
class Wave:
    """One request's wave: its plan's events, paused where a token is committed that the wave
    may not commit itself (vLLM samples it), and what the plan's calls have computed so far."""

    steps: object  # the plan's generator
    token_at: dict[int, int]  # committed tokens up to ``committed``, drafts past it
    scheduled: int  # the newest position vLLM has scheduled (it holds a slot)
    block_row: torch.Tensor | None = None  # its row of vLLM's block table
    blocks: list[int] = field(default_factory=list)  # the same, as a list
    committed: int = -1  # the newest position whose token is committed
    limit: int = -1  # the newest position the wave may commit a token at itself
    last: int = sys.maxsize  # the request's last position (its max_tokens, the longest length)
    pending: Verify | Bonus | None = None  # the commit the wave is paused at
    reply: bool | None = None  # what the plan is sent next (a verification's outcome)
    fresh: bool = True  # started this step: its rows are a prompt's
    kept: int = 0  # what positions before it computed is forgotten (vLLM committed them)
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    injections: dict[int, torch.Tensor] = field(default_factory=dict)
    readouts: dict[int, torch.Tensor] = field(default_factory=dict)
    argmaxes: dict[int, int] = field(default_factory=dict)  # each readout's greedy token
    drafts: dict[int, int] = field(default_factory=dict)
    ahead: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)  # (layer, position) -> k, v of a position vLLM has not scheduled
    exits: ExitTracker | None = None  # its exit rule's memory (None: fixed depth)
    held: Call | Check | None = None  # its next call, not run when the last step ended
    prompt_length: int = 0


def kind_of(event: Call | Check) -> str:
    return "check" if isinstance(event, Check) else event.kind


def forget(wave: Wave, gone) -> None:
    """Drop the states, injections and readouts of the positions ``gone(position)`` names."""
    for kept in (wave.states, wave.injections, wave.readouts, wave.argmaxes):
        for p in [p for p in kept if gone(p)]:
            del kept[p]


def between_tokens(wave: Wave, newest: int) -> bool:
    """Whether a rule-free wave holds nothing vLLM's forward would not: paused at the commit of
    ``newest`` (vLLM's sample, its step's one token), nothing committed, in flight or held past
    it, no KV outside the paged cache."""
    return (wave.pending is not None and wave.pending.position == newest - 1 == wave.committed
            and wave.held is None and not wave.ahead and not any(p >= newest for p in wave.states))
