"""What a stream's requests reserve where an engine admits them: the memory left for KV
beside the weights (on one device, or on placed ones), the KV a token of a sequence holds under
a schedule, and each request's whole KV, refused in one line where one alone cannot fit."""

from __future__ import annotations

from collections.abc import Sequence

from .hardware import HardwareSpec
from .memory import memory_report
from .model import LoopedModelSpec
from .placement import StreamPlacement
from .requests import Request
from .schedules.base import Schedule
from .slots import readout_depths
from .workload import Workload


def kv_budget_bytes(model: LoopedModelSpec, hw: HardwareSpec, dtype: str, depth: int,
                    batch: int, positions_per_call: int, schedule: Schedule | None = None,
                    kv_sharing: int = 0, placement: StreamPlacement | None = None) -> int:
    """The memory left for KV beside the weights and a full batch's activations (placed: as
    much as the fullest device leaves, ``StreamPlacement.kv_budget_bytes``)."""
    probe = Workload(context_length=1, new_tokens=1, batch_size=batch, dtype=dtype, depth=depth)
    memory = memory_report(model, hw, probe, depth=depth, readout_depths=1,
                           positions_per_call=positions_per_call)
    if placement is not None:
        return placement.kv_budget_bytes(
            model, hw, dtype=dtype, depth=depth, readouts=readout_depths(schedule, depth),
            kv_sharing=kv_sharing, activation_bytes=memory.activation_bytes)
    return memory.capacity_bytes - memory.weights_bytes - memory.activation_bytes


def kv_per_token(model: LoopedModelSpec, schedule: Schedule, *, depth: int, dtype: str,
                 kv_sharing: int, readouts: int | None = None) -> int:
    """The KV a token of a sequence holds under ``schedule`` (a coda slot at each readout
    depth: R, and d where it drafts, or ``readouts`` of them)."""
    return model.kv_bytes_per_token(dtype, depth, kv_sharing,
                                    readouts or readout_depths(schedule, depth))


def kv_needs(model: LoopedModelSpec, schedule: Schedule, requests: Sequence[Request], *,
             depth: int, dtype: str, kv_sharing: int, kv_budget: int,
             readouts: int | None = None) -> list[int]:
    """The KV each request reserves when it starts (its prompt, output and the schedule's
    lookahead); refused in one line where one alone needs more than the budget."""
    per_token = kv_per_token(model, schedule, depth=depth, dtype=dtype, kv_sharing=kv_sharing,
                             readouts=readouts)
    needs = [(r.prompt_tokens + r.output_tokens + schedule.lookahead(depth)) * per_token
             for r in requests]
    for i, (r, need) in enumerate(zip(requests, needs, strict=True)):
        if need > kv_budget:
            raise ValueError(f"request {i} ({r.prompt_tokens:,} + {r.output_tokens:,} tokens) "
                             f"needs {need:,} bytes of KV; {kv_budget:,} are free beside the "
                             "weights")
    return needs
