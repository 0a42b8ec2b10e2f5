"""hf-memwatch: where Hugging Face Trainer memory goes, step by step.

Subpackages by concern: :mod:`~hf_memwatch.core` (units, errors, classes, timeline records),
:mod:`~hf_memwatch.measure` (backends, tracker, attribution, step monitor),
:mod:`~hf_memwatch.estimation` (the fake-tensor step replay), :mod:`~hf_memwatch.planning` (the one
planning core), :mod:`~hf_memwatch.integration` (the Trainer callback and auto mode),
:mod:`~hf_memwatch.reporting` (scalars, picture, summary, OOM post-mortem), :mod:`~hf_memwatch.cli`,
and :mod:`~hf_memwatch.testing` (the oracles the test suite checks against).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .core.categories import LIVE_CLASSES, PHASES, MemClass
from .core.errors import MemWatchConfigError, MemWatchError, PlanError, is_oom_error
from .core.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from .estimation import MemoryEstimate, estimate, largest_fitting_batch
    from .integration.callback import MemWatch

# Imported on first use: they pull in torch and transformers, which the picture drawn in a background
# process (``hf_memwatch.reporting.background``) and ``hf-memwatch report`` do not need.
_LAZY = {
    "MemWatch": "integration.callback",
    "MemoryEstimate": "estimation",
    "estimate": "estimation",
    "largest_fitting_batch": "estimation",
}
_SUBPACKAGES = ("core", "measure", "estimation", "planning", "integration", "reporting", "cli", "testing")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LIVE_CLASSES",
    "PHASES",
    "MemClass",
    "MemoryEstimate",
    "MemWatch",
    "MemWatchConfigError",
    "MemWatchError",
    "PlanError",
    "estimate",
    "format_bytes",
    "is_oom_error",
    "largest_fitting_batch",
    "parse_bytes",
]
__version__ = "0.1.0"
