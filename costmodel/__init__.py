"""Analytical cost model and event simulator for decoding looped language models.

Imports nothing heavy: no torch, and scipy/matplotlib only inside the functions that need them.
The names below load on first use, so a command imports only the modules it runs.
"""

import importlib
import sys
import types

# name -> the module that defines it
_EXPORTS = {
    "Prediction": "predict", "ScheduleResult": "predict", "predict": "predict", "sweep": "predict",
    "get_hardware": "presets", "get_model": "presets", "MODELS": "presets", "HARDWARE": "presets",
    "Choice": "recommend", "recommend": "recommend",
    "SimulationResult": "simulate", "simulate": "simulate",
    "AR": "specs", "WFD": "specs", "DtV": "specs", "HardwareSpec": "specs",
    "LoopedModelSpec": "specs", "Workload": "specs",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


class _Package(types.ModuleType):
    """Importing the module costmodel.simulate binds ``costmodel.simulate`` to that module; the
    package's name is the function (likewise predict and recommend), so bind that instead."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = sorted(_EXPORTS)
