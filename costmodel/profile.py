"""Calibration profiles: a fitted hardware spec plus where and how it was measured.

A profile is versioned JSON, written atomically. `costmodel predict --profile FILE` and
`costmodel study NAME --profile FILE` use its hardware spec.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .specs import HardwareSpec, LoopedModelSpec
from .trace import CallRecord, atomic_write_text

# 2: measured kernel counts, cache, blocked products, p-norm; 3: CPU threads' regime, measured
# thin-product flops, per-product latencies, cached vector products read once per row
PROFILE_SCHEMA_VERSION = 3


class ProfileError(ValueError):
    """A profile that is missing, corrupt, or of another schema version."""


class FittedValue(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: float
    stderr: float | None = Field(description="one standard error of the fit; None: not "
                                             "determined (no training call depends on it)")
    unit: str


class ValidationPoint(BaseModel):
    """A measurement the fit did not use: a call, or a whole run's decode time per token."""

    model_config = ConfigDict(extra="forbid")
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


class CalibrationProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")
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
    fit_stats: dict[str, float]
    # the calls the fit used, so that a profile can be refitted without measuring again
    training: list[ValidationPoint] = Field(default_factory=list)
    validation: list[ValidationPoint] = Field(default_factory=list)


def save_profile(profile: CalibrationProfile, path: str | Path) -> None:
    atomic_write_text(path, profile.model_dump_json(indent=2) + "\n")


def load_profile(path: str | Path) -> CalibrationProfile:
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
    except json.JSONDecodeError:
        raise ProfileError(f"profile {path} is not valid JSON") from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != PROFILE_SCHEMA_VERSION:
        raise ProfileError(f"profile {path} has schema version {version!r}; this version reads "
                           f"{PROFILE_SCHEMA_VERSION} (recalibrate with `costmodel calibrate`)")
    try:
        return CalibrationProfile.model_validate(raw)
    except ValidationError as exc:
        raise ProfileError(f"profile {path} is corrupt ({exc.error_count()} invalid fields)") \
            from None
