"""Time the decoder on this machine for a calibration: single P, B and C calls over a grid of
positions per call, context lengths and distinct KV slots, for a list of models, and whole AR,
DtV and WFD runs with their call traces (one call's timing and the timing discipline:
wfd.timing; the machine's peaks: calibrate.machine).
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from costmodel.trace import CallRecord
from wfd.timing import Grid


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


QUICK = Grid(positions=[1, 2, 3, 4, 8, 16, 32], contexts=[64, 256, 1024], repeats=5)
# 5 on the default grid: DtV's verification width at k = 4, and the first row count MKL threads
FULL = Grid(positions=[1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32], contexts=[64, 512, 2048], repeats=7)


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
