"""Time the decoder on this machine: single P, B and C calls over a grid of positions per call,
context lengths and distinct KV slots, for a list of models, and whole AR, DtV and WFD runs with
their call traces (the machine's peaks: calibrate.machine; timing discipline: calibrate.timing).

Calls are timed at a given context by marking that many positions of every slot valid (their
contents do not change the time) and writing the call's positions again on every repeat: warm-up
calls, repeated calls, the median; CUDA events after a synchronize on a GPU (wfd.runtime.Timer).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

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


def call_grid(model, grid: Grid) -> list[tuple[str, int, int, int]]:
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
                       force_acceptance=forced, mode=mode, **kw)  # AR verifies nothing
        out.append(RunSample(model=name, schedule=schedule,
                             draft_depth=kw.get("draft_depth"),
                             block_length=kw.get("block_length"), tokens=len(res.tokens),
                             wall_s=time.perf_counter() - t0 - res.stats.get("capture_s", 0.0),
                             records=res.records,
                             accept=res.acceptance_sequence()))
    return out
