"""Timing on a shared machine: repeated timed calls (synchronized on a GPU), and ``Quiet``, which
brackets every measurement on a CPU by a canary product and takes it again when one ran slow
(another tenant's load comes and goes in spells)."""

from __future__ import annotations

import statistics
import time

import torch


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
