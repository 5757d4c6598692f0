"""The schedule registry: one module per schedule (ar, dtv, wfd), each registering a
``Schedule`` subclass (costmodel.schedules.base) under its name. Predictions, the search, the
simulator, the decoder and the command lines loop over ``SCHEDULES`` in this order."""

from .ar import AR
from .base import SCHEDULES, Drafting, Schedule, get, register, registered, widest
from .dtv import DtV
from .wfd import WFD, wave_width

__all__ = ["AR", "DtV", "Drafting", "SCHEDULES", "Schedule", "WFD", "get", "register",
           "registered", "wave_width", "widest"]
