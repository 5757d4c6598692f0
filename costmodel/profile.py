"""Calibration profiles: a fitted hardware spec plus where and how it was measured.

A profile is versioned JSON, written atomically. `costmodel predict --profile FILE` and
`costmodel study NAME --profile FILE` use its hardware spec. Profiles of an older schema load
through ``upgrade`` (in memory; `costmodel upgrade-profile` writes the result).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ProfileError  # noqa: F401 (importers name it here)
from .hardware import HardwareSpec
from .model import LoopedModelSpec
from .trace import CallRecord, atomic_write

# 2: measured kernel counts, cache, blocked products, p-norm; 3: CPU threads' regime, measured
# thin-product flops, per-product latencies, cached vector products read once per row; 4: a
# smaller hardware spec (a CPU's products a measured curve), coefficients the calls do not
# determine taken out, the load the calibration ran under; 5: the hardware spec in parts
# (roofline, host, graphs, operations, cpu)
PROFILE_SCHEMA_VERSION = 5


class FittedValue(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    value: float
    stderr: float = Field(description="one standard error of the fit (0 for a measured value)")
    unit: str


class HeldValue(BaseModel):
    """A coefficient the fit took out: dropped (an overhead term, 0) or held at a prior (a
    fraction: the term it prices is not calibrated)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    value: float
    prior: bool
    reason: str


class LoadReport(BaseModel):
    """How busy the machine was while it was measured (the canary product around every
    measurement, over the fastest canary seen)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    measurements: int
    retaken_fraction: float
    loaded_fraction: float  # kept measurements whose canary still ran over the tolerance
    canary_tolerance: float
    canary_median: float
    canary_p90: float
    canary_p10: float | None = None  # None: a profile made before the spread was kept
    forced: bool = False  # written with --force although the machine was too busy


class ValidationPoint(BaseModel):
    """A measurement the fit did not use: a call, or a whole run's decode time per token."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    kind: Literal["call", "run"]
    model: str
    spec: LoopedModelSpec
    label: str
    group: str  # "block", "prelude", "coda" for calls; "ar", "dtv", "wfd" for runs
    measured_s: float  # a call's median time, or a run's decode time per token
    wall_per_token_s: float | None = None  # a run's plain wall time per token (measured_s: robust)
    record: CallRecord | None = None
    draft_depth: int | None = None
    block_length: int | None = None
    prompt_length: int | None = None
    tokens: int | None = None
    depth: int | None = None
    accept: list[bool] | None = None
    # the decoder's execution mode it ran in (None: the profile's hardware's)
    mode: Literal["eager", "graphs"] | None = None
    # every measurement taken of the point (a call's median in each pass over the grid, a
    # run's figure in each round); measured_s is the least. How far apart they are is how well
    # the machine repeated itself in that hour: the floor under the point's error.
    repeats_s: list[float] | None = None


class CrossModeCheck(BaseModel):
    """A held-out test across execution modes: the hardware fitted on one mode's calls alone,
    pricing the other mode's calls and runs (its host terms where the first mode leaves them)."""

    model_config = ConfigDict(extra="forbid", defer_build=True)
    fit_on: Literal["eager", "graphs"]
    predicted: Literal["eager", "graphs"]
    # median and max |relative error| and the point count, over calls and per decoded token
    per_call: dict[str, float | int] | None = None
    per_token: dict[str, float | int] | None = None
    # the coefficients the first mode's calls did not determine, and why
    held: dict[str, str] = Field(default_factory=dict)


class CalibrationProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", defer_build=True)
    schema_version: int = PROFILE_SCHEMA_VERSION
    created: str
    hardware: HardwareSpec
    machine: str
    device: str
    torch_version: str
    dtype: str
    # the CPU threads the decoder ran on (torch's intra-op threads; None: a GPU, or a profile
    # made before they were recorded). On a CPU they change which matrix-product kernels run.
    threads: int | None = None
    commit: str
    models: list[str]
    grid: dict[str, list[float | int | str]]
    coefficients: dict[str, FittedValue]
    held: dict[str, HeldValue] = Field(default_factory=dict)
    # what the calibration checked of its measurements, and what it decided
    checks: list[str] = Field(default_factory=list)
    load: LoadReport | None = None
    fit_stats: dict[str, float]
    # the calls the fit used, so that a profile can be refitted without measuring again
    training: list[ValidationPoint] = Field(default_factory=list)
    validation: list[ValidationPoint] = Field(default_factory=list)
    # a profile fitted on both execution modes (calibrate.modes): each fitted on one, priced on
    # the other
    cross_mode: list[CrossModeCheck] = Field(default_factory=list)


def save_profile(profile: CalibrationProfile, path: str | Path) -> None:
    atomic_write(path, profile.model_dump_json(indent=2) + "\n")


# Schema 3 hardware fields schema 4 does not have: a CPU's matrix-product formula (now a measured
# curve), the p-norm, the stream latency, the cache (now measured as a knee, for the curve)
_SCHEMA3_ONLY = ("roofline_exponent", "blocked_gemm_rows", "gemv_row_passes",
                 "blocked_gemm_weight_passes", "gemv_row_exponent", "blocked_gemm_latency_s",
                 "threaded_gemm_rows", "unthreaded_flops_fraction", "layer_stream_latency_s",
                 "cache_bytes", "cache_bandwidth_bytes_per_s")
_SCHEMA3_MEASURED_ONLY = ("cache_bandwidth", "cache_size", "blocked_gemm_rows",
                          "threaded_gemm_rows", "unthreaded_flops_fraction")


def upgrade(raw: dict, path: str | Path) -> dict:
    """A profile of an older schema as the current one reads it, or a ProfileError that says
    why it cannot be. Schema 4's hardware, field by field, is grouped into its parts when it is
    read (HardwareSpec takes either form). Schema 3 GPU profiles convert and price every point
    as they did (their GPU calls never depended on the CPU-only terms); a schema 3 CPU profile's
    matrix products were a fitted formula that a measured curve replaces: it must be calibrated
    again."""
    version = raw.get("schema_version")
    if version == 4:
        if not isinstance(raw.get("hardware"), dict):
            raise ProfileError(f"profile {path} is corrupt (schema 4, without its hardware)")
        return {**raw, "schema_version": PROFILE_SCHEMA_VERSION}
    if version != 3:
        raise ProfileError(f"profile {path} has schema version {version!r}; this version reads "
                           f"{PROFILE_SCHEMA_VERSION} and converts 4 and 3 (recalibrate with "
                           "`costmodel calibrate`)")
    hardware = raw.get("hardware")
    if not isinstance(hardware, dict) or not isinstance(raw.get("coefficients", {}), dict):
        raise ProfileError(f"profile {path} is corrupt (schema 3, without its hardware)")
    hardware = dict(hardware)
    if not hardware.get("overhead_overlaps", False):
        raise ProfileError(f"profile {path} is a schema 3 CPU profile: its matrix products were "
                           "a fitted formula that schema 4 measures instead; recalibrate with "
                           "`costmodel calibrate`")
    for name in _SCHEMA3_ONLY:
        hardware.pop(name, None)
    coefficients, held = {}, {}
    for name, c in (raw.get("coefficients") or {}).items():
        measured = str(c.get("unit", "")).endswith("(measured)")
        if name in _SCHEMA3_ONLY or (measured and name in _SCHEMA3_MEASURED_ONLY):
            continue
        stderr, value = c.get("stderr"), c.get("value", 0.0)
        why = None
        # schema 3 read a direction the calls do not constrain as an exact standard error
        if not measured and (stderr is None or abs(stderr) <= 1e-4 * abs(value)):
            why = "not determined by the calls"
        elif not measured and abs(stderr) > abs(value):
            why = f"its standard error was {abs(stderr / value):.0%} of its value"
        if why:
            held[name] = {"value": value, "prior": True,
                          "reason": f"{why} (schema 3 fit): held at {value:.4g}"}
        else:
            coefficients[name] = {**c, "stderr": stderr or 0.0}
    return {**raw, "schema_version": PROFILE_SCHEMA_VERSION, "hardware": hardware,
            "coefficients": coefficients, "held": held}


def load_profile(path: str | Path) -> CalibrationProfile:
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):  # a binary file: not text either
        raise ProfileError(f"profile {path} is not valid JSON") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"profile {path} is not a profile (not a JSON object)")
    if "schema_version" not in raw:  # a validation report, a trace's header, a config
        raise ProfileError(f"{path} is not a calibration profile (it has no schema_version)")
    if raw.get("schema_version") != PROFILE_SCHEMA_VERSION:
        raw = upgrade(raw, path)
    try:
        return CalibrationProfile.model_validate(raw)
    except ValidationError as exc:
        raise ProfileError(f"profile {path} is corrupt ({exc.error_count()} invalid fields)") \
            from None
