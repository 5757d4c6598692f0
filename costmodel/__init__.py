"""Analytical cost model and event simulator for decoding looped language models.

Imports nothing heavy: no torch, and scipy/matplotlib only inside the functions that need them.
"""

from .predict import Prediction, ScheduleResult, predict, sweep
from .presets import get_hardware, get_model
from .recommend import Choice, recommend
from .simulate import SimulationResult, simulate
from .specs import AR, WFD, DtV, HardwareSpec, LoopedModelSpec, Workload


def __getattr__(name: str):
    """``MODELS`` and ``HARDWARE`` (costmodel.presets), read on first use."""
    if name in ("MODELS", "HARDWARE"):
        from . import presets

        return getattr(presets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AR", "Choice", "DtV", "WFD", "HARDWARE", "MODELS", "HardwareSpec", "LoopedModelSpec",
    "Prediction", "ScheduleResult", "SimulationResult", "Workload", "get_hardware", "get_model",
    "predict", "recommend", "simulate", "sweep",
]
