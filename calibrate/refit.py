"""Fit a profile's stored calls again with this version's cost model, without measuring again.

    costmodel refit costmodel/data/profiles/gpu-huginn-bf16.json --out gpu-huginn-bf16.json

When the cost model gains a term, a profile made before it is fitted again from the calls it
kept: the measurements (peaks, kernel counts, a CPU's product curve) stay, every fitted
coefficient restarts from its prior, and the held-out points are priced with the new fit (both
modes together, with their cross-mode checks, for a joint profile).
"""

from __future__ import annotations

from datetime import datetime, timezone

from costmodel.hardware import HardwareSpec
from costmodel.profile import CalibrationProfile, CrossModeCheck, FittedValue, ValidationPoint
from costmodel.trace import current_commit

from .fit import MICROBENCHMARKS, MODE_TERMS, Observation, fit, parameters_for
from .machine import streamed_start
from .validate import report


def observations(points: list[ValidationPoint]) -> list[Observation]:
    return [Observation(model=p.spec, record=p.record, seconds=p.measured_s, mode=p.mode)
            for p in points if p.kind == "call"]


def with_priors(hw: HardwareSpec, coefficients: dict[str, FittedValue] | None = None
                ) -> HardwareSpec:
    """``hw``'s measurements (peaks, kernel counts, curve) with every fitted coefficient at its
    prior, or at what a microbenchmark among the profile's ``coefficients`` measured for it: a
    refit owes nothing to the fit it replaces, and a fit on one mode nothing to the other
    mode's."""
    start = {p.name: p.start for p in parameters_for(hw, list(MODE_TERMS))}
    start.update({name: coefficients[key].value for key, name in MICROBENCHMARKS.items()
                  if coefficients and key in coefficients})
    return hw.with_terms(**start)


def with_streamed_start(hw: HardwareSpec, coefficients: dict[str, FittedValue]) -> HardwareSpec:
    """``hw`` with its curve's ``streamed_from_bytes`` where a profile made before it was kept
    has none, from its measured cache knee."""
    knee = coefficients.get("cache_knee")
    if hw.cpu is None or hw.cpu.matmul.streamed_from_bytes is not None or not knee:
        return hw
    curve = hw.cpu.matmul.model_copy(update={"streamed_from_bytes": streamed_start(knee.value)})
    return hw.with_terms(matmul=curve)


def marked(points: list[ValidationPoint], mode: str) -> list[ValidationPoint]:
    """The points, each marked with the mode it ran in (a per-mode profile leaves it unset)."""
    return [p if p.mode else p.model_copy(update={"mode": mode}) for p in points]


def by_mode(points: list[ValidationPoint]) -> dict[str, list[ValidationPoint]]:
    """Marked points grouped by their mode, in MODE_TERMS order."""
    return {m: mine for m in MODE_TERMS if (mine := [p for p in points if p.mode == m])}


def cross_mode(base: HardwareSpec, calls: dict[str, list[Observation]],
               points: dict[str, list[ValidationPoint]], fit_on: str, predicted: str,
               dtype: str) -> CrossModeCheck:
    """Fit on ``fit_on``'s training ``calls`` alone; price all of ``predicted``'s ``points``."""
    result = fit(base.in_mode(fit_on), calls[fit_on], dtype)
    held = dict(result.dropped)
    held.update({name: f"not in the {fit_on} calls: its starting value (a microbenchmark's "
                       "where the profile has one, else its prior)"
                 for name in MODE_TERMS[predicted]})
    rep = report(points[predicted], result.hardware, dtype)
    return CrossModeCheck(fit_on=fit_on, predicted=predicted, per_call=rep.per_call,
                          per_token=rep.per_token, held=held)


def refit(profile: CalibrationProfile, note: str | None = None) -> CalibrationProfile:
    """The profile with its coefficients fitted again on its training calls (both modes
    together when it holds both, with the cross-mode checks); ``note``: the line its checks
    gain (default: when, by which commit, from how many calls)."""
    own = profile.hardware.mode
    training = by_mode(marked(profile.training, own))
    modes = list(training)
    # one observation per training call, shared by the fits (each prices them thousands of
    # times, from features worked out once per observation)
    calls = {m: observations(points) for m, points in training.items()}
    if not any(calls.values()):
        raise ValueError("the profile keeps no training calls (made before they were kept); "
                         "calibrate again")
    base = with_priors(with_streamed_start(profile.hardware, profile.coefficients),
                       profile.coefficients).in_mode(modes[0])
    result = fit(base, [o for m in modes for o in calls[m]], profile.dtype)
    measured = {k: v for k, v in profile.coefficients.items() if v.unit.endswith("(measured)")}
    checks = [c for c in profile.checks if not c.startswith("refitted ")]
    checks.append(note or (
        f"refitted {datetime.now(timezone.utc):%Y-%m-%d} by commit {current_commit()} from its "
        f"{sum(len(c) for c in calls.values())} training calls"))
    checks_cross = []
    if len(modes) == 2:
        validation = by_mode(marked(profile.validation, own))
        every = {m: training[m] + validation.get(m, []) for m in modes}
        checks_cross = [cross_mode(base, calls, every, a, b, profile.dtype)
                        for a, b in (modes, modes[::-1])]
    return profile.model_copy(update={
        "hardware": result.hardware,
        "coefficients": {**result.coefficients(), **measured},
        "held": result.held(),
        "checks": checks,
        "fit_stats": result.stats(),
        "cross_mode": checks_cross,
    })
