"""One GPU calibrated in both execution modes, and validated across them.

    costmodel join-modes gpu-huginn-bf16.json gpu-huginn-bf16-graphs.json \
        --out gpu-huginn-bf16-modes.json

Eager calls price the host's dispatch and hide the device; replayed graphs price the device. One
fit of both answers `costmodel predict --mode eager|graphs`. Cross-mode validation is its
held-out test: fitted on one mode alone, the hardware prices the other mode's calls, so a device
coefficient one mode cannot see shows up as an error, not as a fit (docs/calibration.md).
"""

from __future__ import annotations

from datetime import datetime, timezone

from costmodel.profile import CalibrationProfile, ProfileError

from .fit import MODE_TERMS
from .refit import marked, refit

MODES = tuple(MODE_TERMS)


def check_pair(profiles: dict[str, CalibrationProfile]) -> None:
    if set(profiles) != set(MODES):
        raise ProfileError("join-modes needs one eager and one graphs profile of the same GPU")
    eager, graphs = profiles["eager"], profiles["graphs"]
    if eager.hardware.cpu is not None:
        raise ProfileError("join-modes joins GPU profiles; a CPU runs eagerly only")
    for field in ("machine", "device", "dtype"):
        if getattr(eager, field) != getattr(graphs, field):
            raise ProfileError(f"the two profiles differ in {field}: {getattr(eager, field)!r} "
                               f"and {getattr(graphs, field)!r}")
    for profile in profiles.values():
        if not any(p.kind == "call" for p in profile.training):
            raise ProfileError(f"the {profile.hardware.mode} profile holds no training calls")


def join_modes(eager: CalibrationProfile, graphs: CalibrationProfile) -> CalibrationProfile:
    """The two profiles' calls fitted together, with both cross-mode checks."""
    profiles = {eager.hardware.mode: eager, graphs.hardware.mode: graphs}
    check_pair(profiles)
    eager, graphs = profiles["eager"], profiles["graphs"]
    merged = eager.model_copy(update={
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "checks": list(dict.fromkeys(eager.checks + graphs.checks)),
        "grid": {**eager.grid, "modes": list(MODES)},
        "training": marked(eager.training, "eager") + marked(graphs.training, "graphs"),
        "validation": marked(eager.validation, "eager") + marked(graphs.validation, "graphs"),
    })
    counts = {m: sum(p.kind == "call" for p in profiles[m].training) for m in MODES}
    return refit(merged, note=f"fitted on both modes: {counts['eager']} eager and "
                              f"{counts['graphs']} graphs calls, the device's coefficients shared")
