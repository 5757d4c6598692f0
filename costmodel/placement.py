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
from .slots import static_span
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


def device_bytes(model: LoopedModelSpec, wl: Workload, layout: str, *, depth: int,
                 readouts: int, lookahead: int, static: bool) -> dict[str, int]:
    """Each device's weights and KV cache, by its parts: a part's weights (the prelude's with
    the embedding table, the coda's with the head: a tied one held by both where they are
    apart) and its layers' KV for every position of every sequence (decode activations, a few
    megabytes, left out)."""
    width = DTYPE_BYTES[wl.dtype]
    sequence = wl.context_length + wl.new_tokens + lookahead
    tokens = wl.batch_size * (static_span(sequence) if static else sequence)
    per_layer = model.kv_bytes_per_token_per_layer(wl.dtype) * tokens
    layers = {"prelude": model.prelude_layers,
              "block": model.core_layers * model.core_slots(depth, wl.kv_sharing),
              "coda": model.coda_layers * readouts}
    own = {name: (part.weight_params + part.lookup_params) * width + layers[name] * per_layer
           for name, part in model.parts.items()}
    out = {}
    for names in devices(layout):
        total = sum(own[name] for name in names)
        if model.tied_head and {"prelude", "coda"} <= set(names):
            total -= model.embedding_params * width  # one table for both
        out[" + ".join(names)] = total
    return out


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


def place(model: LoopedModelSpec, hw: HardwareSpec, workload: Workload | dict, *,
          layout: str = "p|r|c", link: str | Link | None = None, lag: int = 1
          ) -> dict[str, Placed]:
    """Each schedule (at the variant ``predict`` finds best on one device) placed by
    ``layout`` over devices of ``hw`` joined by ``link`` (None: the hardware's usual one)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use {' or '.join(LAYOUTS)}")
    if lag < 1:
        raise ValueError(f"the lag across the wave must be at least 1 tick, got {lag}")
    if hw.tensor_parallel is not None:
        raise ValueError("a placement's devices each hold whole parts: leave out tensor "
                         "parallelism")
    link = resolve_link(hw, link)
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
                              readouts=2 if schedule.drafts else 1,
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
