"""CUDA allocator history for the post-mortem: recorded on request, each allocation tagged with the
step and phase in progress (``MemWatch(record_history=True)``; the snapshot is dumped at an OOM by
:mod:`hf_memwatch.reporting.oom`)."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from ..compat.torch_cuda_memory import history_options as history_options  # re-exported
from ..compat.torch_cuda_memory import memory_metadata_setter, record_history, stop_history
from ..core.categories import PHASES

logger = logging.getLogger("hf_memwatch")

#: What runs after each snapshot phase until the next one: where an OOM after that snapshot happened.
PHASE_IN_PROGRESS = dict(zip(PHASES, (
    "the forward pass",
    "the backward pass",
    "the optimizer step (or the next micro-batch's forward pass)",
    "zero_grad / the end of the step",
    "between steps (data loading, logging, evaluation, saving)",
), strict=True))


def start_allocator_history(monitor: Any, max_entries: int = 100_000) -> bool:
    """On CUDA, record allocator history and tag allocations with the step and phase in progress.

    Costs time on every allocation (opt-in). Returns False on other devices.
    """
    if getattr(monitor.backend, "kind", None) != "cuda":
        logger.warning("hf-memwatch: record_history applies to CUDA only; device is %s", monitor.device)
        return False
    if not record_history(max_entries):
        return False
    set_metadata = memory_metadata_setter()
    snapshot = monitor.snapshot

    @functools.wraps(snapshot)
    def snapshot_and_mark(phase: str) -> dict[str, Any]:
        record = snapshot(phase)
        label = f"hf_memwatch step {monitor.step} mb {monitor.micro_step}: {PHASE_IN_PROGRESS.get(phase, phase)}"
        if set_metadata is not None:
            set_metadata(label)
        with torch.profiler.record_function(label):  # an annotation in the snapshot as well
            pass
        return record

    monitor.snapshot = snapshot_and_mark
    return True


def stop_allocator_history() -> None:
    """Stop CUDA allocator history recording (started by :func:`start_allocator_history`)."""
    if torch.cuda.is_available():
        stop_history()
