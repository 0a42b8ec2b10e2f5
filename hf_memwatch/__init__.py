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

# Imported on first use: transformers' Trainer (and through it peft, bitsandbytes) takes seconds to
# import, which the command line and ``hf_memwatch.core`` users need not pay.
_LAZY = {
    "MemWatch": "hf_memwatch.integration.callback",
    "MemoryEstimate": "hf_memwatch.estimation",
    "estimate": "hf_memwatch.estimation",
    "largest_fitting_batch": "hf_memwatch.estimation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_memwatch' has no attribute {name!r}")


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
