"""Analytical cost model and event simulator for decoding looped language models.

Imports nothing heavy: no torch, and scipy/matplotlib only inside the functions that need them.
The names below load on first use, so a command imports only the modules it runs.
"""

from .lazy import lazy_exports

__all__ = lazy_exports(__name__, {
    "Prediction": "predict", "ScheduleResult": "predict", "predict": "predict", "sweep": "sweep",
    "get_hardware": "presets", "get_model": "presets", "MODELS": "presets", "HARDWARE": "presets",
    "Choice": "recommend", "recommend": "recommend",
    "SimulationResult": "simulate", "simulate": "simulate",
    "AR": "schedules", "WFD": "schedules", "DtV": "schedules", "HardwareSpec": "hardware",
    "LoopedModelSpec": "model", "Workload": "workload",
})
