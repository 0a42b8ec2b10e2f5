"""Estimation: a Trainer optimizer step replayed on fake tensors, its peak and class split predicted."""

from .estimate import MemoryEstimate, estimate, estimate_eval, largest_fitting_batch

__all__ = ["MemoryEstimate", "estimate", "estimate_eval", "largest_fitting_batch"]
