"""Model and hardware presets: one JSON file per preset in ``costmodel/data/models`` and
``costmodel/data/hardware``, in the spec's own fields; a new preset is a new file.

A model file holds a public release's architecture (its derived parameter counts and KV bytes
are checked against the published figures in the tests) or a scaled-down shape of its family. A
hardware file holds a device's datasheet figures; its efficiencies and overheads are the spec's
priors, which `costmodel calibrate` replaces with measured ones.
"""

from __future__ import annotations

import functools
from pathlib import Path

from .hardware import HardwareSpec
from .model import LoopedModelSpec

DATA_DIR = Path(__file__).resolve().parent / "data"
SPECS = {"models": LoopedModelSpec, "hardware": HardwareSpec}


@functools.cache
def _preset(kind: str, name: str) -> LoopedModelSpec | HardwareSpec | None:
    """One preset, read and validated when first asked for (a prediction reads two files, not
    every preset's); None when there is no such file."""
    path = DATA_DIR / kind / f"{name}.json"
    return SPECS[kind].model_validate_json(path.read_text()) if path.is_file() else None


@functools.cache
def _presets(kind: str) -> dict:
    """Every preset of a kind: models by family and size, hardware by bandwidth (the order
    studies list them in)."""
    specs = [_preset(kind, path.stem) for path in (DATA_DIR / kind).glob("*.json")]
    key = ((lambda m: (m.family, m.num_params)) if kind == "models"
           else (lambda h: h.roofline.memory_bandwidth_bytes_per_s))
    return {spec.name: spec for spec in sorted(specs, key=key)}


def __getattr__(name: str) -> dict:
    """``MODELS`` and ``HARDWARE``, every preset by name, read on first use."""
    if name in ("MODELS", "HARDWARE"):
        return _presets(name.lower())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class UnknownPresetError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; a preset error should read plainly
        return str(self.args[0])


def _named(kind: str, name: str):
    spec = _preset(kind, name)
    if spec is None or spec.name != name:
        raise UnknownPresetError(f"unknown {kind.removesuffix('s')} {name!r}; known: "
                                 f"{', '.join(_presets(kind))}")
    return spec


def get_model(name: str) -> LoopedModelSpec:
    return _named("models", name)


def resolve(model: str | LoopedModelSpec, hardware: str | HardwareSpec
            ) -> tuple[LoopedModelSpec, HardwareSpec]:
    """The model and hardware a query names: a preset's name, or a spec as it is."""
    for value, spec, what in ((model, LoopedModelSpec, "model"), (hardware, HardwareSpec,
                                                                 "hardware")):
        if not isinstance(value, str | spec):
            raise TypeError(f"{what} must be a preset's name or a {spec.__name__}, got "
                            f"{type(value).__name__}")
    return (get_model(model) if isinstance(model, str) else model,
            get_hardware(hardware) if isinstance(hardware, str) else hardware)


def get_hardware(name: str) -> HardwareSpec:
    return _named("hardware", name)
