"""Model and hardware presets: data files in ``costmodel/data/models`` and
``costmodel/data/hardware``, one JSON object per preset in the spec's own fields.

A model file holds the architecture of a public release (parameter counts and KV bytes are
derived by ``LoopedModelSpec`` and checked against the published figures in the tests) or a
scaled-down shape of its family. A hardware file holds a device's datasheet figures (dense
matrix flops) and says that a GPU launches asynchronously (its overheads overlap the device's
work); its efficiencies and overheads are the spec's priors (70-93% of peak bandwidth is
achievable; 4-6 us per launch on a fast host), which `costmodel calibrate` replaces with
measured ones. A new preset is a new file.
"""

from __future__ import annotations

from pathlib import Path

from .specs import HardwareSpec, LoopedModelSpec

DATA_DIR = Path(__file__).resolve().parent / "data"


def _load(kind: str, spec):
    return [spec.model_validate_json(path.read_text())
            for path in sorted((DATA_DIR / kind).glob("*.json"))]


# models by family and size; hardware by bandwidth (the order studies list them in)
MODELS: dict[str, LoopedModelSpec] = {
    m.name: m for m in sorted(_load("models", LoopedModelSpec),
                              key=lambda m: (m.family, m.num_params))}
HARDWARE: dict[str, HardwareSpec] = {
    h.name: h for h in sorted(_load("hardware", HardwareSpec),
                              key=lambda h: h.memory_bandwidth_bytes_per_s)}


class UnknownPresetError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; a preset error should read plainly
        return str(self.args[0])


def get_model(name: str) -> LoopedModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownPresetError(
            f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def get_hardware(name: str) -> HardwareSpec:
    try:
        return HARDWARE[name]
    except KeyError:
        raise UnknownPresetError(
            f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}") from None
