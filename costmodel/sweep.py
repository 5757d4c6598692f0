"""Vectorized predictions over grids of width, acceptance, context, bandwidth and batch
(``sweep``): the closed forms of ``costmodel.predict`` priced once over the axes a call's cost
depends on, then weighed by each point's acceptance. Studies and figures sweep 10^5 points."""

from __future__ import annotations

import numpy as np

from .groups import basis_value
from .hardware import HardwareSpec
from .links import Link
from .model import LoopedModelSpec
from .parallel import split
from .predict import _Pricer
from .presets import resolve
from .schedules import AR, WFD, DtV
from .schedules.dtv import MAX_BLOCK_LENGTH
from .slots import check_kv_sharing, mean_decode_keys
from .specs import DTYPE_BYTES


def _check_grid(depth: int, w, a, ctx, bwa, b, new_tokens: int, block_lengths: range,
                dtype: str) -> None:
    """Refuse a sweep's impossible points (each test as "not (valid)", so that NaN is refused
    too)."""
    for bad, what in ((depth < 2, f"depth R must be at least 2, got {depth}"),
                      (np.any(~((w >= 2) & (w <= depth))), f"width must be in 2..{depth}"),
                      (np.any(~((a >= 0) & (a <= 1))), "acceptance must be in [0, 1]"),
                      (np.any(~(ctx >= 1)), "context must be at least 1 token"),
                      (np.any(~(b >= 1)), "batch must be at least 1"),
                      (np.any(~(bwa > 0)), "bandwidth must be positive"),
                      (new_tokens < 1, f"new tokens must be at least 1, got {new_tokens}"),
                      (not block_lengths or min(block_lengths) < 1,
                       "block lengths must be 1 or more"),
                      (dtype not in DTYPE_BYTES, f"unknown dtype {dtype!r}")):
        if bad:
            raise ValueError(what)


def _best_block_length(pricer: _Pricer, priced, alpha: np.ndarray, draft_depth: int,
                       depth: int, block_lengths: range) -> tuple[np.ndarray, np.ndarray]:
    """DtV's lowest latency per token over ``block_lengths`` at each point of acceptance
    ``alpha``, and the k that gives it (``priced`` reads a round's cost at the points)."""
    best = np.full(alpha.shape, np.inf)
    best_k = np.zeros(alpha.shape)
    tokens = np.ones_like(alpha)  # expected tokens per round: sum_{i <= k} alpha^i
    for k in range(1, max(block_lengths) + 1):
        tokens = 1.0 + alpha * tokens
        if k not in block_lengths:
            continue
        (per_round,) = pricer.basis_latency(
            DtV(block_length=k, draft_depth=draft_depth).call_groups(depth)).values()
        latency = priced(per_round) / tokens
        better = latency < best
        best = np.where(better, latency, best)
        best_k = np.where(better, k, best_k)
    return best, best_k


def sweep(
    model: str | LoopedModelSpec = "huginn-3.5b",
    hardware: str | HardwareSpec = "a6000",
    *,
    width: np.ndarray | int | None = None,
    acceptance: np.ndarray | float | None = None,
    context: np.ndarray | int = 1024,
    bandwidth_bytes_per_s: np.ndarray | float | None = None,
    batch: np.ndarray | int = 1,
    new_tokens: int = 512,
    dtype: str = "bf16",
    kv_sharing: int = 0,
    depth: int | None = None,
    block_lengths: range = range(1, MAX_BLOCK_LENGTH + 1),
    tensor_parallel: int = 1,
    link: str | Link | None = None,
) -> dict[str, np.ndarray]:
    """Vectorized predictions over broadcast arrays of width, acceptance, context, bandwidth and
    batch: per-token latencies of AR, DtV (best k per point) and WFD, the speedups, the chosen k and
    the draft depth (memory fit not checked: ``memory_report``). A call's cost depends on context,
    batch and bandwidth, never on acceptance or width, so the calls are priced once over those axes
    (``_Pricer.basis_latency``) and only then weighed by each point's acceptance."""
    spec, hw = split(*resolve(model, hardware), tensor_parallel, link)
    depth = depth or spec.default_depth
    alpha = spec.default_acceptance if acceptance is None else acceptance
    width = -(-depth // spec.default_draft_depth) if width is None else width
    bw = hw.roofline.memory_bandwidth_bytes_per_s if bandwidth_bytes_per_s is None else (
        bandwidth_bytes_per_s)
    w, a, ctx, bwa, b = (np.asarray(width), np.asarray(alpha, dtype=float),
                         np.asarray(context, dtype=float), np.asarray(bw, dtype=float),
                         np.asarray(batch, dtype=float))
    shape = np.broadcast_shapes(w.shape, a.shape, ctx.shape, bwa.shape, b.shape)
    check_kv_sharing(kv_sharing, depth)
    _check_grid(depth, w, a, ctx, bwa, b, new_tokens, block_lengths, dtype)
    d = -(-depth // w)
    keys = mean_decode_keys(ctx, new_tokens, hw.graphs.cuda_graphs)
    # calls priced once over the cost axes, unless those vary point by point (a scatter of
    # points): then per draft depth over its own points
    cost_shape = np.broadcast_shapes(ctx.shape, b.shape, bwa.shape)
    per_point = np.prod(cost_shape) * 8 > np.prod(shape)
    shared = None if per_point else _Pricer(spec, hw, dtype, keys, b, bwa)
    # which of the shared costs each point reads
    cost_cells = None if per_point else np.arange(np.prod(cost_shape)).reshape(cost_shape)
    out = {key: np.empty(shape) for key in ("ar_latency_s", "dtv_latency_s", "wfd_latency_s",
                                            "dtv_block_length")}
    for dv in np.unique(d):
        sel = np.broadcast_to(d == dv, shape)
        alpha_sel = np.broadcast_to(a, shape)[sel]

        def on_points(values: np.ndarray, sel: np.ndarray = sel) -> np.ndarray:
            return np.broadcast_to(values, shape)[sel]

        cells = None if per_point else on_points(cost_cells)

        def priced(cost: np.ndarray, cells: np.ndarray | None = cells) -> np.ndarray:
            """A latency at this draft depth's points (a cost over the cost axes read at each
            point's cell: one small gather, not a pass over the whole grid)."""
            if cells is None or not np.ndim(cost):
                return cost
            return np.broadcast_to(cost, cost_shape).ravel()[cells]

        pricer = _Pricer(spec, hw, dtype, on_points(keys), on_points(b), on_points(bwa)) \
            if per_point else shared
        out["ar_latency_s"][sel] = priced(sum(pricer.basis_latency(
            AR().call_groups(depth)).values()))
        out["dtv_latency_s"][sel], out["dtv_block_length"][sel] = _best_block_length(
            pricer, priced, alpha_sel, int(dv), depth, block_lengths)
        wfd = pricer.basis_latency(WFD(draft_depth=int(dv)).call_groups(depth, kv_sharing))
        out["wfd_latency_s"][sel] = sum(priced(cost) * basis_value(basis, alpha_sel)
                                        for basis, cost in wfd.items())
    out["draft_depth"] = np.broadcast_to(d, shape).copy()
    out["dtv_speedup"] = out["ar_latency_s"] / out["dtv_latency_s"]
    out["wfd_speedup"] = out["ar_latency_s"] / out["wfd_latency_s"]
    return out
