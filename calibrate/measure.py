"""Time the decoder's parts on this machine: the machine's peaks (memory and cache bandwidth,
matrix-product flops, the row count where matrix products switch to a blocked kernel); single P,
B and C calls over a grid of positions per
call, context lengths and distinct KV slots, for a list of models; and whole AR, DtV and WFD runs
with their call traces.

Timing discipline: warm-up calls, repeated calls, the median; CUDA events after a synchronize on
a GPU (wfd.runtime.Timer). Calls are timed at a given context by marking that many positions of
every slot valid (their contents do not change the time) and writing the call's positions again
on every repeat. On a shared machine another tenant's load comes and goes in spells: the
blocked-product switch is measured between canaries (``Quiet``) and again when one ran slow.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from costmodel.trace import CallRecord


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
    """What the fitted efficiencies are fractions of, and the library's blocked-product switch."""

    bandwidth_bytes_per_s: float  # a copy much larger than the cache
    flops_per_s: float  # a square matrix product (1024 on a CPU, 8192 on a GPU)
    cache_bytes: float  # the last-level cache
    cache_bandwidth_bytes_per_s: float  # a copy that fits in it
    blocked_gemm_rows: int  # the fewest rows a matrix product runs as a blocked kernel
    # CPU threads (None / 1.0 / None on a GPU, or with one thread): the fewest rows a blocked
    # product runs on every thread, the flops of one thread over all of them, and what each added
    # row of a thin product costs, as a fraction of ``flops_per_s``
    threaded_gemm_rows: int | None = None
    unthreaded_flops_fraction: float = 1.0
    thin_flops_efficiency: float | None = None


def cache_size_bytes(device: str) -> float:
    """The last-level cache: L2 of a GPU, the highest-level CPU cache sysfs lists."""
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
    return best or 8 * 2**20


def _best_time(fn, device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls, after one that warms up."""
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
    return min(times)


class Quiet:
    """Measurements taken while the machine is quiet. On a shared VM other tenants' load comes
    in spells that slow blocked matrix products most, so the canary is such a product, timed
    before and after each measurement; when either ran more than ``tolerance`` slower than the
    fastest canary so far, the measurement is taken again after a pause (at most ``retries``
    times, keeping the fastest), within ``budget_s`` of extra time over the calibration."""

    def __init__(self, device: str, tolerance: float = 1.2, retries: int = 4,
                 pause_s: float = 1.0, budget_s: float = float("inf")):
        self.device = torch.device(device)
        self.tolerance, self.retries, self.pause_s = tolerance, retries, pause_s
        self.budget_s = budget_s  # the most time spent on measurements taken again
        self.spent_s = 0.0
        self._weights = [torch.randn(2112, 768, device=self.device) for _ in range(8)]
        self._x = torch.randn(6, 768, device=self.device)
        self.best_s = float("inf")
        self.retried = 0  # measurements taken again

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
        best = None
        for attempt in range(self.retries + 1):
            t0 = time.perf_counter()
            before = self.canary()
            result = fn(*args)
            after = self.canary()
            if attempt:
                self.spent_s += time.perf_counter() - t0
            if best is None or seconds(result) < seconds(best):
                best = result
            if max(before, after) <= self.tolerance:
                break
            if attempt == self.retries or self.spent_s + self.pause_s >= self.budget_s:
                break
            self.retried += 1
            time.sleep(self.pause_s)
            self.spent_s += self.pause_s
        return best


def copy_bandwidth(device: str, dtype: str, nbytes: float, inner: int = 1) -> float:
    """Bytes per second read and written by copies of ``nbytes`` (best of five)."""
    import torch

    from wfd.checkpoint import DTYPES

    dev, dt = torch.device(device), DTYPES[dtype]
    src = torch.ones(int(nbytes) // dt.itemsize, dtype=dt, device=dev)
    dst = torch.empty_like(src)

    def copies() -> None:
        for _ in range(inner):
            dst.copy_(src)
    return 2 * inner * src.numel() * src.element_size() / _best_time(copies, dev, 5)


def memory_bandwidth(device: str, dtype: str = "fp32") -> float:
    """The device memory's copy bandwidth: a copy well beyond the last-level cache."""
    return copy_bandwidth(device, dtype, max(256 * 2**20, 8 * cache_size_bytes(device)))


def measure_peaks(device: str, dtype: str) -> Peaks:
    """Best-of-repeats timings of copies, a large product and products over 1..8 rows."""
    import torch

    from wfd.checkpoint import DTYPES

    dev = torch.device(device)
    dt = DTYPES[dtype]

    def best(fn, repeats: int = 5) -> float:
        return _best_time(fn, dev, repeats)

    cache = cache_size_bytes(device)
    bandwidth = memory_bandwidth(device, dtype)
    # source and copy fill half the cache
    cache_bandwidth = copy_bandwidth(device, dtype, cache / 4, 20)
    # a GPU needs a large product to approach its peak: 1024 is launch-bound on an H200 (about
    # 100 TFLOP/s of its 790)
    side = 8192 if dev.type == "cuda" else 1024
    a = torch.randn(side, side, device=dev).to(dt)
    flops = 2 * side**3 / best(lambda: a @ a)
    # Rows 1..8 against weights well beyond the cache: a library that runs a few rows as vector
    # products costs about n passes; the first n well below that is a blocked kernel.
    side = int((max(4 * cache, 64 * 2**20) / dt.itemsize) ** 0.5)
    weights = torch.randn(side, side, device=dev).to(dt)
    # A spell of load slows blocked products most and can move the switch: time while quiet
    # (a GPU is not shared: a slow canary there is launch jitter, not load, and is not retried).
    quiet = Quiet(device, budget_s=20.0, retries=0 if dev.type == "cuda" else 4)

    def rows_time(n: int) -> float:
        x = torch.ones(n, side, device=dev, dtype=dt)
        return quiet.measure(float, best, lambda: torch.nn.functional.linear(x, weights))

    one = rows_time(1)
    rows = next((n for n in range(2, 9) if rows_time(n) < 0.75 * n * one), 9)
    peaks = Peaks(bandwidth_bytes_per_s=bandwidth, flops_per_s=flops, cache_bytes=cache,
                  cache_bandwidth_bytes_per_s=cache_bandwidth, blocked_gemm_rows=rows)
    if dev.type == "cpu":
        _measure_threads(peaks, dt, quiet)
    return peaks


def _measure_threads(peaks: Peaks, dt: torch.dtype, quiet: Quiet) -> None:
    """Products from the blocked switch to 16 rows, and over 32 and 64, against weights that fit
    in the cache, so that flops rather than memory set their time: on every thread and on one.
    What 32 more rows cost (64 against 32) gives the flops of the decoder's thin products, on
    every thread and on one; where every thread starts to run clearly faster than one
    (``threaded_rows``) is where the library splits products over them."""
    import torch

    inner, side = 1024, 256
    while inner * side * 2 * dt.itemsize <= peaks.cache_bytes / 4:
        side *= 2
    weights = torch.randn(side, inner, dtype=dt)
    threads = torch.get_num_threads()

    def rows_time(n: int, on: int) -> float:
        x = torch.ones(n, inner, dtype=dt)
        torch.set_num_threads(on)
        try:
            return quiet.measure(float, _best_time, lambda: [
                torch.nn.functional.linear(x, weights) for _ in range(8)],
                torch.device("cpu"), 5) / 8
        finally:
            torch.set_num_threads(threads)

    def row_flops(on: int) -> float:
        return 2 * inner * side * 32 / max(rows_time(64, on) - rows_time(32, on), 1e-9)

    every = row_flops(threads)
    peaks.thin_flops_efficiency = min(every / peaks.flops_per_s, 1.0)
    if threads == 1:
        return
    rows = list(range(peaks.blocked_gemm_rows, 17))
    speed = [rows_time(n, threads) / rows_time(n, 1) for n in rows]
    switch = threaded_rows(rows, speed)
    if switch is not None:
        peaks.threaded_gemm_rows = switch
        peaks.unthreaded_flops_fraction = min(row_flops(1) / every, 1.0)


def threaded_rows(rows: list[int], speed: list[float], threshold: float = 0.85) -> int | None:
    """Where a library starts to split products over its threads, from the time on every
    thread over the time on one at each row count: the step that best splits them into a run
    near 1 and a faster run after it (a single timing on a shared VM is off by 10-30%, a step
    over a dozen is not). None when every thread is never clearly faster."""
    best, best_cost = None, float("inf")
    for i, n in enumerate(rows):
        before, after = speed[:i], speed[i:]
        level = statistics.median(after)
        if level >= threshold:
            continue
        cost = sum((r - 1) ** 2 for r in before) + sum((r - level) ** 2 for r in after)
        if cost < best_cost:
            best, best_cost = n, cost
    return best


def count_ops(model, kind: str) -> int:
    """Operations the decoder dispatches for one call of ``kind`` over one position (what the
    cost model counts as kernels: each pays the per-kernel overhead)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from wfd.runtime import Runner

    class Counter(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.ops += 1
            return func(*args, **(kwargs or {}))

    cache = _timed_cache(model, 8, 1, model.config.depth)
    runner = Runner(model, cache, record=False, mode="eager")  # the operations one call issues
    param = next(model.parameters())
    state = torch.zeros(1, model.config.hidden_size, dtype=param.dtype, device=param.device)
    calls = {"prelude": lambda: runner.prelude([1], [8]),
             "block": lambda: runner.block(state, state, [8], [1]),
             "coda": lambda: runner.coda(state, [8], [model.config.depth])}
    with torch.inference_mode(), Counter():
        calls[kind]()
    return Counter.ops


def decoder_kernels(models: list) -> tuple[int, dict[str, int]]:
    """(operations per transformer layer, operations per call of each part outside its layers)
    of this decoder, from op counts of models with different numbers of layers."""
    def layers(model, kind: str) -> int:
        cfg = model.config
        return {"prelude": cfg.prelude_layers, "block": cfg.core_layers,
                "coda": cfg.coda_layers}[kind]

    counts = {kind: [(layers(model, kind), count_ops(model, kind)) for model in models]
              for kind in ("prelude", "block", "coda")}
    blocks = sorted(set(counts["block"]))
    (l0, c0), (l1, c1) = blocks[0], blocks[-1]
    # with one layer count, the part's operations outside the layers are taken as the block's
    per_layer = round((c1 - c0) / (l1 - l0)) if l1 > l0 else round(c1 / (l1 + 1))
    extras = {kind: max(0, round(sum(c - layers * per_layer for layers, c in pairs)
                                 / len(pairs)))
              for kind, pairs in counts.items()}
    return per_layer, extras


def _median(times: list[float]) -> tuple[float, float]:
    qs = statistics.quantiles(times, n=4) if len(times) >= 4 else [min(times), 0, max(times)]
    return statistics.median(times), qs[2] - qs[0]


def _timed_cache(model, context: int, positions: int, depth: int):
    from wfd.generate import make_cache

    cache = make_cache(model, prompt_len=context, max_new_tokens=positions + 1, depth=depth,
                       kv_sharing=0, readout_depths=sorted({1, depth}))
    cache.fill(context + positions)  # the same positions are written on every repeat
    return cache


@torch.inference_mode()
def time_call(model, name: str, kind: str, n: int, context: int, slots: int, grid: Grid,
              mode: str = "eager") -> CallSample:
    """Median time of one call of ``kind`` over n positions after ``context`` positions, the
    positions spread over ``slots`` distinct depths (B) or readout depths (C)."""
    from wfd.runtime import Runner

    depth = model.config.depth
    cache = _timed_cache(model, context, n, depth)
    runner = Runner(model, cache, record=True, mode=mode)
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


def contexts_for(model, grid: Grid) -> list[int]:
    """The grid's contexts that leave room for the widest call within the model's positions."""
    room = model.config.max_position_embeddings - max(grid.positions) - 1
    return [c for c in grid.contexts if c <= room] or [min(grid.contexts)]


def call_grid(name: str, model, grid: Grid) -> list[tuple[str, int, int, int]]:
    depth = model.config.depth
    points = []
    for context in contexts_for(model, grid):
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
