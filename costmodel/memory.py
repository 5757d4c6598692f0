"""Memory fit: weights + KV cache + decode activations against the device's capacity.

KV: every token of the sequence, and each position the schedule writes ahead of it, holds one
entry per prelude layer, per core layer and slot (R, or s when shared) and per coda layer and
readout depth, exactly as the decoder's static cache (in graphs mode rounded up to a whole
static span). Activations: the widest call's workspace (hidden activations + fp32 logits per
position); prefill is assumed chunked.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from .cost import activation_elements_per_position
from .hardware import HardwareSpec
from .model import LoopedModelSpec
from .slots import static_span
from .specs import DTYPE_BYTES
from .units import format_bytes
from .workload import Workload


class MemoryReport(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    fits: bool
    weights_bytes: int
    kv_bytes: int
    activation_bytes: int
    total_bytes: int
    capacity_bytes: int
    kv_bytes_per_token: int
    # The longest sequence (prompt + generated tokens) whose KV fits beside the weights; 0 when the
    # weights alone do not fit.
    max_context: int
    # The most sequences of this length (KV and decode activations both grow with the batch) that
    # fit beside the weights; 0 when not even one does.
    max_batch: int


def kv_cache_bytes(model: LoopedModelSpec, workload: Workload, *, depth: int,
                   readout_depths: int, lookahead: int = 0, static: bool = False) -> int:
    """Bytes of the static KV cache a run allocates: every position of the sequence and of the
    schedule's lookahead (``Schedule.lookahead``), for each sequence of the batch; in static and
    graphs modes rounded up to whole static spans (the longest span a call may read)."""
    per_token = model.kv_bytes_per_token(workload.dtype, depth, workload.kv_sharing,
                                         readout_depths)
    sequence = workload.context_length + workload.new_tokens + lookahead
    if static:
        sequence = static_span(sequence)
    return workload.batch_size * sequence * per_token


def memory_report(model: LoopedModelSpec, hw: HardwareSpec, workload: Workload, *, depth: int,
                  readout_depths: int, positions_per_call: int, lookahead: int = 0
                  ) -> MemoryReport:
    dtype = workload.dtype
    weights = model.weight_bytes(dtype)
    per_token = model.kv_bytes_per_token(dtype, depth, workload.kv_sharing, readout_depths)
    kv = kv_cache_bytes(model, workload, depth=depth, readout_depths=readout_depths,
                        lookahead=lookahead, static=hw.graphs.cuda_graphs)
    per_position = (activation_elements_per_position(model, model.part("block"))
                    * DTYPE_BYTES[dtype] + 4 * model.vocab_size)
    activations = workload.batch_size * positions_per_call * per_position
    total = weights + kv + activations
    capacity = int(hw.roofline.memory_capacity_bytes)
    room = capacity - weights - activations
    max_context = max(0, room // (workload.batch_size * per_token) - lookahead)
    per_sequence = kv // workload.batch_size + positions_per_call * per_position
    max_batch = max(0, (capacity - weights) // per_sequence)
    return MemoryReport(fits=total <= capacity, weights_bytes=weights, kv_bytes=kv,
                        activation_bytes=activations, total_bytes=total,
                        capacity_bytes=capacity, kv_bytes_per_token=per_token,
                        max_context=max_context, max_batch=max_batch)


class DoesNotFit(ValueError):
    """A workload whose weights, KV and activations exceed the memory (the message says what
    would fit)."""


def does_not_fit(memory: MemoryReport, workload: Workload) -> str:
    """One line for a workload that does not fit: what it needs, and what would fit."""
    batch = workload.batch_size
    sequence = f"{workload.context_length:,} + {workload.new_tokens:,} tokens"
    what = sequence if batch == 1 else f"{batch:,} sequences of {sequence}"
    needs = (f"{what} need {format_bytes(memory.total_bytes)} (weights "
             f"{format_bytes(memory.weights_bytes)}, KV {format_bytes(memory.kv_bytes)}, "
             f"activations {format_bytes(memory.activation_bytes)}) of "
             f"{format_bytes(memory.capacity_bytes)}")
    fits = [f"at most {memory.max_context:,} tokens of sequence"
            + (f" at batch {batch:,}" if batch > 1 else "")] if memory.max_context else []
    if batch > 1 and memory.max_batch:
        fits.append(f"{memory.max_batch:,} sequences of this length")
    if fits:
        return f"{needs}: {' or '.join(fits)} fit"
    if memory.weights_bytes > memory.capacity_bytes:
        return f"{needs}: the weights alone do not fit"
    return f"{needs}: not even one sequence of one token fits"
