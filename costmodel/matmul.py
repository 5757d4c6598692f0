"""Read a measured matrix-product curve (``specs.MatmulCurve``) at any size, row count, working
set and aspect: log time linear in log size (past the largest, the last slope; below the
smallest, its time), time linear in the rows (past the last, the last step per row), log time
linear in log working set (streamed from ``streamed_from_bytes`` on), row counts the curve did
not measure rounded up to its row block. Row counts broadcast, so the cost model's sweeps read
it too.
"""

from __future__ import annotations

import numpy as np

from .hardware import MatmulCurve


def _along_rows(table: np.ndarray, rows: np.ndarray, n: np.ndarray) -> np.ndarray:
    """table[size, rows] read at row counts n: (size, *n.shape)."""
    n = np.maximum(n, rows[0])
    inside = np.stack([np.interp(n, rows, line) for line in table])
    per_row = (table[:, -1] - table[:, -2]) / (rows[-1] - rows[-2])
    beyond = table[:, -1, None] + np.maximum(per_row, 0)[:, None] * (n.ravel() - rows[-1])
    return np.where(n > rows[-1], beyond.reshape(inside.shape), inside)


def _along_sizes(log_times: np.ndarray, log_sizes: np.ndarray, log_size: float) -> np.ndarray:
    """log times (size, ...) read at one log size."""
    i = int(np.clip(np.searchsorted(log_sizes, log_size) - 1, 0, len(log_sizes) - 2))
    weight = (log_size - log_sizes[i]) / (log_sizes[i + 1] - log_sizes[i])
    if weight < 0:  # below the smallest size: its time (a small product's is its dispatch)
        return log_times[0]
    if weight > 1:  # past the largest size: its time per byte, at least
        slope = np.maximum((log_times[i + 1] - log_times[i]) / (log_sizes[i + 1] - log_sizes[i]),
                           1.0)
        return log_times[i + 1] + slope * (log_size - log_sizes[i + 1])
    return log_times[i] + weight * (log_times[i + 1] - log_times[i])


_TABLES: dict[int, tuple] = {}


def _tables(curve: MatmulCurve) -> tuple:
    """(rows, log sizes, log working sets, seconds with NaN for none, log aspects, their
    streamed seconds with the square's among them): arrays made once per curve (the fit prices
    thousands of calls with one)."""
    hit = _TABLES.get(id(curve))
    if hit is not None and hit[0] is curve:
        return hit[1]
    seconds = np.array([[[np.nan if t is None else t for t in line] for line in table]
                        for table in curve.seconds])
    log_sets = np.log(curve.working_sets_bytes)
    if curve.streamed_from_bytes is not None:
        # the working sets from the first one that copies at memory speed are streamed: the
        # cached tables measured there drop out, and the streamed one starts there
        cached = log_sets[:-1] < np.log(curve.streamed_from_bytes)
        seconds = np.concatenate([seconds[:-1][cached], seconds[-1:]])
        log_sets = np.append(log_sets[:-1][cached],
                             min(np.log(curve.streamed_from_bytes), log_sets[-1]))
    aspects = sorted([(float(np.log(a)), np.asarray(t, dtype=float))
                      for a, t in zip(curve.aspects, curve.aspect_seconds, strict=True)]
                     + [(0.0, seconds[-1])], key=lambda pair: pair[0])
    arrays = (np.asarray(curve.rows, dtype=float), np.log(curve.matrix_bytes), log_sets, seconds,
              np.array([a for a, _ in aspects]), np.stack([t for _, t in aspects]))
    if len(_TABLES) > 64:
        _TABLES.clear()
    _TABLES[id(curve)] = (curve, arrays)
    return arrays


def _at_level(rows, log_sizes, table, n, log_size, streamed: bool = False):
    """Log seconds at one working set's table, or None when it holds no matrix this large (the
    streamed set, the last, prices any)."""
    held = ~np.isnan(table[:, 0])
    if not streamed and (held.sum() < 2 or log_size > log_sizes[held][-1] + np.log(2)):
        return None
    log_times = np.log(_along_rows(table[held], rows, n))
    return _along_sizes(log_times, log_sizes[held], log_size)


def _aspect_factor(curve: MatmulCurve, log_size: float, n: np.ndarray, aspect: float):
    """A product's time at this aspect (outputs over inputs) over the square one's."""
    rows, log_sizes, _, _, log_aspects, tables = _tables(curve)
    if len(log_aspects) < 2 or aspect == 1.0:
        return 1.0
    at = float(np.clip(np.log(aspect), log_aspects[0], log_aspects[-1]))
    i = int(np.clip(np.searchsorted(log_aspects, at) - 1, 0, len(log_aspects) - 2))
    weight = (at - log_aspects[i]) / (log_aspects[i + 1] - log_aspects[i])
    low, high, square = (_at_level(rows, log_sizes, tables[k], n, log_size, True)
                         for k in (i, i + 1, int(np.argmin(np.abs(log_aspects)))))
    return np.exp(low + weight * (high - low) - square)


def streams(curve: MatmulCurve, working_set_bytes: float) -> bool:
    """Whether products in this working set read their weights from memory, not a cache (where
    ``product_time_s`` reads the streamed table)."""
    return working_set_bytes > 0 and float(np.log(working_set_bytes)) >= _tables(curve)[2][-1]


def blocked_rows(curve: MatmulCurve, n: np.ndarray) -> np.ndarray:
    """The rows a product's kernels compute for ``n`` rows: the measured row counts as they are
    (each timed as it runs), any other rounded up to a whole number of the curve's row blocks."""
    if curve.row_block == 1:
        return n
    return np.where(np.isin(n, curve.rows), n, np.ceil(n / curve.row_block) * curve.row_block)


def product_time_s(curve: MatmulCurve, matrix_bytes: float, n_rows,
                   working_set_bytes: float | None = None, aspect: float = 1.0):
    """Seconds of one product of a ``matrix_bytes`` matrix over ``n_rows`` rows, in a working
    set of ``working_set_bytes`` (None: beyond every cache, streamed from memory), the matrix
    ``aspect`` times as many outputs as inputs."""
    rows, log_sizes, log_sets, table, _, _ = _tables(curve)
    n = np.asarray(n_rows, dtype=float)
    flat = blocked_rows(curve, n.reshape(-1))
    log_size = float(np.log(matrix_bytes))
    log_set = log_sets[-1] if working_set_bytes is None else float(
        np.log(max(working_set_bytes, matrix_bytes)))
    last = len(log_sets) - 1
    hi = int(np.clip(np.searchsorted(log_sets, log_set), 0, last))
    log_t = _at_level(rows, log_sizes, table[hi], flat, log_size, hi == last)
    if log_t is None:  # the matrix outgrows this set: the next larger that holds it
        log_t = next(t for t in (_at_level(rows, log_sizes, table[k], flat, log_size, k == last)
                                 for k in range(hi + 1, last + 1)) if t is not None)
    elif hi > 0 and log_set < log_sets[hi]:
        low = _at_level(rows, log_sizes, table[hi - 1], flat, log_size)
        if low is not None:
            weight = (log_set - log_sets[hi - 1]) / (log_sets[hi] - log_sets[hi - 1])
            log_t = low + weight * (log_t - low)
    out = np.exp(log_t) * _aspect_factor(curve, log_size, flat, aspect)
    return out.reshape(n.shape) if n.shape else float(out[0])


_PARTS: dict[int, tuple[MatmulCurve, dict]] = {}
_MEMO_MAX_ROWS = 4096  # row-count vectors up to this long are remembered
ROW_TABLE = 64  # whole row counts up to this are read from one table per call's products


def part_matmul_s(curve: MatmulCurve, matrices: list[tuple[tuple[int, int], int]], width: int,
                  n_rows, working_set_bytes: float | None):
    """Seconds of a call's matrix products: ``matrices`` is ((out, in), how many) pairs. Row
    counts up to ROW_TABLE are read from a table made once per curve, products and working set;
    a scalar or short vector of other row counts is remembered per curve (a fit prices the same
    calls hundreds of times); a sweep's long vectors are priced afresh."""
    if np.ndim(working_set_bytes) or np.size(n_rows) > _MEMO_MAX_ROWS:
        return _part_matmul_s(curve, matrices, width, n_rows, working_set_bytes)
    hit = _PARTS.get(id(curve))
    if hit is None or hit[0] is not curve:
        if len(_PARTS) > 64:
            _PARTS.clear()
        hit = _PARTS[id(curve)] = (curve, {})
    memo = hit[1]
    rows = np.asarray(n_rows, dtype=float)
    where = (tuple(matrices), width,
             None if working_set_bytes is None else float(working_set_bytes))
    if rows.size and np.all((rows >= 1) & (rows <= ROW_TABLE) & (rows == np.round(rows))):
        if where not in memo:
            memo[where] = np.broadcast_to(_part_matmul_s(  # 0.0 for a part without products
                curve, matrices, width, np.arange(1.0, ROW_TABLE + 1), working_set_bytes),
                (ROW_TABLE,))
        table = memo[where]
        return table[rows.astype(int) - 1] if rows.shape else float(table[int(rows) - 1])
    key = (*where, rows.shape, rows.tobytes())
    if key not in memo:
        memo[key] = _part_matmul_s(curve, matrices, width, n_rows, working_set_bytes)
    value = memo[key]
    return value.copy() if isinstance(value, np.ndarray) else value


def _part_matmul_s(curve: MatmulCurve, matrices: list[tuple[tuple[int, int], int]], width: int,
                   n_rows, working_set_bytes: float | None):
    total = 0.0
    for (out, inner), count in matrices:
        if out and inner and count:
            total = total + count * product_time_s(curve, out * inner * width, n_rows,
                                                   working_set_bytes, out / inner)
    return total
