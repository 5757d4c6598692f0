"""The machine's peaks: copy bandwidth of memory and of growing working sets (where a CPU's cache
ends), a large matrix product's flops, and on a CPU the matrix-product curve (calibrate.curve):
what the fitted efficiencies are fractions of."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from costmodel.hardware import MatmulCurve
from wfd.timing import Quiet, _best_time

from .curve import CURVE_PASSES, CURVE_ROWS, matmul_curve, row_block


@dataclass
class Peaks:
    """What the fitted efficiencies are fractions of, and what a CPU's products cost."""

    bandwidth_bytes_per_s: float  # a copy much larger than the cache
    flops_per_s: float  # a square matrix product (1024 on a CPU, 8192 on a GPU)
    reported_cache_bytes: float  # the last-level cache the system reports
    # CPU: the largest working set copied at least CACHE_SPEEDUP times faster than memory (0:
    # none is), the bandwidth there, each working set's copy bandwidth, the products' curve
    # (timed beyond four times that cache)
    cache_bytes: float = 0.0
    cache_bandwidth_bytes_per_s: float | None = None
    bandwidth_by_working_set: list[tuple[float, float]] = field(default_factory=list)
    matmul: MatmulCurve | None = None
    checks: list[str] = field(default_factory=list)  # what was checked, and what it decided


# A working set copied less than this much faster than memory is not a cache to the model.
CACHE_SPEEDUP = 1.5


# the working sets a CPU calibration copies to find where its cache ends: 512 KiB to 128 MiB,
# doubling (measure_peaks)
COPY_WORKING_SETS_BYTES = [float(2**k) for k in range(19, 28)]


def streamed_start(cache_bytes: float) -> float | None:
    """Where products start to stream (``MatmulCurve.streamed_from_bytes``): the copy working
    set after the cache knee, the first copied at memory speed; None without a knee, or with the
    knee at the largest set copied."""
    if not 0 < cache_bytes < COPY_WORKING_SETS_BYTES[-1]:
        return None
    return min(ws for ws in COPY_WORKING_SETS_BYTES if ws > cache_bytes)


def cache_size_bytes(device: str) -> float:
    """The last-level cache the system reports: L2 of a GPU, the highest-level CPU cache sysfs
    lists (a VM's is the host's, not its share: the calibration measures the knee instead)."""
    import torch

    if device.startswith("cuda"):
        return float(torch.cuda.get_device_properties(0).L2_cache_size)
    best = 0.0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, float(digits) * scale)
    return best


def copy_bandwidth(device: str, dtype: str, nbytes: float, inner: int = 1) -> float:
    """Bytes per second read and written by copies of ``nbytes`` (best of five)."""
    import torch

    from wfd.checkpoint import DTYPES

    dev, dt = torch.device(device), DTYPES[dtype]
    src = torch.ones(max(int(nbytes) // dt.itemsize, 1), dtype=dt, device=dev)
    dst = torch.empty_like(src)

    def copies() -> None:
        for _ in range(inner):
            dst.copy_(src)
    return 2 * inner * src.numel() * src.element_size() / _best_time(copies, dev, 5)


def memory_bandwidth(device: str, dtype: str = "fp32") -> float:
    """The device memory's copy bandwidth: a copy well beyond the last-level cache (at least
    256 MiB, at most 1 GiB: a VM's reported cache can be the whole host's)."""
    reported = cache_size_bytes(device)
    return copy_bandwidth(device, dtype, min(max(256 * 2**20, 8 * reported), 2**30))


def cache_knee(bandwidths: list[tuple[float, float]], memory_bytes_per_s: float
               ) -> tuple[float, float | None]:
    """(the largest working set copied at least CACHE_SPEEDUP times faster than memory, every
    smaller one too; the slowest of their bandwidths), from (working set, bandwidth) pairs in
    increasing size. (0, None): none is (no cache to the model)."""
    knee, slowest = 0.0, None
    for working_set, bandwidth in bandwidths:
        if bandwidth < CACHE_SPEEDUP * memory_bytes_per_s:
            break
        knee, slowest = working_set, bandwidth if slowest is None else min(slowest, bandwidth)
    return knee, slowest


def measure_peaks(device: str, dtype: str, quiet: Quiet | None = None,
                  curve_rows: list[int] = CURVE_ROWS, curve_passes: int = CURVE_PASSES) -> Peaks:
    """Best-of-repeats timings of copies and a large product; on a CPU also copies of growing
    working sets (where the cache ends) and the matrix-product curve."""
    import torch

    from wfd.checkpoint import DTYPES

    dev = torch.device(device)
    dt = DTYPES[dtype]
    reported = cache_size_bytes(device)
    bandwidth = memory_bandwidth(device, dtype)
    # a GPU needs a large product to approach its peak: 1024 is launch-bound on an H200 (about
    # 100 TFLOP/s of its 790)
    side = 8192 if dev.type == "cuda" else 1024
    a = torch.randn(side, side, device=dev).to(dt)
    flops = 2 * side**3 / _best_time(lambda: a @ a, dev, 5)
    peaks = Peaks(bandwidth_bytes_per_s=bandwidth, flops_per_s=flops,
                  reported_cache_bytes=reported)
    if dev.type != "cpu":
        return peaks  # a GPU streams its weights once per call: the roofline prices them
    quiet = quiet or Quiet(device, budget_s=20.0)
    # working sets (source and copy together) from 512 KiB to 128 MiB
    peaks.bandwidth_by_working_set = [
        (ws, quiet.measure(lambda b: -b, copy_bandwidth, device, dtype, ws / 2,
                           max(1, int(64 * 2**20 // ws)))) for ws in COPY_WORKING_SETS_BYTES]
    peaks.cache_bytes, peaks.cache_bandwidth_bytes_per_s = cache_knee(
        peaks.bandwidth_by_working_set, bandwidth)
    peaks.matmul = matmul_curve(dt, dtype, peaks.cache_bytes, quiet, peaks.checks, curve_rows,
                                curve_passes)
    peaks.matmul = peaks.matmul.model_copy(
        update={"streamed_from_bytes": streamed_start(peaks.cache_bytes),
                "row_block": row_block(dt, quiet, peaks.checks)})
    mib = 2**20
    if peaks.cache_bytes:
        cache = (f"copies of up to {peaks.cache_bytes / mib:.1f} MiB run "
                 f"{peaks.cache_bandwidth_bytes_per_s / bandwidth:.1f}x faster than memory")
    else:
        fastest = max(b for _, b in peaks.bandwidth_by_working_set)
        cache = (f"no working set from 0.5 MiB copies {CACHE_SPEEDUP}x faster than memory (at "
                 f"best {fastest / bandwidth:.2f}x)")
    streamed_from = peaks.matmul.streamed_from_bytes or peaks.matmul.working_sets_bytes[-1]
    peaks.checks.insert(0, f"cache: {cache} (the system reports {reported / mib:.0f} MiB): "
                           "products stream from memory in working sets from "
                           f"{streamed_from / mib:.0f} MiB (timed at "
                           f"{peaks.matmul.working_sets_bytes[-1] / mib:.0f} MiB)")
    # the curve's thin products cannot run faster than the square product's peak: if they do,
    # the peak was timed under load, and is timed again
    best_rate = max(2 * (size / dt.itemsize) * rows / t
                    for size, line in zip(peaks.matmul.matrix_bytes, peaks.matmul.seconds[-1],
                                          strict=True)
                    for rows, t in zip(peaks.matmul.rows, line, strict=True))
    if best_rate > 1.25 * flops:
        again = 2 * side**3 / quiet.measure(float, _best_time, lambda: a @ a, dev, 9)
        peaks.checks.append(f"peak flops: thin products reached {best_rate / 1e9:.0f} GFLOP/s "
                            f"against a peak of {flops / 1e9:.0f}; timed again: "
                            f"{again / 1e9:.0f}")
        peaks.flops_per_s = max(flops, again)
    return peaks
