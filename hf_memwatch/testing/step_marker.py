"""The profiler range of each optimizer step, for :func:`hf_memwatch.testing.truth.step_peaks`.

Usage:
    >>> trainer.add_callback(StepMarker())                               # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from . import STEP_MARK


class StepMarker(TrainerCallback):
    """Opens a profiler range at ``on_step_begin`` and closes it at ``on_step_end``."""

    def __init__(self) -> None:
        self._range: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._range = torch.profiler.record_function(STEP_MARK)
        self._range.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
