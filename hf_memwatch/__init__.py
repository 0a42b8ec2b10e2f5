"""hf-memwatch: where Hugging Face Trainer memory goes, step by step."""

from .callback import MemWatch
from .categories import LIVE_CLASSES, PHASES, MemClass
from .errors import MemWatchConfigError, MemWatchError, PlanError, is_oom_error
from .estimate import MemoryEstimate, estimate, largest_fitting_batch
from .units import format_bytes, parse_bytes

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
