"""The engine that runs the calls, as hardware terms: ``wfd`` (this decoder: the hardware as
given) or ``vllm`` (vLLM's AR through the plugin in wfd/serving: CUDA graphs on a GPU, eager on
a CPU, and the kernels its layers launch per layer and per part, counted in its own forward pass,
costmodel/data/vllm_operations.json). DtV and WFD priced on ``vllm`` are what they would cost
run inside it with its kernels: what WFD would add to that engine."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import Field, field_validator

from .hardware import HardwareSpec
from .model import LoopedModelSpec
from .specs import Spec

ENGINES = ("wfd", "vllm")
# the note on vLLM's terms, by mode (--mode eager: vLLM run with enforce_eager)
VLLM_SOURCE = ("vLLM's AR: {mode}, the kernels its layers launch per layer and part "
               "(costmodel/data/vllm_operations.json)")


@functools.cache
def vllm_operations(family: str) -> dict[str, dict[str, int]]:
    path = Path(__file__).resolve().parent / "data" / "vllm_operations.json"
    return json.loads(path.read_text())["families"][family]


def for_engine(engine: str, hw: HardwareSpec, model: LoopedModelSpec) -> HardwareSpec:
    """``hw`` as ``engine`` runs ``model``'s calls."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; use {' or '.join(ENGINES)}")
    if engine == "wfd":
        return hw
    # vLLM replays CUDA graphs on a GPU; on a CPU (its CPU build, enforce_eager) it launches
    # its kernels one by one
    return hw.with_terms(name=f"{hw.name} as vLLM", cuda_graphs=hw.cpu is None,
                         **counted_fields(vllm_operations(model.family)))


def counted_fields(ops: dict[str, dict[str, int]]) -> dict[str, object]:
    """An operation table by class (per ``layer``, and per call of each part outside its
    layers) as the hardware fields a calibration fills its counts into: one attention per layer,
    whatever the slots."""
    extras = {part: ops[part] for part in ("prelude", "block", "coda")}
    return {"kernels_per_layer": sum(ops["layer"].values()), "attention_kernels_per_slot": 0,
            "attention_split_by_slot": False, "layer_operations": ops["layer"],
            "part_extra_kernels": {part: sum(c.values()) for part, c in extras.items()},
            "part_extra_operations": extras}


class IdleWake(Spec):
    """An engine's extra time for a request that reaches it after ``idle_s`` with nothing to
    do: caches, cores and its processes' waits gone cold (measured, not modeled)."""

    idle_s: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    extra_s: Annotated[float, Field(ge=0, allow_inf_nan=False)]


class EngineOverheads(Spec):
    """The engine's own time, beside its model's calls (which the cost model prices): per step
    (scheduling, preparing inputs, sampling), per sequence in a step (its sampling and output:
    detokenizing, streaming), per step that prefills prompts (``prompt_s``: their inputs and
    metadata; the plugin's readouts of them through its Python: the engine is busy for it), and per
    request on its way in and out (``request_s``: parsing, tokenizing, handing it to the engine, its
    first token back to the client: the engine is not). An AR step commits one token of every
    running sequence; a drafting schedule's step (the plugin's WFD and DtV) up to
    ``commit_ahead + 1``, its waves committing greedy tokens ahead of vLLM's sampler
    (``wfd/serving/ahead.py``), and its waves pay ``tick_s`` per tick (a block call with the prelude
    and coda calls beside it) and ``wave_tick_s`` per wave in it: the plugin's bookkeeping and the
    kernels' metadata, which a calibration of ``wfd``'s decoder does not hold.
    ``bench/serving_load.py`` measures vLLM's step, sequence, prompt and request times from lone and
    concurrent requests, ``bench/vllm_peer.py`` the step and tick times of the plugin; ``predict``
    adds a step's share to each token, ``serving`` also a request's to its first, and to the step of
    a request that finds the engine idle its ``wake`` (``wake_after``)."""

    step_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    per_sequence_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    request_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    prompt_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    tick_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    wave_tick_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
    commit_ahead: Annotated[int, Field(ge=0)] = 8
    wake: tuple[IdleWake, ...] = ()  # by idle time, rising

    @field_validator("wake")
    @classmethod
    def _rising(cls, wake: tuple[IdleWake, ...]) -> tuple[IdleWake, ...]:
        idles = [w.idle_s for w in wake]
        if idles != sorted(set(idles)):
            raise ValueError(f"the wake's idle times must rise, got {idles}")
        return wake

    def wake_s(self, idle_s: float) -> float:
        """The engine's extra time after ``idle_s`` idle: ``wake`` interpolated linearly from
        none at no idle, its last beyond its longest idle."""
        if not self.wake or idle_s <= 0:
            return 0.0
        return float(np.interp(idle_s, [0.0, *(w.idle_s for w in self.wake)],
                               [0.0, *(w.extra_s for w in self.wake)]))

    def wake_after(self, idle_since_s: float, arrives_s: float) -> float:
        """The wake a request arriving at ``arrives_s`` meets in an engine idle since
        ``idle_since_s``. The engine takes the request in at once and its first step runs the
        slower by this (cold caches, a sleeping thread), so a request arriving during that step
        waits for the next one, as on the server."""
        return self.wake_s(arrives_s - idle_since_s)

    def tokens_per_step(self, drafts: bool, sequences: int = 1, ticks_per_token: float = 0.0,
                        depth: int = 0) -> float:
        """Tokens of a sequence one engine step commits: AR's one; a drafting schedule's those
        its wave commits ahead and vLLM's sample, and with several sequences (the plugin ends
        such a step after R block calls) R ticks' worth, ``depth / ticks_per_token``, where
        that is fewer."""
        if not drafts:
            return 1.0
        most = self.commit_ahead + 1.0
        if sequences > 1 and ticks_per_token > 0 and depth:
            return min(most, max(1.0, depth / ticks_per_token))
        return most

    def per_tick_s(self, sequences: int) -> float:
        """A drafting schedule's own time per tick of ``sequences`` waves."""
        return self.tick_s + self.wave_tick_s * sequences

    def token_share_s(self, sequences: int, drafts: bool, ticks_per_token: float = 0.0,
                      depth: int = 0) -> float:
        """The engine's own time one sequence's committed token costs in a batch of
        ``sequences``: the batch's share of its steps, and a drafting schedule's ticks."""
        share = sequences * self.per_token_s(sequences, drafts, ticks_per_token, depth)
        return share + (self.per_tick_s(sequences) * ticks_per_token if drafts else 0.0)

    def per_token_s(self, sequences: int, drafts: bool, ticks_per_token: float = 0.0,
                    depth: int = 0) -> float:
        """A token's share of the engine's step (a step of ``sequences`` sequences) and of its
        sequence's share."""
        return (self.step_s / sequences + self.per_sequence_s) / self.tokens_per_step(
            drafts, sequences, ticks_per_token, depth)
