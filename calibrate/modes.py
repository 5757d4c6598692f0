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
