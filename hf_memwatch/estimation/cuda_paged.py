"""bitsandbytes' paged optimizer states on CUDA: on the card, outside torch's caching allocator.

A paged bitsandbytes optimizer (``paged_adamw_8bit``, ``paged_adamw_32bit``, ``PagedAdamW``/``PagedLion``
...: ``Optimizer8bit(is_paged=True)``) makes each state buffer of a parameter of at least 100,000
elements (``get_state_buffer``: ``if not self.is_paged or p.numel() < 1e5: torch.zeros_like(...)``,
else ``F.get_paged``) with ``cget_managed_ptr``, bitsandbytes' ``cudaMallocManaged`` (``csrc/pythonInterface.cpp``),
wrapped by ``torch.frombuffer``: unified memory that torch's caching allocator never sees. So on CUDA
those buffers are in neither ``torch.cuda.memory_reserved`` nor ``max_memory_allocated``, yet they sit
on the card while the step touches them (the driver migrates managed pages on access and evicts them to
host memory only when the card is oversubscribed). A paged 8-bit AdamW holds two uint8 states a
parameter (2 B an element), the 32-bit one two fp32 states (8 B an element): for a 1.2 B-parameter
model 2.4 GB / 9.6 GB outside the reserve. Smaller parameters keep ordinary torch tensors.

The replay runs bitsandbytes on CPU fake tensors, where ``get_state_buffer`` returns ``zeros_like``
for every parameter (its CPU branch: "Paged optimizers are not supported on CPU"), so the recorded
sequence has them as torch allocations. :func:`mark_paged` wraps the replayed optimizer's
``get_state_buffer`` to note the storages CUDA would page (the same 1e5 rule), and
:func:`recording_cuda_allocations` re-labels their events as :class:`PagedKey`; :func:`split_paged`
(:func:`~hf_memwatch.estimation.cuda_device.cuda_step_reserve`) takes them out of the sequence the
caching allocator replays and returns their bytes, which ``device_bytes`` adds.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from ..measure.tracker import recording_allocations

MiB = 1 << 20
PAGED_MIN_NUMEL = 100_000  # bitsandbytes' get_state_buffer: ``p.numel() < 1e5`` stays a torch tensor

# While a recording runs: its sequences and the (sequence, event) of each paged buffer's allocation.
_PAGED: contextvars.ContextVar[tuple[list, list[tuple[int, int]]] | None] = contextvars.ContextVar(
    "hf_memwatch_paged", default=None)


class PagedKey(NamedTuple):
    """The key of an event of a paged state buffer in a recorded sequence (the tracker's key inside)."""

    key: Any


def mark_paged(optimizer: Any, target: str) -> Any:
    """``optimizer``, its paged state buffers noted where it is a paged bitsandbytes one and the target CUDA.

    Example:
        >>> class Paged:
        ...     is_paged = True
        ...     def get_state_buffer(self, p, dtype=torch.float32):
        ...         return torch.zeros_like(p, dtype=dtype)
        >>> from hf_memwatch.measure.tracker import StorageTracker
        >>> large, little = torch.zeros(100_000), torch.zeros(10)
        >>> with recording_cuda_allocations() as traces, StorageTracker("cpu", round_to=512):
        ...     opt = mark_paged(Paged(), "cuda")
        ...     big = opt.get_state_buffer(large, torch.uint8)   # paged on CUDA
        ...     small = opt.get_state_buffer(little)               # a torch tensor on CUDA too
        >>> [(type(key).__name__, nbytes) for key, nbytes in traces[0]]
        [('PagedKey', 100352), ('int', 512)]
    """
    if target != "cuda" or not getattr(optimizer, "is_paged", False) or not hasattr(optimizer, "get_state_buffer"):
        return optimizer
    original = optimizer.get_state_buffer

    def get_state_buffer(p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        recording = _PAGED.get()
        before = [len(trace) for trace in recording[0]] if recording is not None else []
        buffer = original(p, dtype=dtype)
        if recording is not None and p.numel() >= PAGED_MIN_NUMEL:
            traces, paged = recording
            for index, trace in enumerate(traces):  # the allocation the call appended (the tracker's key)
                start = before[index] if index < len(before) else 0
                made = [event for event in range(start, len(trace)) if trace[event][1] > 0]
                if made:
                    paged.append((index, made[-1]))
        return buffer

    optimizer.get_state_buffer = get_state_buffer
    return optimizer


@contextlib.contextmanager
def recording_cuda_allocations() -> Iterator[list[list[tuple[Any, int]]]]:
    """:func:`~hf_memwatch.measure.tracker.recording_allocations`, the events of each paged state buffer
    (:func:`mark_paged`) re-labelled :class:`PagedKey` on the way out: its allocation and its free."""
    with recording_allocations() as traces:
        paged: list[tuple[int, int]] = []
        token = _PAGED.set((traces, paged))
        try:
            yield traces
        finally:
            _PAGED.reset(token)
            for index, event in paged:
                traces[index] = _relabelled(traces[index], event)


def _relabelled(trace: list[tuple[Any, int]], event: int) -> list[tuple[Any, int]]:
    """``trace`` with the allocation at ``event`` and the free of its key after it made :class:`PagedKey`."""
    key = trace[event][0]
    free = next((i for i in range(event + 1, len(trace)) if trace[i] == (key, 0)), None)
    return [(PagedKey(k), n) if i in (event, free) else (k, n) for i, (k, n) in enumerate(trace)]


def split_paged(traces: Sequence[Sequence[tuple[Any, int]]]) -> tuple[list[list[tuple[Any, int]]], int]:
    """``(traces without the paged events, the step's paged bytes)``: the bytes of the paged buffers the
    last sequence (the step) allocates.

    Example:
        >>> split_paged([[("w", 512), (PagedKey(1), 1024), ("a", 512), ("a", 0)]])
        ([[('w', 512), ('a', 512), ('a', 0)]], 1024)
    """
    kept = [[(key, nbytes) for key, nbytes in trace if not isinstance(key, PagedKey)] for trace in traces]
    paged = sum(nbytes for key, nbytes in traces[-1] if isinstance(key, PagedKey)) if traces else 0
    return kept, paged


def paged_note(paged: int, total_memory: int | None) -> str:
    """The estimate's note on the paged states it added to ``device_bytes``."""
    spill = "" if total_memory is None or paged < total_memory else " (more than the card: the driver pages them out)"
    return (f"bitsandbytes' paged optimizer states: {paged / MiB:,.0f} MiB in cudaMallocManaged memory, "
            "outside torch's reserve (reserved_bytes) and in device_bytes while the step touches them" + spill)
