"""The process's footprint as the limits count it, beside the bytes the allocator hands out.

A limit does not count allocated tensor bytes: the kernel counts the process's resident or virtual
size (RLIMIT_AS, cgroups, the OOM killer), the CUDA driver counts what the caching allocator has
*reserved*. Between the two lies malloc's retained heap on the host and fragmentation on CUDA.
These pure functions read both sides so a planner can size its margin from measurements:

* :func:`host_sizes` / :func:`host_rss` — resident and virtual size from ``/proc/self/statm``
  (``resource`` fallback elsewhere);
* :func:`cuda_reserve_gap` — reserved − allocated from a ``torch.cuda.memory_stats`` dict;
* :func:`read_footprint` — one :class:`FootprintReading` at a moment;
* :func:`footprint_gap` — how much the footprint grew over the allocated bytes between readings.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

STATM_PATH = "/proc/self/statm"
STATUS_PATH = "/proc/self/status"


def page_size() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 4096


_PAGE = page_size()


def parse_statm(text: str, page: int = _PAGE) -> tuple[int, int]:
    """(virtual size, resident size) in bytes from the text of ``/proc/<pid>/statm`` (pages).

    Example:
        >>> parse_statm("765 419 390 5 0 123 0", page=4096)
        (3133440, 1716224)
    """
    fields = text.split()
    return int(fields[0]) * page, int(fields[1]) * page


def parse_proc_status(text: str) -> dict[str, int]:
    """The ``kB`` fields of ``/proc/<pid>/status`` (``VmSize``, ``VmRSS``, ``VmData``, ...) in bytes.

    Example:
        >>> parse_proc_status("Name:\\tpython\\nVmSize:\\t    3896 kB\\nVmData:\\t     428 kB\\n")
        {'VmSize': 3989504, 'VmData': 438272}
    """
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[name.strip()] = int(parts[0]) * 1024
    return fields


def read_text(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def host_sizes(statm_path: str = STATM_PATH) -> tuple[int | None, int | None]:
    """(virtual size, resident size) of this process in bytes.

    Linux: ``/proc/self/statm`` (one small read, no subprocess). Elsewhere ``resource`` only knows
    the *peak* resident size (``ru_maxrss``), which is returned as the resident size, and no
    virtual size.
    """
    text = read_text(statm_path)
    if text:
        try:
            return parse_statm(text)
        except (ValueError, IndexError):
            pass
    try:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (OSError, ValueError):
        return None, None
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    return None, int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


def host_rss() -> int | None:
    """Resident bytes of this process now (see :func:`host_sizes`)."""
    return host_sizes()[1]


def cuda_reserve_gap(stats: Mapping[str, Any]) -> int | None:
    """Reserved − allocated bytes from a ``torch.cuda.memory_stats`` dict (the allocator's cache).

    Example:
        >>> cuda_reserve_gap({"reserved_bytes.all.current": 10 << 20, "allocated_bytes.all.current": 7 << 20})
        3145728
    """
    reserved = stats.get("reserved_bytes.all.current")
    allocated = stats.get("allocated_bytes.all.current")
    if reserved is None or allocated is None:
        return None
    return int(reserved) - int(allocated)


@dataclass(frozen=True)
class FootprintReading:
    """What the limit counts (``footprint``) beside the allocator's ``allocated`` bytes at one moment.

    ``footprint`` is the CUDA allocator's reserved bytes on CUDA, the resident size on the host.
    """

    time: float
    allocated: int | None
    footprint: int | None
    rss: int | None = None
    vms: int | None = None
    reserved: int | None = None

    @property
    def gap(self) -> int | None:
        """Footprint bytes beyond the allocated ones (malloc's retained heap, the CUDA cache)."""
        if self.allocated is None or self.footprint is None:
            return None
        return self.footprint - self.allocated


def read_footprint(allocated: int | None = None, device: Any = None) -> FootprintReading:
    """Read the footprint now.

    ``device`` a CUDA device (``torch.device``): allocated and reserved come from
    ``torch.cuda.memory_stats``. Otherwise the host's resident size is the footprint and
    ``allocated`` is what the caller counted (e.g. the CPU tracker's live bytes).
    """
    vms, rss = host_sizes()
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        stats = torch.cuda.memory_stats(device)
        reserved = stats.get("reserved_bytes.all.current")
        return FootprintReading(
            time=time.time(), allocated=stats.get("allocated_bytes.all.current"), footprint=reserved,
            rss=rss, vms=vms, reserved=reserved,
        )
    return FootprintReading(time=time.time(), allocated=allocated, footprint=rss, rss=rss, vms=vms)


def footprint_gap(readings: Sequence[FootprintReading]) -> int | None:
    """Measured growth of the footprint over the allocated bytes from the first reading to the later ones.

    The largest ``gap`` of the later readings minus the first one's: how many bytes beyond its
    allocated tensors the limit saw the process take meanwhile. ``None`` with fewer than two
    usable readings. Negative when the footprint shrank relative to the allocations.

    Example:
        >>> r = [FootprintReading(0, 100, 150), FootprintReading(1, 300, 420), FootprintReading(2, 200, 330)]
        >>> footprint_gap(r)  # gaps 50, 120, 130
        80
    """
    gaps = [r.gap for r in readings if r.gap is not None]
    if len(gaps) < 2:
        return None
    return max(gaps[1:]) - gaps[0]
