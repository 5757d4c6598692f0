"""The profile store: where calibration profiles are found. The committed ones ship as package
data (``costmodel/data/profiles/``: CPU and GPU profiles of both families, each with its
validation plot), found by family and device kind; profiles made on a machine nobody calibrated
are kept in a cache directory; a machine is named as profiles record it. No torch: the GPU's
name comes from the decoder (wfd.runtime.machine_name)."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from pathlib import Path

from .errors import ProfileError
from .profile import CalibrationProfile, load_profile

PROFILES_DIR = Path(__file__).resolve().parent / "data" / "profiles"

# A machine's name as profiles record it, set by hand: a VM whose CPU reports a generic name,
# or a check of what a command does on a machine other than this one (the test suite's)
MACHINE_ENV = "LOOPED_DECODING_MACHINE"


def cpu_machine_name() -> str:
    """This CPU as profiles name it: its model name and the CPUs this process may use, or the
    name ``LOOPED_DECODING_MACHINE`` gives."""
    if named := os.environ.get(MACHINE_ENV, "").strip():
        return named
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cpus} CPUs"


def committed_profiles(family: str, device: str) -> Iterator[tuple[Path, CalibrationProfile]]:
    """(path, profile) of each committed calibration profile of a model family and this device
    kind (cpu, cuda), the default grid's before the quick one's."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    paths = [p for p in PROFILES_DIR.glob(f"*{family}*.json")
             if not p.name.endswith(".validation.json")]  # reports beside the profiles
    for path in sorted(paths, key=lambda p: "quick" in p.name):
        try:
            profile = load_profile(path)
        except ProfileError:
            continue
        if profile.device.split(":")[0] == kind:
            yield path, profile


def cache_dir() -> Path:
    """Where profiles made here are kept: $LOOPED_DECODING_CACHE, or looped-decoding/ in the
    user's cache directory ($XDG_CACHE_HOME, ~/.cache)."""
    own = os.environ.get("LOOPED_DECODING_CACHE")
    if own:
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "looped-decoding"
