"""CUDA allocator history for the post-mortem: recorded on request, each allocation tagged with the
step and phase in progress (``MemWatch(record_history=True)``; the snapshot is dumped at an OOM by
:mod:`hf_memwatch.reporting.oom`)."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

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
    torch.cuda.memory._record_memory_history(max_entries=max_entries, **history_options())
    set_metadata = getattr(torch.cuda.memory, "_set_memory_metadata", None)
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


def history_options(recorder: Any = None) -> dict[str, Any]:
    """Keywords for ``torch.cuda.memory._record_memory_history`` so that the phase annotations
    (``record_function``) reach the history: ``global_record_annotations=True`` where the installed
    torch's recorder takes it (torch 2.13: ``_record_memory_history_impl(..., global_record_annotations)``;
    without it annotations are recorded only while the profiler runs). Empty where it does not."""
    import inspect

    recorder = recorder or getattr(torch.cuda.memory, "_record_memory_history_impl", None)
    try:
        parameters = inspect.signature(recorder).parameters if recorder is not None else {}
    except (TypeError, ValueError):
        parameters = {}
    return {"global_record_annotations": True} if "global_record_annotations" in parameters else {}


def stop_allocator_history() -> None:
    """Stop CUDA allocator history recording (started by :func:`start_allocator_history`)."""
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(enabled=None)
