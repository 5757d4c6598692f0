"""Time the decoder's parts on this machine: the machine's peaks (memory bandwidth, and on a
CPU the working set below which copies run from a cache, matrix-product flops, and the time of
one matrix product against its rows and size); single P, B and C calls over a grid of positions
per call, context lengths and distinct KV slots, for a list of models; and whole AR, DtV and WFD
runs with their call traces.

Timing discipline: warm-up calls, repeated calls, the median; CUDA events after a synchronize on
a GPU (wfd.runtime.Timer). Calls are timed at a given context by marking that many positions of
every slot valid (their contents do not change the time) and writing the call's positions again
on every repeat. On a shared machine another tenant's load comes and goes in spells: every
measurement on a CPU is bracketed by a canary product and taken again when one ran slow
(``Quiet``), and the calibration reports how much of it ran under load.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from costmodel.specs import HardwareSpec, MatmulCurve
from costmodel.trace import CallRecord

from .refit import COPY_WORKING_SETS_BYTES, streamed_start


class CallSample(BaseModel):
    """One grid point: the median time of a call shape, with the record the cost model prices."""

    model_config = ConfigDict(extra="forbid")
    model: str
    record: CallRecord
    median_s: float
    spread_s: float  # interquartile range of the repeats


class RunSample(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    schedule: str
    draft_depth: int | None
    block_length: int | None
    tokens: int
    wall_s: float
    records: list[CallRecord]
    accept: list[bool]  # draft outcomes by decoded position


@dataclass
class Grid:
    positions: list[int]
    contexts: list[int]
    repeats: int = 7
    warmup: int = 2

    @staticmethod
    def slots_for(n: int, depth: int) -> list[int]:
        """Block calls as the schedules make them: every position at one depth (AR, prefill,
        DtV's verify), or each at its own depth (a WFD wave, at most R positions)."""
        return [1, n] if 1 < n <= depth else [1]


QUICK = Grid(positions=[1, 2, 3, 4, 8, 16, 32], contexts=[64, 256, 1024], repeats=5)
# 5 on the default grid: DtV's verification width at k = 4, and the first row count MKL threads
FULL = Grid(positions=[1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32], contexts=[64, 512, 2048], repeats=7)


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
CURVE_ROWS = [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32]
CURVE_ROWS_QUICK = [1, 2, 3, 4, 8, 16, 32]  # the quick grid's positions
CURVE_SIZES_BYTES = [float(2**k) for k in range(14, 27, 2)]  # 16 KiB .. 64 MiB
# the working sets the products are timed in (a call's: its part's weights), then one beyond
# the cache: at least this, and four times the measured cache
CURVE_WORKING_SETS_BYTES = [float(2**k) for k in range(20, 25, 2)]  # 1, 4, 16 MiB
STREAMED_WORKING_SET_BYTES = 128 * 2**20
# outputs over inputs of the wide and tall matrices timed besides the square ones (streamed):
# a layer's projections span about 1/3 to 3 (MLP down and up, fused qkv, fused gate and up)
CURVE_ASPECTS = [0.25, 4.0]
CURVE_PASSES = 3  # passes over the curve's lines, each point the median of its passes


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


def _times(fn, device: torch.device, repeats: int) -> list[float]:
    """``repeats`` timed calls, after one that warms up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def _best_time(fn, device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (peaks: what the machine can do)."""
    return min(_times(fn, device, repeats))


def _median_time(fn, device: torch.device, repeats: int) -> float:
    """The median of ``repeats`` timed calls (as a call of the grid is timed)."""
    return statistics.median(_times(fn, device, repeats))


class Quiet:
    """Measurements taken while the machine is quiet. On a shared VM other tenants' load comes
    in spells that slow matrix products most, so the canary is such a product, timed before and
    after each measurement; when either ran more than ``tolerance`` slower than the fastest
    canary so far, the measurement is taken again after a pause (at most ``retries`` times,
    keeping the fastest), within ``budget_s`` of extra time over the calibration. It counts the
    measurements, those taken again, and those whose kept attempt still ran under load."""

    def __init__(self, device: str, tolerance: float = 1.2, retries: int = 4,
                 pause_s: float = 1.0, budget_s: float = float("inf")):
        self.device = torch.device(device)
        self.tolerance, self.retries, self.pause_s = tolerance, retries, pause_s
        self.budget_s = budget_s  # the most time spent on measurements taken again
        self.spent_s = 0.0
        self._weights = [torch.randn(2112, 768, device=self.device) for _ in range(8)]
        self._x = torch.randn(6, 768, device=self.device)
        self.best_s = float("inf")
        self.measurements = 0
        self.retried = 0  # measurements taken again
        self.loaded = 0  # measurements whose kept attempt ran with a slow canary
        self.kept_load: list[float] = []  # the slower canary around each kept attempt

    def canary(self) -> float:
        """The canary's time over the fastest seen so far (1.0: quiet)."""
        def products() -> None:
            for w in self._weights:
                torch.nn.functional.linear(self._x, w)
        t = _best_time(products, self.device, repeats=2)
        self.best_s = min(self.best_s, t)
        return t / self.best_s

    def measure(self, seconds, fn, *args):
        """fn(*args) measured while quiet; ``seconds(result)`` orders attempts."""
        best, best_load = None, 1.0
        self.measurements += 1
        for attempt in range(self.retries + 1):
            t0 = time.perf_counter()
            before = self.canary()
            result = fn(*args)
            after = self.canary()
            if attempt:
                self.spent_s += time.perf_counter() - t0
            if best is None or seconds(result) < seconds(best):
                best, best_load = result, max(before, after)
            if max(before, after) <= self.tolerance:
                break
            if attempt == self.retries or self.spent_s + self.pause_s >= self.budget_s:
                break
            if attempt == 0:
                self.retried += 1
            time.sleep(self.pause_s)
            self.spent_s += self.pause_s
        if best_load > self.tolerance:
            self.loaded += 1
        self.kept_load.append(best_load)
        return best

    def report(self) -> dict[str, float]:
        """How busy the machine was: the fractions of measurements taken again and still under
        load when kept, and the median, 10th and 90th percentiles of the kept attempts'
        canaries (over the fastest canary seen; their ratio is how far apart in speed the
        measurements ran)."""
        n = max(self.measurements, 1)
        loads = sorted(self.kept_load) or [1.0]
        return {"measurements": self.measurements, "retaken_fraction": self.retried / n,
                "loaded_fraction": self.loaded / n, "canary_tolerance": self.tolerance,
                "canary_median": statistics.median(loads),
                "canary_p10": loads[int(0.1 * len(loads))],
                "canary_p90": loads[min(len(loads) - 1, int(0.9 * len(loads)))]}


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


def median_over_passes(lines: list, passes: int) -> list[list[float]]:
    """Each of ``lines`` (callables returning a line of times) timed once per pass, a whole pass
    apart; each point the median of its passes. A spell of another tenant's load lasts seconds
    on this project's VM (``bench/machine_noise.py``: 0.5 to 24 s, while a line takes about
    a second): it slows a run of consecutive lines in one pass, and the median of three passes drops
    it where a single pass kept it (a 16 MiB line of four times more outputs than inputs timed
    3.4-3.8x the square's over 8 to 32 rows, against 1.0-1.1x when timed again)."""
    runs: list[list[list[float]]] = [[] for _ in lines]
    for _ in range(passes):
        for times, timed in zip(runs, lines, strict=True):
            times.append(timed())
    return [[statistics.median(point) for point in zip(*times, strict=True)] for times in runs]


def chain_product_s(weights: list[torch.Tensor], rows: int, quiet: Quiet, repeats: int
                    ) -> float:
    """One product's time over ``rows`` rows in a chain of ``weights`` (a CPU's, each [out, in]):
    the chain's median over ``repeats``, measured while quiet, over its length."""
    import torch

    x = torch.ones(rows, weights[0].shape[1], dtype=weights[0].dtype)
    return quiet.measure(float, _median_time, lambda: [
        torch.nn.functional.linear(x, w) for w in weights], torch.device("cpu"),
        repeats) / len(weights)


def matmul_curve(dt: torch.dtype, dtype: str, cache_bytes: float, quiet: Quiet,
                 checks: list[str], rows: list[int] = CURVE_ROWS,
                 passes: int = CURVE_PASSES) -> MatmulCurve:
    """One product's time against its rows, its matrix's size (``CURVE_SIZES_BYTES``) and its
    working set (``CURVE_WORKING_SETS_BYTES``, then one beyond the cache: streamed from memory),
    in chains of square matrices, and streamed at the aspects ``CURVE_ASPECTS`` (a 5632 x 1024
    product streams 1.3-1.5x slower than a 2400 x 2400 one on this project's VM:
    ``bench/matmul_paths.py --cold``). Each line (one chain's times over the rows) is timed in
    ``passes`` passes over all the lines (``median_over_passes``); each point is the median of
    its passes, each pass's the median of three chains. A time outside what physics allows
    (below a single row's, or above one product per row) is taken again, and held within those
    bounds if it stays outside."""
    import torch

    def chain(size: float, working_set: float, aspect: float = 1.0) -> list[torch.Tensor]:
        inner = max(int((size / dt.itemsize / aspect) ** 0.5), 8)
        out = max(int(inner * aspect), 8)
        # at most 1024 products a chain: beyond that the small ones' Python loop is the time
        count = max(1, min(int(working_set // size), 1024))
        return [torch.randn(out, inner).to(dt) for _ in range(count)]

    def line(weights: list[torch.Tensor]) -> list[float]:
        def timed(n: int) -> float:
            return chain_product_s(weights, n, quiet, repeats=3)

        times = [timed(n) for n in rows]
        for j, n in enumerate(rows[1:], start=1):
            low, high = 0.9 * times[0], 1.2 * n * times[0]
            if not low <= times[j] <= high:
                times[j] = timed(n)
                if not low <= times[j] <= high:
                    mib = weights[0].numel() * dt.itemsize / 2**20
                    checks.append(f"matrix products: {mib:.2f} MiB over {n} rows stayed outside "
                                  f"[{low * 1e6:.0f}, {high * 1e6:.0f}] us when timed again: "
                                  "held at the bound")
                    times[j] = min(max(times[j], low), high)
        return times

    sets = [*CURVE_WORKING_SETS_BYTES, max(STREAMED_WORKING_SET_BYTES, 4 * cache_bytes)]
    # each line's chain is built anew in every pass: kept, the streamed lines' chains would
    # hold 21 x 128 MiB at once
    square = [(size, ws, 1.0) for ws in sets for size in CURVE_SIZES_BYTES if size <= ws]
    wide = [(size, sets[-1], aspect) for aspect in CURVE_ASPECTS for size in CURVE_SIZES_BYTES]
    keys = square + wide
    by_key = dict(zip(keys, median_over_passes(
        [lambda key=key: line(chain(*key)) for key in keys], passes), strict=True))
    seconds = [[by_key.get((size, ws, 1.0), [None] * len(rows)) for size in CURVE_SIZES_BYTES]
               for ws in sets]
    aspect_seconds = [[by_key[(size, sets[-1], aspect)] for size in CURVE_SIZES_BYTES]
                      for aspect in CURVE_ASPECTS]
    return MatmulCurve(dtype=dtype, rows=rows, matrix_bytes=CURVE_SIZES_BYTES,
                       working_sets_bytes=sets, seconds=seconds, aspects=CURVE_ASPECTS,
                       aspect_seconds=aspect_seconds)


# The row counts the kernels' row block is read from: from the curve's last (32) on, where a
# batch's calls have their rows, two blocks of the largest block looked for
ROW_BLOCK_COUNTS = list(range(32, 65))
ROW_BLOCKS = (16, 8, 4, 2)  # the blocks looked for, largest first
# (outputs, inputs) of the products timed: square, wide and tall, as a layer's projections are
ROW_BLOCK_SHAPES = [(512, 512), (1024, 1024), (2048, 512), (512, 2048)]
ROW_BLOCK_STEP = 0.04  # the least a new block must add to a product's time (median)


def upper_quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4)[2] if len(values) > 1 else values[0]


def staircase_block(counts: list[int], times: list[float]) -> int:
    """The largest block of rows ``b`` in ``ROW_BLOCKS`` whose times form a staircase: each
    block's first row count costs clearly more than the count before it (median step at least
    ``ROW_BLOCK_STEP``, and twice the median change the other counts add), and the counts
    inside every block cost about what its last does (three in four of them within half that
    step): a kernel that computes b rows at once. 1 when none does: time grows with every
    row, or the changes are noise. On this project's VM a 1024 x 1024 product's steps are
    7-10% at 33, 41, 49 and 57 rows, and a block's counts sit within 2-4% of its last."""
    at = dict(zip(counts, times, strict=True))
    for b in ROW_BLOCKS:
        rises = {n: at[n] / at[n - 1] - 1 for n in counts if n - 1 in at}
        steps = [rise for n, rise in rises.items() if n % b == 1]
        # a row count added inside a block: noise, or a smaller block's step
        others = [abs(rise) for n, rise in rises.items() if n % b != 1]
        inside: dict[int, list[float]] = {}  # each block's counts against its last
        for n in counts:
            if (top := -(-n // b) * b) != n and top in at:
                inside.setdefault(top, []).append(abs(at[top] / at[n] - 1))
        if not steps or not inside or not others:
            continue
        step = statistics.median(steps)
        if (step >= max(ROW_BLOCK_STEP, 2 * statistics.median(others))
                and max(upper_quartile(errors) for errors in inside.values()) <= step / 2):
            return b
    return 1


def row_block(dt: torch.dtype, quiet: Quiet, checks: list[str]) -> int:
    """The rows a product's kernels compute together on this CPU: the products of
    ``ROW_BLOCK_SHAPES`` (each in a chain of 8) timed at each of ``ROW_BLOCK_COUNTS`` rows, each
    shape's times over its time at the first count, their geometric mean read as a staircase
    (``staircase_block``). One shape's staircase is as noisy as the machine; on this
    project's VM the mean of four is clean where single ones are not."""
    import torch

    def line(out: int, inner: int) -> list[float]:
        weights = [torch.randn(out, inner).to(dt) for _ in range(8)]
        times = [chain_product_s(weights, n, quiet, repeats=5) for n in ROW_BLOCK_COUNTS]
        return [math.log(t / times[0]) for t in times]

    lines = [line(*shape) for shape in ROW_BLOCK_SHAPES]
    mean = [math.exp(statistics.fmean(point)) for point in zip(*lines, strict=True)]
    block = staircase_block(ROW_BLOCK_COUNTS, mean)
    first, last = ROW_BLOCK_COUNTS[0], ROW_BLOCK_COUNTS[-1]
    checks.append(f"matrix products: computed in blocks of {block} rows (a row count the curve "
                  f"did not measure costs the next multiple of {block}'s)" if block > 1 else
                  f"matrix products: no block of rows seen from {first} to {last} rows (time "
                  "linear between the curve's row counts)")
    return block


# Operations that only make a new view of a tensor (or hand it back): the host dispatches them,
# no kernel runs. A GPU calibration prices them apart (HardwareSpec.layer_operations).
METADATA_OPS = {"lift_fresh", "detach", "detach_", "alias", "to"}
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}


def operation_class(func, args: tuple, out) -> str:
    """matmul, attention, view (no kernel: a view, or an input handed back) or other."""
    name = func._schema.name.split("::")[-1]
    if name in MATMUL_OPS:
        return "matmul"
    if "scaled_dot_product" in name:
        return "attention"
    handed_back = isinstance(out, torch.Tensor) and any(out is a for a in args)
    if name == "to":  # its schema may alias (so is_view), but a cast to another dtype copies
        return "view" if handed_back else "other"
    if func.is_view or name in METADATA_OPS:
        return "view"
    return "other"


def count_ops(model, kind: str) -> dict[str, int]:
    """Operations the decoder dispatches for one call of ``kind`` over one position, by class
    (``operation_class``): what the cost model counts as kernels, each paying the per-kernel
    overhead."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = dict.fromkeys(HardwareSpec.OPERATION_CLASSES, 0)

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            counts[operation_class(func, args, out)] += 1
            return out

    runner = _timed_runner(model, 8, 1, record=False)  # eager: the operations one call issues
    param = next(model.parameters())
    state = torch.zeros(1, model.config.hidden_size, dtype=param.dtype, device=param.device)
    calls = {"prelude": lambda: runner.prelude([1], [8]),
             "block": lambda: runner.block(state, state, [8], [1]),
             "coda": lambda: runner.coda(state, [8], [model.config.depth])}
    with torch.inference_mode(), Counter():
        calls[kind]()
    return counts


@dataclass
class DecoderOperations:
    """The decoder's dispatched operations: per transformer layer and per call of each part
    outside its layers, in all and by class."""

    per_layer: int
    extras: dict[str, int]
    layer_by_class: dict[str, int]
    extras_by_class: dict[str, dict[str, int]]


def decoder_operations(models: list) -> DecoderOperations:
    """Operations per layer and per part, from op counts of models with different numbers of
    core layers: when the models share one, the smallest is counted again with one more (built
    on its device, in its dtype; weights do not change what is dispatched)."""
    from wfd.checkpoint import build

    if len({m.config.core_layers for m in models}) == 1:
        small = min(models, key=lambda m: sum(p.numel() for p in m.parameters()))
        param = next(small.parameters())
        models = [*models, build(small.config.model_copy(
            update={"core_layers": small.config.core_layers + 1}), device=param.device,
            dtype=param.dtype)]

    def layers(model, kind: str) -> int:
        cfg = model.config
        return {"prelude": cfg.prelude_layers, "block": cfg.core_layers,
                "coda": cfg.coda_layers}[kind]

    counts = {kind: [(layers(model, kind), count_ops(model, kind)) for model in models]
              for kind in ("prelude", "block", "coda")}
    (l0, c0), *_, (l1, c1) = sorted(counts["block"], key=lambda pair: pair[0])
    layer = {k: round((c1[k] - c0[k]) / (l1 - l0)) for k in c1}
    extras = {kind: {k: max(0, round(sum(c[k] - n * layer[k] for n, c in pairs) / len(pairs)))
                     for k in layer}
              for kind, pairs in counts.items()}
    return DecoderOperations(per_layer=sum(layer.values()),
                             extras={kind: sum(ops.values()) for kind, ops in extras.items()},
                             layer_by_class=layer, extras_by_class=extras)


def operation_host_weights(device: str, dtype: str, calls: int = 400) -> dict[str, float]:
    """Each operation class's host time relative to an elementwise operation's: a loop of one
    operation on tiny tensors, dispatched eagerly (on a GPU the host's time: each launch is
    longer than the kernel it starts), the best of five loops per class."""
    import torch.nn.functional as F

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    dev = torch.device(device)
    x = torch.randn(1, 64, dtype=dt, device=dev)
    w = torch.randn(64, 64, dtype=dt, device=dev)
    q = torch.randn(1, 4, 1, 16, dtype=dt, device=dev)
    kv = torch.randn(1, 4, 8, 16, dtype=dt, device=dev)
    mask = torch.ones(1, 1, 1, 8, dtype=torch.bool, device=dev)
    ops = {"matmul": lambda: F.linear(x, w),
           "attention": lambda: F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask),
           "other": lambda: x * x,
           "view": lambda: x.view(64)}

    def loop(fn) -> None:
        for _ in range(calls):
            fn()

    with torch.inference_mode():
        seconds = {kind: _best_time(lambda fn=fn: loop(fn), dev, 5) / calls
                   for kind, fn in ops.items()}
    return {kind: t / seconds["other"] for kind, t in seconds.items()}


def graph_replay_costs(device: str, kernels: int = 64, replays: int = 200,
                       capture: bool | None = None) -> tuple[float, float]:
    """(seconds per replayed call, device seconds per kernel replayed) of tiny captured calls,
    served as the decoder serves a call (wfd.graphs: inputs copied into the shape's buffers, the
    graph replayed, the output copied out): a one-kernel call is the host's replay cost; each
    kernel more adds the device's floor per kernel once the replay is device-bound. The priors
    of a graphs-mode prediction from an eager calibration. ``capture``: CUDA graphs (default on
    CUDA; without, the same calls run from the static buffers)."""
    from wfd.graphs import CallGraphs

    dev = torch.device(device)
    graphs = CallGraphs(dev.type == "cuda" if capture is None else capture, dev)
    x = torch.randn(1, 64, device=dev)

    def per_replay(n: int) -> float:
        def chain(position: torch.Tensor, slot: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            for _ in range(n):
                y = y * 1.0
            return y

        def call() -> None:  # a position copied in, a slot kept, a state copied in: a B call's
            graphs.run(("microbenchmark", n), chain, [8], [x], lambda replay: (replay(), 0.0),
                       constants=lambda: [torch.zeros(1, dtype=torch.long, device=dev)])

        call()  # captured (or prepared) once

        def loop() -> None:
            for _ in range(replays):
                call()

        return _best_time(loop, dev, 5) / replays

    with torch.inference_mode():
        one, many = per_replay(1), per_replay(kernels + 1)
    return one, max(0.0, (many - one) / kernels)


def _median(times: list[float]) -> tuple[float, float]:
    qs = statistics.quantiles(times, n=4) if len(times) >= 4 else [min(times), 0, max(times)]
    return statistics.median(times), qs[2] - qs[0]


def _timed_runner(model, context: int, positions: int, mode: str = "eager", record=True):
    """A runner whose cache holds ``context`` positions and room for ``positions`` more, written
    again on every repeat (static and graphs: the model's workspace for the grid's layout)."""
    from wfd.runtime import runner_for

    depth = model.config.depth
    runner = runner_for(model, mode=mode, record=record, prompt_len=context,
                        max_new_tokens=positions + 1, depth=depth, kv_sharing=0,
                        readout_depths=sorted({1, depth}))
    runner.cache.fill(context + positions)  # the same positions are written on every repeat
    return runner


@torch.inference_mode()
def time_call(model, name: str, kind: str, n: int, context: int, slots: int, grid: Grid,
              mode: str = "eager") -> CallSample:
    """Median time of one call of ``kind`` over n positions after ``context`` positions, the
    positions spread over ``slots`` distinct depths (B) or readout depths (C)."""
    depth = model.config.depth
    runner = _timed_runner(model, context, n, mode)
    positions = list(range(context, context + n))
    hidden = model.config.hidden_size
    param = next(model.parameters())
    state = torch.randn(n, hidden, dtype=param.dtype, device=param.device)
    e = torch.randn_like(state)
    tokens = [(7 * i) % model.config.vocab_size for i in range(n)]
    if kind == "block":
        # one depth, or a wave: each position at its own depth, oldest (deepest) first
        depths = [1] * n if slots == 1 else list(range(n, 0, -1))
        call = lambda: runner.block(state, e, positions, depths)  # noqa: E731
    elif kind == "coda":
        choices = sorted({1, depth})[:slots]
        depths = [choices[i % len(choices)] for i in range(n)]
        call = lambda: runner.coda(state, positions, depths)  # noqa: E731
    else:
        depths = [0] * n
        call = lambda: runner.prelude(tokens, positions)  # noqa: E731
    for _ in range(grid.warmup):
        call()
    runner.records.clear()
    for _ in range(grid.repeats):
        call()
    times = [r.wall_s for r in runner.records]
    median, spread = _median(times)
    record = runner.records[0].model_copy(update={"wall_s": median})
    return CallSample(model=name, record=record, median_s=median, spread_s=spread)


def warm_up(model, name: str, n: int, context: int, mode: str = "eager") -> None:
    """Touch every weight and warm the allocator before anything of the model is timed."""
    time_call(model, name, "block", n, context, 1,
              Grid(positions=[1], contexts=[1], repeats=1, warmup=3), mode)


def contexts_for(model, grid: Grid) -> list[int]:
    """The grid's contexts that leave room for the widest call within the model's positions."""
    room = model.config.max_position_embeddings - max(grid.positions) - 1
    return [c for c in grid.contexts if c <= room] or [min(grid.contexts)]


def call_grid(name: str, model, grid: Grid) -> list[tuple[str, int, int, int]]:
    depth = model.config.depth
    points = []
    # longest context first: its cache serves the shorter ones, so static and graphs modes
    # prepare each shape once (wfd.graphs: a longer cache would replace the workspace)
    for context in sorted(contexts_for(model, grid), reverse=True):
        for n in grid.positions:
            for slots in grid.slots_for(n, depth):
                points.append(("block", n, context, slots))
        points.append(("prelude", 1, context, 1))
        points.append(("prelude", max(grid.positions), context, 1))
        for n in (1, 2):
            points.append(("coda", n, context, n))
    return points


def measure_runs(name: str, model, prompt: list[int], new_tokens: int,
                 schedules: list[tuple[str, dict]], forced: float | None,
                 mode: str = "eager") -> list[RunSample]:
    """Whole runs with their call traces (forced acceptance on random weights); capture time
    (graphs mode) left out, as the decoder reports it."""
    from wfd.generate import generate

    out = []
    for schedule, kw in schedules:
        t0 = time.perf_counter()
        res = generate(model, prompt, schedule=schedule, max_new_tokens=new_tokens,
                       force_acceptance=forced if schedule != "ar" else None, mode=mode, **kw)
        out.append(RunSample(model=name, schedule=schedule,
                             draft_depth=kw.get("draft_depth"),
                             block_length=kw.get("block_length"), tokens=len(res.tokens),
                             wall_s=time.perf_counter() - t0 - res.stats.get("capture_s", 0.0),
                             records=res.records,
                             accept=res.acceptance_sequence()))
    return out
