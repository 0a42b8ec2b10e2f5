"""Allocator backends: one reading of a device's allocator, the same shape for every device.

* :class:`CudaBackend` — ``torch.cuda`` memory statistics (also ROCm).
* :class:`AcceleratorBackend` — ``torch.accelerator``'s device-agnostic API (XPU, MPS, ...) where the
  installed torch has it and the device keeps statistics.
* :class:`CpuTrackedBackend` — PyTorch keeps no CPU allocator statistics, so live storages are
  tracked with :class:`~hf_memwatch.measure.tracker.StorageTracker` during fully tracked steps.
* :class:`NullBackend` — a device with no readable allocator: allocator fields are ``None``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from .tracker import StorageTracker


@dataclass
class AllocatorReading:
    """What an allocator says at one moment. ``None`` where the device does not keep the figure."""

    allocated: int | None
    reserved: int | None
    peak: int | None  # highest allocated since the last reset
    inactive_split: int | None = None  # fragmentation: free bytes inside split blocks
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    device_free: int | None = None
    device_total: int | None = None


class AllocatorBackend:
    """Base class. ``exact`` means ``read()`` gives true allocator figures without per-op tracking."""

    kind = "none"
    exact = False
    observes_operators = False  # counts through a TorchDispatchMode (incompatible with torch.compile)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self) -> AllocatorReading:
        return AllocatorReading(None, None, None)

    def reset_peak(self) -> None:
        """Restart the peak window at the current allocation."""

    def capacity(self) -> int | None:
        """Bytes this process could use in all (total device memory)."""
        return None

    def available(self) -> int | None:
        """Bytes free for this process now (what others do not hold)."""
        return None

    # Tracking hooks are no-ops where the allocator counts for itself.
    def start_tracking(self) -> None:
        pass

    def stop_tracking(self) -> None:
        pass

    @property
    def tracking(self) -> bool:
        return False

    def register(self, tensors: Iterable[torch.Tensor | None]) -> None:
        pass

    def live_storages(self) -> Mapping[int, int] | None:
        return None

    def live_storage_objects(self) -> dict[int, torch.UntypedStorage] | None:
        """Tracked devices inside a tracked window: key -> each live storage; else None."""
        return None


class NullBackend(AllocatorBackend):
    """A device whose allocator cannot be read."""


class CudaBackend(AllocatorBackend):
    """CUDA and ROCm through ``torch.cuda``."""

    kind = "cuda"
    exact = True

    def read(self) -> AllocatorReading:
        """One read of the allocator (``memory_stats``, one call) and of the device (``mem_get_info``)."""
        free, total = torch.cuda.mem_get_info(self.device)
        return reading_from_stats(torch.cuda.memory_stats(self.device), free, total)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def capacity(self) -> int | None:
        total = torch.cuda.mem_get_info(self.device)[1]
        return int(total * per_process_fraction(self.device))

    def available(self) -> int | None:
        # Free memory plus what this process's caching allocator already holds, capped by
        # torch.cuda.set_per_process_memory_fraction (the allocator refuses to reserve beyond it).
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        return min(free + reserved, int(total * per_process_fraction(self.device)))


def reading_from_stats(stats: Mapping[str, int], free: int | None = None, total: int | None = None) -> AllocatorReading:
    """An :class:`AllocatorReading` from a ``memory_stats()`` dict: a figure the dict lacks is unknown
    (None), never 0 — before CUDA is initialised in this process ``memory_stats()`` is ``{}``.

    Example:
        >>> reading_from_stats({}).allocated is None
        True
        >>> reading_from_stats({"allocated_bytes.all.current": 5, "allocated_bytes.all.peak": 9}).peak
        9
    """
    return AllocatorReading(
        allocated=stats.get("allocated_bytes.all.current"),
        reserved=stats.get("reserved_bytes.all.current"),
        peak=stats.get("allocated_bytes.all.peak"),
        inactive_split=stats.get("inactive_split_bytes.all.current"),
        num_alloc_retries=stats.get("num_alloc_retries"),
        num_ooms=stats.get("num_ooms"),
        device_free=free,
        device_total=total,
    )


def per_process_fraction(device: torch.device) -> float:
    """``torch.cuda.set_per_process_memory_fraction``'s cap on ``device`` (1.0 where unset or unknown)."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:  # torch < 2.6
        return 1.0
    try:
        return float(getter(device))
    except (RuntimeError, AttributeError):
        return 1.0


class AcceleratorBackend(AllocatorBackend):
    """Any ``torch.accelerator`` device whose allocator keeps statistics (XPU, MPS, ...)."""

    kind = "accelerator"
    exact = True

    def read(self) -> AllocatorReading:
        acc = torch.accelerator
        stats = acc.memory_stats(self.device)
        free = total = None
        if hasattr(acc, "get_memory_info"):
            try:
                free, total = acc.get_memory_info(self.device)
            except (RuntimeError, NotImplementedError):
                pass
        return AllocatorReading(
            allocated=stats.get("allocated_bytes.all.current", acc.memory_allocated(self.device)),
            reserved=stats.get("reserved_bytes.all.current", acc.memory_reserved(self.device)),
            peak=stats.get("allocated_bytes.all.peak", acc.max_memory_allocated(self.device)),
            inactive_split=stats.get("inactive_split_bytes.all.current"),
            num_alloc_retries=stats.get("num_alloc_retries"),
            num_ooms=stats.get("num_ooms"),
            device_free=free,
            device_total=total,
        )

    def reset_peak(self) -> None:
        torch.accelerator.reset_peak_memory_stats(self.device)

    def capacity(self) -> int | None:
        try:
            return torch.accelerator.get_memory_info(self.device)[1]
        except (AttributeError, RuntimeError, NotImplementedError):
            return None

    def available(self) -> int | None:
        try:
            free, _ = torch.accelerator.get_memory_info(self.device)
        except (AttributeError, RuntimeError, NotImplementedError):
            return None
        return free + torch.accelerator.memory_reserved(self.device)


class CpuTrackedBackend(AllocatorBackend):
    """The CPU: live storages counted by a :class:`StorageTracker` while tracking is on.

    Outside tracked windows ``read()`` reports the tracker's last figures, which is why the
    monitor marks such snapshots ``detail: "light"``.
    """

    kind = "cpu"
    exact = False
    observes_operators = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.tracker = StorageTracker(device.type)
        self._tracking = False
        self._capacity = _meminfo("MemTotal")

    def read(self) -> AllocatorReading:
        if self.tracker.watch_resizes:
            self.tracker.refresh_sizes()  # FSDP2's all-gathers resized outside operators
        return AllocatorReading(
            allocated=self.tracker.allocated,
            reserved=None,
            peak=max(self.tracker.peak, self.tracker.allocated),
            device_free=self.available(),
            device_total=self.capacity(),
        )

    def reset_peak(self) -> None:
        self.tracker.reset_peak()

    def start_tracking(self) -> None:
        if not self._tracking:
            self.tracker.start()
            self._tracking = True

    def stop_tracking(self) -> None:
        if self._tracking:
            self._tracking = False
            self.tracker.stop()

    @property
    def tracking(self) -> bool:
        return self._tracking

    def register(self, tensors: Iterable[torch.Tensor | None]) -> None:
        self.tracker.register(tensors)

    def live_storages(self) -> Mapping[int, int] | None:
        return self.tracker.live()

    def live_storage_objects(self) -> dict[int, torch.UntypedStorage] | None:
        return self.tracker.live_storage_objects() if self.tracking else None

    def capacity(self) -> int | None:
        return self._capacity

    def available(self) -> int | None:
        return _meminfo("MemAvailable")


def _meminfo(field: str) -> int | None:
    """A /proc/meminfo field in bytes (Linux); page counts elsewhere where sysconf knows them."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        pages = os.sysconf("SC_PHYS_PAGES" if field == "MemTotal" else "SC_AVPHYS_PAGES")
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def backend_for(device: torch.device) -> AllocatorBackend:
    """Pick the backend for ``device``.

    Example:
        >>> backend_for(torch.device("cpu")).kind
        'cpu'
    """
    if device.type == "cpu":
        return CpuTrackedBackend(device)
    if device.type == "cuda" and torch.cuda.is_available():
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return CudaBackend(device)
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "memory_stats"):
        try:
            accelerator.memory_stats(device)
            return AcceleratorBackend(device)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            pass
    return NullBackend(device)
