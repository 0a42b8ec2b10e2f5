"""accelerate's internals hf-memwatch relies on, with their probes. Verified on accelerate 1.10.1 and 1.15.0.

==============================================  =======================================  ================================
private thing (``guards``)                      what relies on it                        without it (``off``)
==============================================  =======================================  ================================
``AcceleratorState._shared_state``,             the estimate's ``TrainingArguments()``   the auto mode's estimate inside
``PartialState._shared_state`` (the dicts       leaves a running Trainer's process        ``train()`` may reset the running
their Borg instances share)                     state as it was (``estimation/optim``)   Trainer's state
``model._original_forward`` (set by             the measured fallback's forward wrapped  the forward wrapped again when
``Accelerator.prepare_model`` when it wraps      for mixed precision only once            accelerate wrapped it already
``forward`` for native mixed precision)         (``integration/measured.py``)
==============================================  =======================================  ================================
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from typing import Any

from .probes import Probe, holds


def _states_shared() -> bool:
    from accelerate.state import AcceleratorState, PartialState

    return all(isinstance(vars(cls).get("_shared_state"), dict) for cls in (AcceleratorState, PartialState))


SHARED_STATE = Probe("accelerate", "AcceleratorState._shared_state, PartialState._shared_state",
                     "keeping a running Trainer's accelerate state across the estimate's TrainingArguments()",
                     _states_shared)


@contextlib.contextmanager
def accelerate_state_kept() -> Iterator[None]:
    """Keep accelerate's process-wide state (the dicts its Borg states share) as it was on entry.

    ``TrainingArguments()`` resets ``AcceleratorState``/``PartialState`` while setting up its device;
    inside a running Trainer (the auto mode estimates from within ``train()``) that would leave the
    Trainer's accelerator without a state ("`AcceleratorState` object has no attribute
    `distributed_type`").
    """
    if not holds(SHARED_STATE):
        with accelerate_environment_kept():
            yield
        return
    from accelerate.state import AcceleratorState, PartialState

    saved = [(cls._shared_state, dict(cls._shared_state)) for cls in (AcceleratorState, PartialState)]
    try:
        with accelerate_environment_kept():
            yield
    finally:
        for shared, content in saved:
            shared.clear()
            shared.update(content)


# Environment variables accelerate reads when an ``Accelerator`` is built, which transformers 4.x's
# ``TrainingArguments.__post_init__`` writes (4.57.6, ``training_args.py``: ``os.environ
# ["ACCELERATE_MIXED_PRECISION"] = "bf16"`` for ``bf16=True``, read back as the default of the next
# ``TrainingArguments`` of the process; ``ACCELERATE_USE_FSDP``, ``FSDP_*``, ``ACCELERATE_DYNAMO_*``).
# 5.x keeps the precision in ``self.mixed_precision`` and leaves the environment alone.
ACCELERATE_ENVIRONMENT = ("ACCELERATE_", "FSDP_")


@contextlib.contextmanager
def accelerate_environment_kept() -> Iterator[None]:
    """Leave accelerate's environment variables as they were on entry.

    On transformers 4.x a bf16 ``TrainingArguments`` leaves ``ACCELERATE_MIXED_PRECISION=bf16`` in the
    process, and every later ``Trainer`` of it — an fp32 one included — then runs under bf16 autocast:
    measured on 4.57.6, a DeBERTa-v2 fp32 step after an ALBERT bf16 run peaked at 3,407,576 bytes
    instead of its 3,929,584 (-13.3%), the truth the estimates were compared with.
    """
    saved = {name: value for name, value in os.environ.items() if name.startswith(ACCELERATE_ENVIRONMENT)}
    try:
        yield
    finally:
        for name in [n for n in os.environ if n.startswith(ACCELERATE_ENVIRONMENT) and n not in saved]:
            del os.environ[name]
        os.environ.update(saved)


def _marks_original_forward() -> bool:
    from accelerate import Accelerator

    return "_original_forward" in inspect.getsource(Accelerator.prepare_model)


ORIGINAL_FORWARD = Probe("accelerate", "model._original_forward (set by Accelerator.prepare_model)",
                         "telling a forward accelerate already wrapped for mixed precision (it may be wrapped twice)",
                         _marks_original_forward)


def forward_wrapped_for_mixed_precision(model: Any) -> bool:
    """Whether accelerate has wrapped ``model.forward`` for native mixed precision already."""
    return holds(ORIGINAL_FORWARD) and hasattr(model, "_original_forward")
