"""P/R/C placement: the prelude, the recurrent block and the coda on devices of their own (or
the prelude and coda sharing one), the activations handed from one to the next over a link.

Per committed token, a schedule's calls cost each part its own time, priced by the same call
cost on one device of the hardware (``T_P``, ``T_B``, ``T_C``), and each change of device a
hand-off: the link's latency plus the positions' hidden states over its bandwidth (into the
block from the prelude, into the coda from the block, and the token back to the prelude).

- In order (one group of sequences, nothing to overlap): a token costs
  ``T_P + T_B + T_C + hand-offs``, never less than on one device.
- Pipelined across requests (enough groups of sequences in flight that every device is busy):
  a device's share is the sum of its parts' times, and a token of a group costs the busiest
  device's share: the throughput of the arrangement.
- WFD pipelined across its wave (``lag``): the block's device does not wait for the coda's
  readout and the prelude's embedding of the token a draft enters; the draft enters ``lag``
  ticks later than on one device, so a wave enters a position every d + lag ticks (WFD(d +
  lag)'s ticks, at the acceptance of drafts made at d), and a tick costs the busiest device's
  share of it, hand-offs on the chain beside the block.

Where the parts' times are lopsided (Huginn-3.5B's block runs R = 32 times a token under AR,
its coda once), placement frees little; under WFD every tick reads out, and the coda's
share is large. ``costmodel study placement`` weighs it against replication and tensor
parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from .groups import CallGroup, basis_value
from .hardware import HardwareSpec
from .links import Link, resolve_link
from .model import LoopedModelSpec
from .predict import _Pricer, acceptance_for, decode_keys, predict
from .schedules import SCHEDULES, WFD
from .schedules import get as get_schedule
from .slots import readout_depths, static_span
from .specs import DTYPE_BYTES
from .workload import Workload

Layout = Literal["p|r|c", "pc|r"]
LAYOUTS: dict[str, dict[str, int]] = {  # each part's device
    "p|r|c": {"prelude": 0, "block": 1, "coda": 2}, "pc|r": {"prelude": 0, "block": 1,
                                                            "coda": 0}}


def devices(layout: str) -> list[list[str]]:
    """The parts on each device of ``layout``."""
    loads: dict[int, list[str]] = {}
    for part, device in LAYOUTS[layout].items():
        loads.setdefault(device, []).append(part)
    return list(loads.values())


class Placed(BaseModel):
    """One schedule placed: per committed token of one sequence, at the workload's batch."""

    model_config = ConfigDict(extra="forbid")
    schedule: str
    layout: str
    devices: int
    one_device_latency_s: float  # the schedule on one device (predict's, no engine)
    part_s: dict[str, float]  # each part's time
    handoff_s: float  # the hand-offs between devices
    latency_s: float  # in order: one group of sequences
    pipelined_latency_s: float  # a token of a group when every device is busy (throughput)
    busiest: str  # the device that bounds the pipeline: its parts
    across_wave_latency_s: float | None = None  # WFD pipelined across its wave
    lag_ticks: int | None = None
    device_bytes: dict[str, int] = {}  # each device's weights and KV, by its parts
    fits: bool = True  # every device's within its capacity


def device_kv(model: LoopedModelSpec, layout: str, *, dtype: str, depth: int, readouts: int,
              kv_sharing: int) -> dict[str, tuple[int, int]]:
    """Each device's (weights bytes, KV bytes per token of sequence), by its parts: a part's
    weights (the prelude's with the embedding table, the coda's with the head: a tied one held
    by both where they are apart) and its layers' KV."""
    width = DTYPE_BYTES[dtype]
    per_layer = model.kv_bytes_per_token_per_layer(dtype)
    layers = {"prelude": model.prelude_layers,
              "block": model.core_layers * model.core_slots(depth, kv_sharing),
              "coda": model.coda_layers * readouts}
    out = {}
    for names in devices(layout):
        weights = sum((model.parts[n].weight_params + model.parts[n].lookup_params) * width
                      for n in names)
        if model.tied_head and {"prelude", "coda"} <= set(names):
            weights -= model.embedding_params * width  # one table for both
        out[" + ".join(names)] = (weights, sum(layers[n] for n in names) * per_layer)
    return out


def device_bytes(model: LoopedModelSpec, wl: Workload, layout: str, *, depth: int,
                 readouts: int, lookahead: int, static: bool) -> dict[str, int]:
    """Each device's weights and KV cache for every position of every sequence (decode
    activations, a few megabytes, left out)."""
    sequence = wl.context_length + wl.new_tokens + lookahead
    tokens = wl.batch_size * (static_span(sequence) if static else sequence)
    return {name: weights + per_token * tokens
            for name, (weights, per_token) in device_kv(
                model, layout, dtype=wl.dtype, depth=depth, readouts=readouts,
                kv_sharing=wl.kv_sharing).items()}


def part_times(pricer: _Pricer, groups: list[CallGroup], alpha) -> dict[str, float]:
    """Each part's time per committed token."""
    return {part: float(pricer.per_token([g for g in groups if g.part == part],
                                         alpha)["latency_s"])
            for part in ("prelude", "block", "coda")}


def handoffs(model: LoopedModelSpec, groups: list[CallGroup], alpha, batch: int, dtype: str,
             layout: str, link: Link) -> float:
    """The hand-offs a committed token costs: a prelude call's positions into the block, a coda
    call's out of it, and (the coda on a device of its own) the token back to the prelude."""
    device = LAYOUTS[layout]
    total = 0.0
    for g in groups:
        if g.part == "block":
            continue
        size = g.positions * batch * model.hidden_size * DTYPE_BYTES[dtype]
        calls = g.count * float(basis_value(g.basis, np.asarray(alpha)))
        total += calls * (link.latency_s + size / link.bandwidth_bytes_per_s)
        if g.part == "prelude" and device["coda"] != device["prelude"]:
            total += calls * link.latency_s  # the sampled tokens, a few bytes
    return total


def busiest(parts: dict[str, float], layout: str) -> tuple[float, str]:
    """The busiest device's time and its parts' names."""
    name, time = max(((" + ".join(names), sum(parts[p] for p in names))
                      for names in devices(layout)), key=lambda item: item[1])
    return time, name


def placed_link(hw: HardwareSpec, layout: str, link: str | Link | None) -> Link:
    """The link joining ``layout``'s devices of ``hw`` (None: the hardware's usual one); one
    line where the layout is unknown or ``hw`` is already split for tensor parallelism."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use {' or '.join(LAYOUTS)}")
    if hw.tensor_parallel is not None:
        raise ValueError("a placement's devices each hold whole parts: leave out tensor "
                         "parallelism")
    return resolve_link(hw, link)


def place(model: LoopedModelSpec, hw: HardwareSpec, workload: Workload | dict, *,
          layout: str = "p|r|c", link: str | Link | None = None, lag: int = 1
          ) -> dict[str, Placed]:
    """Each schedule (at the variant ``predict`` finds best on one device) placed by
    ``layout`` over devices of ``hw`` joined by ``link`` (None: the hardware's usual one)."""
    if lag < 1:
        raise ValueError(f"the lag across the wave must be at least 1 tick, got {lag}")
    link = placed_link(hw, layout, link)
    wl = Workload.model_validate(workload)
    # the variants as one device runs them, however much memory that one would need
    roomy = hw.with_terms(memory_capacity_bytes=hw.roofline.memory_capacity_bytes * 64)
    one = predict(model, roomy, wl)
    depth, batch = one.depth, wl.batch_size
    pricer = _Pricer(model, hw, wl.dtype, np.asarray(decode_keys(wl, hw)),
                     np.asarray(float(batch)), None)
    out = {}
    for name in SCHEDULES:
        result = one.schedules[name]
        schedule = get_schedule(name).of(result.draft_depth, result.block_length,
                                         result.width_cap)
        alpha = acceptance_for(model, wl, depth, result.draft_depth) if schedule.drafts \
            else 0.0
        groups = schedule.call_groups(depth, wl.kv_sharing)
        parts = part_times(pricer, groups, alpha)
        moved = handoffs(model, groups, alpha, batch, wl.dtype, layout, link)
        bound, where = busiest(parts, layout)
        memory = device_bytes(model, wl, layout, depth=depth, lookahead=schedule.lookahead(depth),
                              readouts=readout_depths(schedule, depth),
                              static=hw.graphs.cuda_graphs)
        placed = Placed(schedule=name, layout=layout, devices=len(devices(layout)),
                        one_device_latency_s=result.latency_per_token_s, part_s=parts,
                        handoff_s=moved, latency_s=sum(parts.values()) + moved,
                        pipelined_latency_s=bound, busiest=where, device_bytes=memory,
                        fits=max(memory.values()) <= hw.roofline.memory_capacity_bytes)
        if isinstance(schedule, WFD) and result.draft_depth + lag < depth:
            placed.across_wave_latency_s, placed.lag_ticks = _across_wave(
                model, pricer, schedule, depth, alpha, batch, wl, layout, link, lag), lag
        out[name] = placed
    return out


def _across_wave(model, pricer, schedule, depth, alpha, batch, wl, layout, link, lag) -> float:
    """WFD's token when the block's device never waits for the coda and the prelude: WFD(d +
    lag)'s ticks at the acceptance of drafts made at d, each device busy with its share of
    every tick (the coda and prelude's device also with the hand-offs)."""
    lagged = WFD(draft_depth=schedule.draft_depth + lag, width_cap=schedule.width_cap)
    groups = lagged.call_groups(depth, wl.kv_sharing)
    parts = part_times(pricer, groups, alpha)
    moved = handoffs(model, groups, alpha, batch, wl.dtype, layout, link)
    side = {**parts, "coda": parts["coda"] + moved}  # the chain beside the block
    return busiest(side, layout)[0]


@dataclass(frozen=True)
class StreamPlacement:
    """A placement serving a stream (``costmodel serving --placement``): the running sequences
    split into G groups, 1 to as many as there are devices, pipelined, so that in a step every
    group passes every device once. A step (a token of every sequence) then costs the longest
    of: the busiest device's share of every group's calls (G times its share at a group's
    batch), the link's hand-offs of every group, and one group's pass through the parts in
    order (its calls and hand-offs); the engine splits them in the G that makes the step
    shortest (one group, in order, where the block's weights dominate: each group reads them
    again)."""

    layout: str
    link: Link

    def step_s(self, model: LoopedModelSpec, groups: list[CallGroup], alpha: float,
               dtype: str, parts: dict[str, np.ndarray], max_batch: int) -> np.ndarray:
        """A step's time, ``[batch - 1, key]``, from each part's step time at each batch
        (``parts[part][b - 1]``: a group of b sequences; ``costmodel.stream.part_priced``)."""
        width = max(np.shape(t)[-1] for t in parts.values())
        at = {part: np.broadcast_to(t, (max_batch, width)) for part, t in parts.items()}
        steps = np.zeros((max_batch, width))
        for batch in range(1, max_batch + 1):
            options = []
            for flight in range(1, min(len(devices(self.layout)), batch) + 1):
                b = -(-batch // flight)  # the sequences of a group
                own = {part: at[part][b - 1] if part in at else 0.0
                       for part in ("prelude", "block", "coda")}
                moved = handoffs(model, groups, alpha, b, dtype, self.layout, self.link)
                busiest_device = np.max([sum(own[n] for n in names)
                                         for names in devices(self.layout)], axis=0)
                in_order = sum(own.values()) + moved
                options.append(np.maximum(flight * np.maximum(busiest_device, moved),
                                          in_order))
            steps[batch - 1] = np.min(options, axis=0)
        return steps

    def prefill_handoff_s(self, model: LoopedModelSpec, tokens: int, dtype: str) -> float:
        """A prefill's hand-offs: its positions' hidden states into the block and out of it,
        and the first token back to the prelude's device."""
        size = tokens * model.hidden_size * DTYPE_BYTES[dtype]
        return 2 * (self.link.latency_s + size / self.link.bandwidth_bytes_per_s) \
            + self.link.latency_s

    def kv_budget_bytes(self, model: LoopedModelSpec, hw: HardwareSpec, *, dtype: str,
                        depth: int, readouts: int, kv_sharing: int, activation_bytes: int
                        ) -> int:
        """The KV a stream's requests may reserve, in the bytes the model's KV per token counts
        (``kv_bytes_per_token``): the tokens of sequence the fullest device holds beside its
        weights and activations, times that."""
        capacity = hw.roofline.memory_capacity_bytes - activation_bytes
        tokens = min((capacity - weights) / per_token if per_token else np.inf
                     for weights, per_token in device_kv(
                         model, self.layout, dtype=dtype, depth=depth, readouts=readouts,
                         kv_sharing=kv_sharing).values())
        return max(0, int(tokens * model.kv_bytes_per_token(dtype, depth, kv_sharing,
                                                               readouts)))
