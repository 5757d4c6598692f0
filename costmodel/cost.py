"""The cost of one call of a part (P, B or C) over n positions.

    t = t_host + layers * t_layer + n_kernels * t_launch
        + max(bytes / BW_eff, matmul flops / F_eff + attention flops / F_attention_eff)

(or the p-norm of the two where ``HardwareSpec.roofline_exponent`` is set: a CPU does not fully
overlap memory and compute near the ridge)
on a device that runs its own kernels (a CPU). On a GPU, launches are asynchronous: the host's
overhead overlaps the device's work and a call costs the larger of the two (``overhead_overlaps``);
the breakdown then shows the exposed overhead, the part not hidden behind the device.

bytes = the part's weights (once per call, or more often for few rows on some CPU libraries: see
``HardwareSpec.blocked_gemm_rows``; from the last-level cache when the part's weights fit in half
of it, the rest of the loop streaming through the other half, and then once per row of a vector
product) + the KV read (for each distinct slot, its context x KV bytes per token) + the KV
written + activations. flops = 2 * matmul params * n + attention (4 * context * heads * head_dim
per position per layer); a CPU library that runs products over few rows on one thread reaches
only its share of the peak there (``HardwareSpec.threaded_gemm_rows``). The overhead adds a
fixed latency per blocked matrix product (``HardwareSpec.blocked_gemm_latency_s``).

Every argument may be a numpy array (they broadcast), so one formula serves single predictions,
the event simulator and sweeps of 10^5 points.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .specs import DTYPE_BYTES, HardwareSpec, LoopedModelSpec, PartSpec

ArrayLike = float | np.ndarray


@dataclass(frozen=True)
class CallCost:
    """Bytes, flops, kernels and the time they cost, split into the four terms of the roofline.

    The memory time is attributed to weights (weights and activations) and to KV; when the call is
    compute-bound the whole roofline term is compute. ``overhead_s`` is the exposed overhead.
    """

    weight_bytes: ArrayLike
    kv_read_bytes: ArrayLike
    kv_write_bytes: ArrayLike
    activation_bytes: ArrayLike
    flops: ArrayLike
    kernels: ArrayLike
    weights_s: ArrayLike
    kv_s: ArrayLike
    compute_s: ArrayLike
    overhead_s: ArrayLike
    ideal_s: ArrayLike  # the roofline bound at peak bandwidth and peak flops, no overhead

    @property
    def time_s(self) -> ArrayLike:
        return self.weights_s + self.kv_s + self.compute_s + self.overhead_s

    @property
    def bytes(self) -> ArrayLike:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes


def activation_elements_per_position(model: LoopedModelSpec, part: PartSpec) -> int:
    """Activation elements one position moves through memory in a call of ``part``: per layer
    the inputs and outputs of the qkv, output, gate/up and down projections, plus the call's input
    and output hidden vectors. (The coda's fp32 logits are added by the caller.)"""
    h, i = model.hidden_size, model.mlp_size
    per_layer = (h + 3 * h) + (2 * h) + (h + 2 * i) + (i + h)
    return part.layers * per_layer + 2 * h


def call_cost(
    model: LoopedModelSpec,
    hw: HardwareSpec,
    part: PartSpec,
    dtype: str,
    n_positions: ArrayLike,
    n_slots: ArrayLike,
    context_sum_positions: ArrayLike,
    context_sum_slots: ArrayLike,
    bandwidth_bytes_per_s: ArrayLike | None = None,
) -> CallCost:
    """Price one call.

    n_positions: positions in the call (all sequences of a batch together).
    n_slots: distinct KV slots the call's attention reads (per sequence: kernels are shared).
    context_sum_positions: sum over positions of the keys each attends to (attention flops).
    context_sum_slots: sum over distinct (sequence, slot) pairs of the slot's length (KV bytes).
    bandwidth_bytes_per_s: overrides the hardware's peak bandwidth (for sweeps).
    """
    width = DTYPE_BYTES[dtype]
    bw_peak = hw.memory_bandwidth_bytes_per_s if bandwidth_bytes_per_s is None else (
        bandwidth_bytes_per_s)
    kv_eff = hw.kv_bandwidth_efficiency or hw.bandwidth_efficiency
    flops_peak = hw.peak_flops_per_s.get(dtype)
    if flops_peak is None:
        hw.achievable_flops_per_s(dtype)  # raises the explanatory error

    kv_token_bytes = part.layers * model.kv_bytes_per_token_per_layer(dtype)
    weight_bytes = part.weight_params * width + n_positions * model.hidden_size * width * (
        part.lookup_params > 0)
    kv_read = kv_token_bytes * context_sum_slots
    kv_write = kv_token_bytes * n_positions
    logits = model.vocab_size * 4 if part.name == "coda" else 0
    activation_bytes = n_positions * (activation_elements_per_position(model, part) * width
                                      + logits)
    attention_flops = 4 * model.num_heads * model.head_dim * part.layers * context_sum_positions
    flops = 2 * part.matmul_params * n_positions + attention_flops

    attention_launches = np.where(hw.attention_split_by_slot, n_slots, np.minimum(n_slots, 1))
    kernels = part.layers * (hw.kernels_per_layer
                             + hw.attention_kernels_per_slot * attention_launches)
    kernels = kernels + hw.part_extra_kernels.get(part.name, part.extra_kernels)
    vector_rows = n_positions < hw.blocked_gemm_rows
    overhead = (hw.host_overhead_s + part.layers * hw.layer_overhead_s
                + kernels * hw.kernel_overhead_s
                + np.where(vector_rows, 0.0, part.matrix_products * hw.blocked_gemm_latency_s))

    extra_rows = np.maximum(n_positions - 1, 0)
    cached = bool(hw.cache_bandwidth_bytes_per_s) and (
        part.weight_params * width <= hw.cache_bytes / 2)
    if cached:
        # vector products read cached weights once per row: nothing nearer to reuse them from
        gemv_passes = np.maximum(n_positions, 1)
        weights_bw = hw.cache_bandwidth_bytes_per_s
        stream_latency_s = 0.0
    else:
        gemv_passes = 1 + hw.gemv_row_passes * extra_rows ** hw.gemv_row_exponent
        weights_bw = bw_peak
        stream_latency_s = part.layers * hw.layer_stream_latency_s
    passes = np.where(vector_rows, gemv_passes, hw.blocked_gemm_weight_passes)
    one_thread = (np.zeros_like(vector_rows) if hw.threaded_gemm_rows is None
                  else n_positions < hw.threaded_gemm_rows)
    matmul_flops_peak = flops_peak * np.where(one_thread, hw.unthreaded_flops_fraction, 1.0)
    weights_mem_s = (weight_bytes * passes + activation_bytes) / (
        weights_bw * hw.bandwidth_efficiency) + stream_latency_s
    kv_mem_s = (kv_read + kv_write) / (bw_peak * kv_eff)
    memory_s = weights_mem_s + kv_mem_s
    attention_eff = hw.attention_flops_efficiency or hw.flops_efficiency
    compute_s = (2 * part.matmul_params * n_positions / (matmul_flops_peak * hw.flops_efficiency)
                 + attention_flops / (flops_peak * attention_eff))
    memory_bound = memory_s >= compute_s
    roofline_s = np.maximum(memory_s, compute_s)
    if hw.roofline_exponent is not None:
        p = hw.roofline_exponent
        roofline_s = roofline_s * (1 + (np.minimum(memory_s, compute_s) / roofline_s) ** p) ** (
            1 / p)
    # the roofline term is attributed to memory or compute, whichever is larger
    scale = roofline_s / np.maximum(memory_s, compute_s)
    weights_mem_s, kv_mem_s, compute_s = weights_mem_s * scale, kv_mem_s * scale, compute_s * scale
    if hw.overhead_overlaps:
        overhead = np.maximum(overhead - roofline_s, 0.0)
    total_bytes = weight_bytes + kv_read + kv_write + activation_bytes
    ideal = np.maximum(total_bytes / bw_peak, flops / flops_peak)
    return CallCost(
        weight_bytes=weight_bytes,
        kv_read_bytes=kv_read,
        kv_write_bytes=kv_write,
        activation_bytes=activation_bytes,
        flops=flops,
        kernels=kernels,
        weights_s=np.where(memory_bound, weights_mem_s, 0.0),
        kv_s=np.where(memory_bound, kv_mem_s, 0.0),
        compute_s=np.where(memory_bound, 0.0, compute_s),
        overhead_s=overhead,
        ideal_s=ideal,
    )
