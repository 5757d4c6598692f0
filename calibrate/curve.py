"""A CPU's matrix-product curve: the time of one product against its rows, its size and the
working set it runs in, and the row block of the kernels (where a product's time steps up), timed
as the decoder's products run."""

from __future__ import annotations

import math
import statistics

import torch

from costmodel.hardware import MatmulCurve
from wfd.timing import Quiet, _median_time

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


def median_over_passes(lines: list, passes: int) -> list[list[float]]:
    """Each of ``lines`` (callables returning a line of times) timed once per pass, a whole pass
    apart; each point the median of its passes. On a shared machine a spell of another tenant's
    load lasts seconds (``bench/machine_noise.py`` shows them), longer than a line: it slows a
    run of consecutive lines in one pass, and the median of three passes drops it where a single
    pass would keep it."""
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
    in chains of square matrices, and streamed at the aspects ``CURVE_ASPECTS`` (a library runs
    wide and tall products at other speeds than square ones: ``bench/matmul_paths.py --cold``).
    Each line (one chain's times over the rows) is timed in ``passes`` passes over all the lines
    (``median_over_passes``); each point is the median of its passes, each pass's the median of
    three chains. A time outside what physics allows (below a single row's, or above one product
    per row) is taken again, and held within those bounds if it stays outside."""
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
    row, or the changes are noise."""
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
    (``staircase_block``). One shape's staircase is as noisy as the machine; the mean of four
    is steadier than any one."""
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
