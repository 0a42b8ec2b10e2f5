"""Estimation: a Trainer optimizer step replayed on fake tensors, its peak and class split predicted."""

from .estimate import MemoryEstimate, estimate, largest_fitting_batch
from .peft import LoraSpec

__all__ = ["LoraSpec", "MemoryEstimate", "estimate", "largest_fitting_batch"]
