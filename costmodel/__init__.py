"""Analytical cost model and event simulator for decoding looped language models.

Imports nothing heavy: no torch, and scipy/matplotlib only inside the functions that need them.
"""

from .predict import Prediction, ScheduleResult, predict, sweep
from .presets import HARDWARE, MODELS, get_hardware, get_model
from .simulate import SimulationResult, simulate
from .specs import AR, WFD, DtV, HardwareSpec, LoopedModelSpec, Workload

__all__ = [
    "AR", "DtV", "WFD", "HARDWARE", "MODELS", "HardwareSpec", "LoopedModelSpec", "Prediction",
    "ScheduleResult", "SimulationResult", "Workload", "get_hardware", "get_model", "predict",
    "simulate", "sweep",
]
