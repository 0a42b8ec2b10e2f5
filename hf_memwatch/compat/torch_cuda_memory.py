"""torch's CUDA caching-allocator internals hf-memwatch reads, with their probes. Verified on torch 2.13.0.

``torch.cuda.memory``'s history recorder and snapshot are documented ("Understanding CUDA Memory
Usage") under private names; the allocator settings set in the process are read through ``torch._C``.

==================================================  ====================================  ===================================
private thing (``guards``)                          what relies on it                     without it (``off``)
==================================================  ====================================  ===================================
``torch.cuda.memory._snapshot()``                   the allocator's blocks at an OOM and  no snapshot file, no CUDA top tensors
                                                    at the peak (``reporting/oom.py``,    (the rest of the post-mortem stays)
                                                    ``measure/peak_watch.py``)
``torch.cuda.memory._record_memory_history(...)``,  ``record_history=True``: the phases   no history (warned); annotations only
``_record_memory_history_impl``' keywords,          annotated in the allocator history    while the profiler runs
``_set_memory_metadata``                            (``reporting/allocator_history.py``)
``torch._C._accelerator_getAllocatorSettings()``    settings set in the process           only the environment's settings read
                                                    (``measure/footprint.py``)
==================================================  ====================================  ===================================
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .probes import Probe, holds


def _callable(owner: Any, name: str) -> bool:
    return callable(getattr(owner, name, None))


SNAPSHOT = Probe("torch", "torch.cuda.memory._snapshot", "the caching allocator's blocks (OOM snapshot, CUDA top tensors)",
                 lambda: _callable(torch.cuda.memory, "_snapshot"))
HISTORY = Probe("torch", "torch.cuda.memory._record_memory_history(enabled, context, stacks, max_entries)",
                "recording the allocator's history (record_history=True)",
                lambda: _callable(torch.cuda.memory, "_record_memory_history") and {"enabled", "max_entries"}
                <= set(inspect.signature(torch.cuda.memory._record_memory_history).parameters))


def allocator_snapshot() -> dict[str, Any] | None:
    """The caching allocator's snapshot (segments, blocks, and the history when recorded), or None."""
    return torch.cuda.memory._snapshot() if holds(SNAPSHOT) else None


def record_history(max_entries: int) -> bool:
    """Start recording the allocator's history (phase annotations included where this torch can); False when off."""
    if not holds(HISTORY):
        return False
    torch.cuda.memory._record_memory_history(max_entries=max_entries, **history_options())
    return True


def stop_history() -> None:
    if holds(HISTORY):
        torch.cuda.memory._record_memory_history(enabled=None)


def history_options(recorder: Any = None) -> dict[str, Any]:
    """Keywords for the history recorder so that the phase annotations (``record_function``) reach the
    history: ``global_record_annotations=True`` where the installed torch's recorder takes it (torch
    2.13: ``_record_memory_history_impl(..., global_record_annotations)``; without it annotations are
    recorded only while the profiler runs). Empty where it does not."""
    recorder = recorder or getattr(torch.cuda.memory, "_record_memory_history_impl", None)
    try:
        parameters = inspect.signature(recorder).parameters if recorder is not None else {}
    except (TypeError, ValueError):
        parameters = {}
    return {"global_record_annotations": True} if "global_record_annotations" in parameters else {}


def memory_metadata_setter() -> Any:
    """``torch.cuda.memory._set_memory_metadata`` (a label on the next allocations), or None."""
    return getattr(torch.cuda.memory, "_set_memory_metadata", None)


def allocator_settings_in_process() -> str:
    """The allocator settings in force in this process (``PYTORCH_ALLOC_CONF`` at start, then those
    set since); empty on a torch without the accessor."""
    try:
        return str(torch._C._accelerator_getAllocatorSettings())
    except (AttributeError, RuntimeError):  # an older torch: the environment is all there is
        return ""
