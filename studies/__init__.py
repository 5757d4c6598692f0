"""Design-space studies built on the cost model: `costmodel study NAME` or `studies.run(NAME)`.

Each study writes a table (CSV and Markdown) and a figure (PNG) into an output folder.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from costmodel.hardware import HardwareSpec

from .common import StudyResult, write_outputs

# each study's module: its name with "_" for "-"
STUDIES = ("paper-table", "dtv-block-length", "width", "hardware", "context", "batch", "memory",
           "overhead", "recommend", "adaptive-depth", "serving", "placement")


def run(name: str, *, profile: HardwareSpec | None = None, out: str | Path | None = None,
        small: bool = False) -> tuple[StudyResult, dict[str, str]]:
    """Run study ``name``; write its outputs into ``out`` when given."""
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; known: {', '.join(STUDIES)}")
    module = import_module(f".{name.replace('-', '_')}", __name__)
    gpu_only = getattr(module, "GPU_ONLY", None)  # what the study prices that a CPU has not
    if gpu_only and profile is not None and profile.cpu is not None:
        raise ValueError(f"study {name} prices {gpu_only}, and {profile.name} is a CPU: give "
                         "a GPU's profile, or none (the GPU presets)")
    result = module.run(profile=profile, small=small)
    paths = write_outputs(result, out) if out is not None else {}
    return result, paths


__all__ = ["STUDIES", "StudyResult", "run"]
