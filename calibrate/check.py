"""Is a profile still this machine? Time a sample of the calls it was fitted and validated on.

A CPU profile prices its machine in the state it was in, which a shared VM changes from one
night to the next and its name ("AMD EPYC, 2 CPUs") cannot tell. The check times a few of the
profile's calls again as the calibration timed them and compares them with the stored times: a
median ratio near 1 says its predictions hold; far from 1, they are off by about that factor.
Per model the ratios say what moved: the tiny model's calls are host overhead, the large ones'
weight reads.
"""

from __future__ import annotations

import math
import statistics

from pydantic import BaseModel

from costmodel.profile import CalibrationProfile, ValidationPoint
from wfd.timing import Grid, Quiet, time_call, warm_up

from .validate import repeat_spread

# a check never calls a profile wrong for less than this, whatever its own repeats were
MIN_TOLERANCE = 0.10


class CheckedCall(BaseModel):
    label: str
    model: str
    profile_s: float
    now_s: float

    @property
    def ratio(self) -> float:
        return self.now_s / self.profile_s


class ProfileCheck(BaseModel):
    machine: str
    profile_machine: str
    threads: int | None
    calls: list[CheckedCall]
    # how far each of the profile's points ran apart between its own two passes (median):
    # the noise the profile was made in
    profile_repeat_spread: float
    tolerance: float

    @property
    def median_ratio(self) -> float:
        return statistics.median(c.ratio for c in self.calls)

    @property
    def holds(self) -> bool:
        return abs(math.log(self.median_ratio)) <= math.log1p(self.tolerance)

    def per_model(self) -> dict[str, list[float]]:
        ratios: dict[str, list[float]] = {}
        for call in self.calls:
            ratios.setdefault(call.model, []).append(call.ratio)
        return ratios


def call_points(profile: CalibrationProfile) -> list[ValidationPoint]:
    return [p for p in profile.training + profile.validation
            if p.kind == "call" and p.record is not None]


def sample_calls(profile: CalibrationProfile, count: int) -> list[ValidationPoint]:
    """``count`` of the profile's calls, spread over its models (each model's calls in order of
    their stored time, taken at even steps, so both its fastest and slowest are in)."""
    by_model: dict[str, list[ValidationPoint]] = {}
    for point in call_points(profile):
        by_model.setdefault(point.model, []).append(point)
    models = [m for m in profile.models if m in by_model] + [
        m for m in by_model if m not in profile.models]
    share, extra = divmod(count, len(models)) if models else (0, 0)
    chosen = []
    for i, model in enumerate(models):
        points = sorted(by_model[model], key=lambda p: p.measured_s)
        take = min(len(points), share + (i < extra))
        if take == 1:
            chosen.append(points[len(points) // 2])
        elif take:
            step = (len(points) - 1) / (take - 1)
            chosen += [points[round(j * step)] for j in range(take)]
    return chosen


def check_profile(profile: CalibrationProfile, count: int = 16, progress=None,
                  retries: int = 4) -> ProfileCheck:
    """Time ``count`` of the profile's calls here, with its device, dtype, threads and execution
    mode, and compare them with its stored times; a call timed while the machine was busy is
    timed again up to ``retries`` times (on a CPU)."""
    import torch

    from wfd.checkpoint import load_model
    from wfd.runtime import machine_name

    device = profile.device
    if profile.threads:
        torch.set_num_threads(profile.threads)
    points = sample_calls(profile, count)
    grid = Grid(positions=[1], contexts=[1], repeats=int(profile.grid.get("repeats", [7])[0]))
    mode = profile.hardware.mode
    cuda = device.startswith("cuda")
    quiet = Quiet(device, retries=0 if cuda else retries, budget_s=30.0)
    shapes = [(p.record.kind, len(p.record.positions), min(p.record.positions),
               len(p.record.slot_contexts())) for p in points]
    models = {}
    task = progress.add_task("loading the profile's models", total=2 * len(points)) \
        if progress else None
    for point, (_, n, context, _) in sorted(zip(points, shapes, strict=True),
                                            key=lambda ps: -ps[1][1] * ps[1][2]):
        if point.model not in models:  # its widest call first: every weight touched
            models[point.model] = load_model(point.model, device=device, dtype=profile.dtype)
            warm_up(models[point.model], point.model, n, context, point.mode or mode)
    # two passes, the second in reverse, each point kept at its faster: as it was calibrated
    best: dict[int, float] = {}
    for order in (range(len(points)), reversed(range(len(points)))):
        for i in order:
            point, (kind, n, context, slots) = points[i], shapes[i]
            if progress:
                progress.update(task, description=f"{point.model}: {point.label}")
            sample = quiet.measure(lambda c: c.median_s, time_call, models[point.model],
                                   point.model, kind, n, context, slots, grid,
                                   point.mode or mode)
            best[i] = min(best.get(i, math.inf), sample.median_s)
            if progress:
                progress.advance(task)
    # the calls' slowest over fastest pass, less 1 (median; 0 for a profile without repeats)
    calls = repeat_spread(call_points(profile))["per_call"]
    spread = calls["median_spread"] if calls else 0.0
    return ProfileCheck(
        machine=machine_name(device), profile_machine=profile.machine,
        threads=profile.threads,
        calls=[CheckedCall(label=p.label, model=p.model, profile_s=p.measured_s, now_s=best[i])
               for i, p in enumerate(points)],
        profile_repeat_spread=spread, tolerance=max(MIN_TOLERANCE, 2 * spread))

