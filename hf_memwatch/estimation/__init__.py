"""Estimation: a Trainer optimizer step replayed on fake tensors, its peak and class split predicted."""

from .estimate import MemoryEstimate, estimate, estimate_eval
from .fitting import largest_fitting_batch
from .peft import LoraSpec
from .quantized import QuantSpec

__all__ = ["LoraSpec", "MemoryEstimate", "QuantSpec", "estimate", "estimate_eval", "largest_fitting_batch"]
