"""One GPU calibrated in both execution modes, and validated across them.

    costmodel join-modes gpu-huginn-bf16.json gpu-huginn-bf16-graphs.json \
        --out gpu-huginn-bf16-modes.json

An eager decoder on a GPU is host-bound: its calls price the host's dispatch and hide the
device. Replayed from CUDA graphs, the same calls price the device. Fitted together (one
hardware spec pricing every call in the mode it ran in: the device's coefficients shared, each
mode its own host terms, ``calibrate.fit.MODE_TERMS``), what one mode hides the other
determines. The joint profile answers `costmodel predict --mode eager|graphs` from the same
fit.

Cross-mode validation is the held-out test of that split: the hardware fitted on one mode's calls
alone (with the measured peaks; the other mode's host terms at their priors) prices the other
mode's calls and runs. A device coefficient that one mode cannot see shows up there as an error,
not as a fit.
"""

from __future__ import annotations

from datetime import datetime, timezone

from costmodel.profile import CalibrationProfile, CrossModeCheck, ProfileError, ValidationPoint
from costmodel.specs import HardwareSpec

from .fit import MODE_TERMS, PARAMETERS, Observation, fit
from .validate import report

MODES = tuple(MODE_TERMS)


def marked(points: list[ValidationPoint], mode: str) -> list[ValidationPoint]:
    """The points, each marked with the mode it ran in (a per-mode profile leaves it unset)."""
    return [p if p.mode else p.model_copy(update={"mode": mode}) for p in points]


def observations(points: list[ValidationPoint]) -> list[Observation]:
    return [Observation(model=p.spec, record=p.record, seconds=p.measured_s, mode=p.mode)
            for p in points if p.kind == "call"]


def with_priors(hw: HardwareSpec) -> HardwareSpec:
    """``hw``'s measurements (peaks, kernel counts) with every fitted coefficient at its prior:
    a fit on one mode then owes nothing to the other mode's fit."""
    return hw.model_copy(update={p[0]: p[3] for p in PARAMETERS if p[0] != "matmul_time_scale"})


def check_pair(profiles: dict[str, CalibrationProfile]) -> None:
    if set(profiles) != set(MODES):
        raise ProfileError("join-modes needs one eager and one graphs profile of the same GPU")
    eager, graphs = profiles["eager"], profiles["graphs"]
    if eager.hardware.matmul is not None:
        raise ProfileError("join-modes joins GPU profiles; a CPU runs eagerly only")
    for field in ("machine", "device", "dtype"):
        if getattr(eager, field) != getattr(graphs, field):
            raise ProfileError(f"the two profiles differ in {field}: {getattr(eager, field)!r} "
                               f"and {getattr(graphs, field)!r}")
    for profile in profiles.values():
        if not any(p.kind == "call" for p in profile.training):
            raise ProfileError(f"the {profile.hardware.mode} profile holds no training calls")


def cross_mode(base: HardwareSpec, calls: dict[str, list[Observation]],
               points: dict[str, list[ValidationPoint]], fit_on: str, predicted: str,
               dtype: str) -> CrossModeCheck:
    """Fit on ``fit_on``'s training ``calls`` alone; price all of ``predicted``'s ``points``."""
    result = fit(base.in_mode(fit_on), calls[fit_on], dtype)
    held = dict(result.dropped)
    held.update({name: f"not in the {fit_on} calls: its prior"
                 for name in MODE_TERMS[predicted]})
    rep = report(points[predicted], result.hardware, dtype)
    return CrossModeCheck(fit_on=fit_on, predicted=predicted, per_call=rep.per_call,
                          per_token=rep.per_token, held=held)


def join_modes(eager: CalibrationProfile, graphs: CalibrationProfile) -> CalibrationProfile:
    """The two profiles' calls fitted together, with both cross-mode checks."""
    profiles = {eager.hardware.mode: eager, graphs.hardware.mode: graphs}
    check_pair(profiles)
    eager, graphs = profiles["eager"], profiles["graphs"]
    training = {mode: marked(p.training, mode) for mode, p in profiles.items()}
    validation = {mode: marked(p.validation, mode) for mode, p in profiles.items()}
    # one observation per training call, shared by the three fits (each prices them thousands
    # of times, from features worked out once per observation)
    calls = {mode: observations(training[mode]) for mode in MODES}
    base = with_priors(eager.hardware).in_mode("eager")
    result = fit(base, calls["eager"] + calls["graphs"], eager.dtype)
    measured = {k: v for k, v in eager.coefficients.items() if v.unit.endswith("(measured)")}
    checks = list(dict.fromkeys(eager.checks + graphs.checks))
    checks.append(f"fitted on both modes: {len(calls['eager'])} eager and "
                  f"{len(calls['graphs'])} graphs calls, the device's coefficients shared")
    every = {mode: training[mode] + validation[mode] for mode in MODES}
    return eager.model_copy(update={
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": result.hardware,
        "coefficients": {**result.coefficients(), **measured},
        "held": result.held(),
        "checks": checks,
        "fit_stats": result.stats(),
        "grid": {**eager.grid, "modes": list(MODES)},
        "training": training["eager"] + training["graphs"],
        "validation": validation["eager"] + validation["graphs"],
        "cross_mode": [cross_mode(base, calls, every, a, b, eager.dtype)
                       for a, b in (("eager", "graphs"), ("graphs", "eager"))],
    })
