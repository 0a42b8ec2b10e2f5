"""Estimation: a Trainer optimizer step replayed on fake tensors, its peak and class split predicted."""

from .estimate import MemoryEstimate, estimate, estimate_eval, largest_fitting_batch
from .peft import LoraSpec

__all__ = ["LoraSpec", "MemoryEstimate", "estimate", "estimate_eval", "largest_fitting_batch"]
