"""The memory classes of the Transformers "GPU memory usage" guide, as measured by hf-memwatch."""

from __future__ import annotations

from enum import Enum


class MemClass(str, Enum):
    """Where a byte of device memory goes.

    The first five are *live* classes: at every snapshot they add up exactly to the allocator's
    ``allocated`` figure. ``TEMPORARIES`` is the spike above live memory inside a phase and
    ``OVERHEAD`` what the allocator reserves beyond what is allocated.
    """

    WEIGHTS = "weights"
    GRADIENTS = "gradients"
    OPTIMIZER_STATES = "optimizer_states"
    ACTIVATIONS = "activations"
    OTHER = "other"
    OUTPUTS = "outputs"  # evaluation only: predictions/logits/labels accumulated by the eval loop
    TEMPORARIES = "temporaries"
    OVERHEAD = "allocator_overhead"


LIVE_CLASSES: tuple[str, ...] = (
    MemClass.WEIGHTS.value,
    MemClass.GRADIENTS.value,
    MemClass.OPTIMIZER_STATES.value,
    MemClass.ACTIVATIONS.value,
    MemClass.OTHER.value,
)

# Live classes of an evaluation snapshot: the training ones plus the accumulated outputs.
EVAL_LIVE_CLASSES: tuple[str, ...] = LIVE_CLASSES[:-1] + (MemClass.OUTPUTS.value, MemClass.OTHER.value)

PHASES: tuple[str, ...] = ("step_begin", "after_forward", "after_backward", "after_optimizer", "step_end")
