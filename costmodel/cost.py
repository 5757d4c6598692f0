"""The cost of one call of a part (P, B or C) over n positions.

    t = t_host + layers * t_layer + n_kernels * (t_launch + t_kernel)
        + max(bytes / BW_eff, matmul flops / F_eff + attention flops / F_attention_eff)
        + t_link   (tensor parallel: the collectives joining the devices' shares)

On a GPU the host's overhead overlaps the device's work and a call costs the larger of the two
(``overhead_overlaps``); a CPU with a measured matrix-product curve prices its products by the
curve and the rest of the call by its roofline. docs/costmodel.md ("One call") gives each term
and why. Every argument may be a numpy array (they broadcast), so one formula serves single
predictions, the event simulator and sweeps of 10^5 points.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .hardware import CpuTerms, HardwareSpec
from .matmul import part_matmul_s, streams
from .model import LoopedModelSpec, PartSpec
from .specs import DTYPE_BYTES

ArrayLike = float | np.ndarray
# the terms a call's time is the sum of (CallCost's, a breakdown's)
TERMS = ("weights_s", "kv_s", "compute_s", "overhead_s", "link_s")


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
    link_s: ArrayLike = 0.0  # tensor parallel: the collectives over the devices' link

    @property
    def time_s(self) -> ArrayLike:
        return self.weights_s + self.kv_s + self.compute_s + self.overhead_s + self.link_s

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


def operations(hw: HardwareSpec, part: PartSpec, n_slots: ArrayLike
               ) -> tuple[ArrayLike, ArrayLike]:
    """(kernels a call of ``part`` runs, its dispatched operations weighted by their class's host
    time). A preset (no ``kernels_per_layer``) counts this decoder's own operations by class
    (``PartSpec.layer_operations``; one attention per layer). A calibrated spec counts its own:
    without classes every operation is a kernel of weight 1, per layer ``kernels_per_layer``
    plus, split by slot, ``attention_kernels_per_slot`` per slot read, plus the part's own; with
    them (``Operations.layer_operations``), as the preset's. By class, views run no kernel and
    each class weighs its measured host time (1 where none was measured)."""
    ops = hw.operations
    if ops.kernels_per_layer is None:
        per_slot = 0
        layer_ops, extra_ops = part.layer_operations, part.extra_operations
    else:
        attention_launches = np.where(ops.attention_split_by_slot, n_slots,
                                      np.minimum(n_slots, 1))
        per_slot = ops.attention_kernels_per_slot * attention_launches
        extra = ops.part_extra_kernels.get(part.name, sum(part.extra_operations.values()))
        if not ops.layer_operations:
            dispatched = part.layers * (ops.kernels_per_layer + per_slot) + extra
            return dispatched, dispatched
        layer_ops = ops.layer_operations
        extra_ops = ops.part_extra_operations.get(part.name, {"other": extra})
    weights = ops.operation_host_weights

    def weighed(counts: dict[str, int]) -> float:
        return sum(count * weights.get(kind, 1.0) for kind, count in counts.items())

    dispatched = part.layers * (sum(layer_ops.values()) + per_slot) + sum(extra_ops.values())
    views = part.layers * layer_ops.get("view", 0) + extra_ops.get("view", 0)
    host = (part.layers * (weighed(layer_ops) + per_slot * weights.get("attention", 1.0))
            + weighed(extra_ops))
    return dispatched - views, host


def attention_host_s(hw: HardwareSpec, key_sets: ArrayLike, n_positions: ArrayLike
                     ) -> ArrayLike:
    """The eager host's extra time per layer for the shape of a call's attention: over a single
    key set, and with several queries per key set (``Host.attention_one_set_host_s``,
    ``attention_grouped_host_s``); none in a replayed graph."""
    if hw.graphs.cuda_graphs:
        return 0.0
    key_sets = np.asarray(key_sets)
    return (hw.host.attention_one_set_host_s * (key_sets == 1)
            + hw.host.attention_grouped_host_s * (np.asarray(n_positions) > key_sets))


def at_roofline(weights_mem_s: ArrayLike, kv_mem_s: ArrayLike, compute_s: ArrayLike
                ) -> tuple[ArrayLike, ArrayLike, ArrayLike]:
    """(weights, KV, compute) time of a call whose products stream their weights once and run
    their flops at the achievable peak (a GPU): the larger of its memory time and its compute
    time, reported as the memory's two shares or as compute."""
    memory_bound = weights_mem_s + kv_mem_s >= compute_s
    return (np.where(memory_bound, weights_mem_s, 0.0), np.where(memory_bound, kv_mem_s, 0.0),
            np.where(memory_bound, 0.0, compute_s))


def measured_products(model: LoopedModelSpec, cpu: CpuTerms, part: PartSpec, dtype: str,
                      n_positions: ArrayLike, weight_bytes: ArrayLike,
                      activation_bytes: ArrayLike, weight_bandwidth: ArrayLike,
                      kv_mem_s: ArrayLike, attention_s: ArrayLike, bandwidth_ratio: ArrayLike,
                      after_other_part: ArrayLike) -> tuple[ArrayLike, ArrayLike, ArrayLike]:
    """(weights, KV, compute) time of a call on a CPU, whose kernels run one after another: the
    matrix products as the measured curve times them in the working set they run in, then the
    rest (norms, attention, activations, KV) at its roofline. The products' one-row time is
    reported as weights (times ``bandwidth_ratio``, the measured bandwidth over the one priced,
    where they stream from memory), what more rows add as compute."""
    width = DTYPE_BYTES[dtype]
    matrices = [(shape, part.layers) for shape in part.layer_matrices] + [
        (shape, 1) for shape in part.extra_matrices]
    matrix_bytes = sum(out * inner * count for (out, inner), count in matrices) * width

    def products(working_set: float) -> tuple[ArrayLike, ArrayLike, ArrayLike]:
        """(the products' time, their one-row time, that time as the weights') in a working
        set"""
        ratio = bandwidth_ratio if streams(cpu.matmul, working_set) else 1.0
        total = cpu.matmul_time_scale * part_matmul_s(cpu.matmul, matrices, width, n_positions,
                                                      working_set)
        one_row = np.minimum(cpu.matmul_time_scale * part_matmul_s(
            cpu.matmul, matrices, width, 1, working_set), total)
        return total, one_row, one_row * ratio

    products_s, one_row_s, row_weights_s = products(part.weight_params * width)
    cold = np.asarray(after_other_part, dtype=bool)
    if cold.any():
        # between two calls of this part the others read their weights: the cache holds what is
        # left of the whole model's
        whole = sum(p.weight_params for p in model.parts.values()) * width
        products_s, one_row_s, row_weights_s = (
            np.where(cold, after, before)
            for after, before in zip(products(whole), (products_s, one_row_s, row_weights_s),
                                     strict=True))
    other_mem_s = (weight_bytes - matrix_bytes + activation_bytes) / weight_bandwidth
    rest_memory_bound = other_mem_s + kv_mem_s >= attention_s
    return (row_weights_s + np.where(rest_memory_bound, other_mem_s, 0.0),
            np.where(rest_memory_bound, kv_mem_s, 0.0),
            products_s - one_row_s + np.where(rest_memory_bound, 0.0, attention_s))


def traffic(model: LoopedModelSpec, part: PartSpec, dtype: str, n_positions: ArrayLike,
            context_sum_positions: ArrayLike, context_sum_slots: ArrayLike) -> tuple:
    """What a call moves and computes beside its products: (weight bytes, KV bytes read, KV
    bytes written, activation bytes, attention flops), for ``call_cost``'s arguments."""
    width = DTYPE_BYTES[dtype]
    kv_token_bytes = part.layers * model.kv_bytes_per_token_per_layer(dtype)
    weight_bytes = part.weight_params * width + n_positions * model.hidden_size * width * (
        part.lookup_params > 0)
    logits = model.vocab_size * 4 if part.name == "coda" else 0
    activation_bytes = n_positions * (activation_elements_per_position(model, part) * width
                                      + logits)
    attention_flops = 4 * model.num_heads * model.head_dim * part.layers * context_sum_positions
    return (weight_bytes, kv_token_bytes * context_sum_slots, kv_token_bytes * n_positions,
            activation_bytes, attention_flops)


def host_overhead(hw: HardwareSpec, part: PartSpec, n_slots: ArrayLike, key_sets: ArrayLike,
                  n_positions: ArrayLike) -> tuple:
    """(the kernels a call launches, the host's time for it): per call, per layer and per
    dispatched operation (eager: every dispatched operation costs the host its class's time; a
    replay, each kernel)."""
    kernels, host_operations = operations(hw, part, n_slots)
    host_launches = kernels if hw.graphs.cuda_graphs else host_operations
    overhead = hw.call_overhead_s + part.layers * (
        hw.layer_host_s + attention_host_s(hw, key_sets, n_positions)
    ) + host_launches * hw.kernel_overhead_s
    return kernels, overhead


def collectives_s(model: LoopedModelSpec, hw: HardwareSpec, part: PartSpec, dtype: str,
                  n_positions: ArrayLike) -> ArrayLike:
    """Tensor parallel: the collectives joining the devices' shares of a call, device time
    after its products (none on one device)."""
    tp = hw.tensor_parallel
    if tp is None:
        return 0.0
    if model.tensor_parallel != tp.degree:
        raise ValueError(f"{tp.degree} devices price a model split as many ways "
                         f"(costmodel.parallel.split), not {model.tensor_parallel}")
    return tp.call_s(model, part, dtype, n_positions)


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
    key_sets: ArrayLike | None = None,
    after_other_part: ArrayLike = False,
) -> CallCost:
    """Price one call.

    n_positions: positions in the call (all sequences of a batch together).
    n_slots: distinct KV slots the call's attention reads (per sequence: kernels are shared).
    context_sum_positions: sum over positions of the keys each attends to (attention flops).
    context_sum_slots: sum over distinct (sequence, slot) pairs of the slot's length (KV bytes).
    bandwidth_bytes_per_s: overrides the hardware's peak bandwidth (for sweeps).
    key_sets: distinct (sequence, slot) pairs read (None: n_slots, one sequence).
    after_other_part: the call follows another part's call, so a CPU's products read from a
        working set of the whole model's weights (False: of this part's, as AR's block calls)."""
    key_sets = n_slots if key_sets is None else key_sets
    roof = hw.roofline
    bw_peak = roof.memory_bandwidth_bytes_per_s if bandwidth_bytes_per_s is None else (
        bandwidth_bytes_per_s)
    kv_eff = roof.kv_bandwidth_efficiency or roof.bandwidth_efficiency
    flops_peak = roof.peak_flops_per_s.get(dtype)
    if flops_peak is None:
        hw.achievable_flops_per_s(dtype)  # raises the explanatory error

    weight_bytes, kv_read, kv_write, activation_bytes, attention_flops = traffic(
        model, part, dtype, n_positions, context_sum_positions, context_sum_slots)
    flops = 2 * part.matmul_params * n_positions + attention_flops
    kernels, overhead = host_overhead(hw, part, n_slots, key_sets, n_positions)

    weight_bandwidth = bw_peak * roof.bandwidth_efficiency
    attention_s = attention_flops / (flops_peak * (roof.attention_flops_efficiency
                                                   or roof.flops_efficiency))
    kv_mem_s = (kv_read + kv_write) / (bw_peak * kv_eff)
    if hw.cpu is not None and hw.cpu.matmul.dtype == dtype:
        weights_s, kv_s, compute_s = measured_products(
            model, hw.cpu, part, dtype, n_positions, weight_bytes, activation_bytes,
            weight_bandwidth, kv_mem_s, attention_s,
            roof.memory_bandwidth_bytes_per_s / bw_peak, after_other_part)
        # the curve's products include their own dispatch
        overhead = np.maximum(overhead - part.matrix_products * hw.kernel_overhead_s,
                              hw.call_overhead_s)
    else:
        weights_s, kv_s, compute_s = at_roofline(
            (weight_bytes + activation_bytes) / weight_bandwidth, kv_mem_s,
            2 * part.matmul_params * n_positions / (flops_peak * roof.flops_efficiency)
            + attention_s)
    roofline_s = weights_s + kv_s + compute_s
    # a CPU's attention works through its (key set, head) pairs one by one, each at a fixed
    # cost beside its keys' bytes: part of reading the cache, and what many short key sets
    # (a batch of WFD waves) add
    key_set_s = hw.cpu.attention_key_set_s if hw.cpu is not None else 0.0
    key_sets_s = part.layers * model.num_heads * key_set_s * key_sets
    kv_s = kv_s + key_sets_s
    roofline_s = roofline_s + key_sets_s
    device_kernels_s = kernels * roof.kernel_device_s
    link_s = collectives_s(model, hw, part, dtype, n_positions)
    device_s = roofline_s + link_s
    if hw.host.overhead_overlaps:  # the call costs the larger of the host's time and the device's
        overhead = np.maximum(overhead, device_s + device_kernels_s) - device_s
    else:
        overhead = overhead + device_kernels_s
    total_bytes = weight_bytes + kv_read + kv_write + activation_bytes
    ideal = np.maximum(total_bytes / bw_peak, flops / flops_peak)
    return CallCost(weight_bytes=weight_bytes, kv_read_bytes=kv_read, kv_write_bytes=kv_write,
                    activation_bytes=activation_bytes, flops=flops, kernels=kernels,
                    weights_s=weights_s, kv_s=kv_s, compute_s=compute_s, overhead_s=overhead,
                    ideal_s=ideal, link_s=link_s)
