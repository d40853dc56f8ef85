"""Seeing the numerics of a low-precision run: statistics of every rounding per module and
category (``Recorder``), and a float32 shadow of the model that shows where the simulated run
departs from full precision (``Shadow``)."""

from lpsim.diagnostics.recorder import Record, Recorder, Stagnation, StagnationRecord
from lpsim.diagnostics.shadow import ModuleDivergence, Shadow, ShadowReport

__all__ = [
    "Recorder",
    "Record",
    "Stagnation",
    "StagnationRecord",
    "Shadow",
    "ShadowReport",
    "ModuleDivergence",
]
