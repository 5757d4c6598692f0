"""Timing the decoder on a shared machine: repeated timed calls (synchronized on a GPU);
``Quiet``, which brackets every measurement on a CPU by a canary product and takes it again when
one ran slow (another tenant's load comes and goes in spells); and one call's median time
(``time_call``), as a calibration (calibrate) and a rescaled profile (wfd.transplant) time them.

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


class CallSample(BaseModel):
    """One grid point: the median time of a call shape, with the record the cost model prices."""

    model_config = ConfigDict(extra="forbid")
    model: str
    record: CallRecord
    median_s: float
    spread_s: float  # interquartile range of the repeats


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
