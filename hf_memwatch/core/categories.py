"""The memory classes of the Transformers "GPU memory usage" guide, as measured by hf-memwatch, and the
phases of a step: the one definition of each name (every module reads them from here).

Example:
    >>> PHASES.index(AFTER_BACKWARD), STAGE_AFTER[AFTER_FORWARD]
    (2, 'backward')
    >>> ESTIMATE_CLASSES
    ('weights', 'gradients', 'optimizer_states', 'activations', 'temporaries', 'other')
"""

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

# The classes of a predicted step (``MemoryEstimate.classes``): the live ones and the spike, ``other`` last.
ESTIMATE_CLASSES: tuple[str, ...] = LIVE_CLASSES[:-1] + (MemClass.TEMPORARIES.value, MemClass.OTHER.value)
# The classes of a predicted evaluation loop (no gradients, no saved activations).
EVAL_ESTIMATE_CLASSES: tuple[str, ...] = (MemClass.WEIGHTS.value, MemClass.OPTIMIZER_STATES.value,
                                          MemClass.OUTPUTS.value, MemClass.OTHER.value, MemClass.TEMPORARIES.value)
# The classes that stay from step to step (not made by the step's forward and backward).
RESIDENT_CLASSES = frozenset({MemClass.WEIGHTS.value, MemClass.GRADIENTS.value, MemClass.OPTIMIZER_STATES.value})

# The snapshot phases of an optimizer step, in order (README: "What is measured").
STEP_BEGIN = "step_begin"
AFTER_FORWARD = "after_forward"
AFTER_BACKWARD = "after_backward"
AFTER_OPTIMIZER = "after_optimizer"
STEP_END = "step_end"
PHASES: tuple[str, ...] = (STEP_BEGIN, AFTER_FORWARD, AFTER_BACKWARD, AFTER_OPTIMIZER, STEP_END)
FORWARD_BACKWARD_PHASES: tuple[str, ...] = (AFTER_FORWARD, AFTER_BACKWARD)
#: The stage that runs after each snapshot phase until the model's hooks say otherwise.
STAGE_AFTER: dict[str, str] = dict(zip(PHASES, ("forward", "backward", "optimizer", "zero_grad", "outside"), strict=True))


def phase_words(phase: str | None) -> str:
    """A phase's peak as the user reads it: the stage of the interval that *ends* at the snapshot
    (``after_backward``'s peak is the backward's, the gradients are still being made), the phase's name
    kept in parentheses; a name that is no step phase (``eval_forward``) is returned as it is.

    Example:
        >>> phase_words("after_backward"), phase_words("step_begin")
        ('during the backward (after_backward)', 'between steps (step_begin)')
    """
    if phase not in PHASES:
        return str(phase)
    before = PHASES[PHASES.index(phase) - 1]  # step_begin: the previous step's end
    stage = STAGE_AFTER[before]
    words = "between steps" if stage == "outside" else f"during the {'optimizer step' if stage == 'optimizer' else stage}"
    return f"{words} ({phase})"
