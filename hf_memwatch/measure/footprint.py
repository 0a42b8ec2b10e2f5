"""The process's footprint as the limits count it, beside the bytes the allocator hands out.

A limit does not count allocated tensor bytes: the kernel counts the process's resident or virtual
size (RLIMIT_AS, cgroups, the OOM killer), the CUDA driver counts what the caching allocator has
*reserved*. Between the two lies malloc's retained heap on the host and fragmentation on CUDA.
These pure functions read both sides so a planner can size its margin from measurements:

* :func:`host_sizes` / :func:`host_rss` — resident and virtual size from ``/proc/self/statm``
  (``resource`` fallback elsewhere);
* :func:`cuda_reserve_gap` — reserved − allocated from a ``torch.cuda.memory_stats`` dict;
* :func:`read_footprint` — one :class:`FootprintReading` at a moment;
* :func:`footprint_gap` — how much the footprint grew over the allocated bytes between readings;
* :func:`peak_gap` — how much the footprint's peak grew beyond the allocated peak's growth;
* :func:`probe_host_gap` — that growth for a small allocation made on purpose (before training);
* :func:`step_footprint` — what one optimizer step measured: its allocated peak, the footprint
  beyond it, and what the next step will need as the limit counts it;
* :func:`expandable_segments_advice` — whether ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
  would cut the CUDA reserve gap measured.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..core.records import Snapshot, StepRecord
from ..core.units import format_bytes

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


def peak_gap(readings: Sequence[FootprintReading]) -> int | None:
    """Growth of the footprint's peak beyond the growth of the allocated peak, from the first reading on.

    Unlike :func:`footprint_gap` a footprint kept while the allocations are low (malloc's retained
    heap after a free) does not count twice: the next allocations reuse it. This is what a limit
    sees on top of the allocated peak. ``None`` with fewer than two usable readings.

    Example:
        >>> r = [FootprintReading(0, 100, 150), FootprintReading(1, 300, 420), FootprintReading(2, 100, 420)]
        >>> peak_gap(r), footprint_gap(r)  # 270 of footprint for 200 allocated; 320 retained after the free
        (70, 270)
    """
    usable = [r for r in readings if r.allocated is not None and r.footprint is not None]
    if len(usable) < 2:
        return None
    first = usable[0]
    footprint = max(int(r.footprint or 0) for r in usable[1:]) - int(first.footprint or 0)
    allocated = max(int(r.allocated or 0) for r in usable[1:]) - int(first.allocated or 0)
    return footprint - allocated


# -- what a limit counts -------------------------------------------------------------------------
# ``reserved``: the CUDA caching allocator's reserved bytes; ``vms``: the host virtual size
# (RLIMIT_AS, RLIMIT_DATA — the data segment grows with the virtual size); ``rss``: the resident size
# (cgroups, MemAvailable, the OOM killer); ``allocated``: the tensor bytes themselves (a user budget on
# the CPU is defined in them, so nothing lies between the two).
FootprintKind = Literal["reserved", "vms", "rss", "allocated"]
SNAPSHOT_FIELD: dict[str, str] = {"reserved": "reserved", "vms": "host_vms", "rss": "host_rss", "allocated": "allocated"}
# A probe allocation small beside any budget planned for, split like a step's activations are.
PROBE_BYTES = 32 << 20
PROBE_PIECES = 64


def host_reading(allocated: int | None, kind: FootprintKind) -> FootprintReading:
    """A host :class:`FootprintReading` whose ``footprint`` is the size ``kind`` names."""
    vms, rss = host_sizes()
    footprint = {"vms": vms, "rss": rss}.get(kind, allocated)
    return FootprintReading(time=time.time(), allocated=allocated, footprint=footprint, rss=rss, vms=vms)


def probe_host_gap(kind: FootprintKind, nbytes: int = PROBE_BYTES, pieces: int = PROBE_PIECES) -> int | None:
    """Bytes the host footprint of ``kind`` peaked beyond ``nbytes`` of tensors allocated, touched and
    freed (:func:`peak_gap`): the allocator's own overhead on such allocations.

    After an unmeasured warm-up, two rounds, as in training: glibc serves the first round from fresh mappings and raises its
    mmap threshold when they are freed, so the second comes from its heap. ``None`` when the sizes
    cannot be read or the probe itself did not get its memory (a fault of the probe must not stop
    planning).
    """
    import torch

    if kind not in ("vms", "rss") or nbytes <= 0:
        return None
    size = max(1, nbytes // pieces // 4)
    try:
        # Unmeasured: the first call maps in the code and the allocator's first arena.
        del_me = [torch.ones(size) for _ in range(2)]
        del del_me
        readings = [host_reading(0, kind)]
        for _ in range(2):
            tensors = [torch.ones(size) for _ in range(pieces)]  # ones: every page touched
            readings.append(host_reading(sum(t.nbytes for t in tensors), kind))
            del tensors
            readings.append(host_reading(0, kind))
    except RuntimeError:  # out of memory under a tight limit: nothing learnt
        return None
    gap = peak_gap(readings)
    return None if gap is None else max(0, gap)


@dataclass(frozen=True)
class StepFootprint:
    """What one optimizer step measured, in the limit's terms.

    ``gap``: footprint bytes beyond the allocated ones at the step's peak (CUDA: reserved − allocated;
    host: the footprint's peak growth since training began beyond the allocated peak's, see
    :func:`peak_gap` — the footprint is read at the step's snapshots, so a peak between two of them
    that the allocator gives back at once is missed; the allocated peak is exact). ``states_growth``:
    optimizer-state bytes allocated after the step's peak (the first ``optimizer.step()`` creates
    them) that every later step holds. ``need``: what the next step is measured to need.
    """

    step: int
    kind: FootprintKind
    allocated_peak: int
    gap: int
    states_growth: int = 0

    @property
    def next_allocated(self) -> int:
        return self.allocated_peak + self.states_growth

    @property
    def need(self) -> int:
        return self.next_allocated + self.gap

    @property
    def ratio(self) -> float:
        """The gap as a share of the allocated bytes: the planning margin measured."""
        return self.gap / max(1, self.next_allocated)


def step_footprint(step_record: StepRecord, snapshots: Sequence[Snapshot], kind: FootprintKind,
                   baseline: FootprintReading | None = None) -> StepFootprint | None:
    """The :class:`StepFootprint` of a ``step`` record and its ``snapshot`` records (typed, as the monitor passes them).

    ``baseline``: the host reading at the start of training (host kinds only; its ``footprint`` of
    ``kind``). ``None`` where the step has no allocated peak — a CPU step not tracked in full
    (``detail`` other than ``full``: its figures are the last full step's, or none) — or the
    footprint was not read.

    Example:
        >>> step = StepRecord.from_dict({"step": 1, "peak": 900, "detail": "light",
        ...                              "live_at_peak": {"optimizer_states": 0}}, lenient=True)
        >>> snaps = [Snapshot.from_dict(s, lenient=True) for s in (
        ...     {"allocated": 500, "reserved": 1000, "live": {"optimizer_states": 0}},
        ...     {"allocated": 700, "reserved": 1200, "live": {"optimizer_states": 200}})]
        >>> fp = step_footprint(step, snaps, "reserved")
        >>> fp.gap, fp.states_growth, fp.need, round(fp.ratio, 3)
        (300, 200, 1400, 0.273)
    """
    peak = step_record.peak
    if peak is None or not snapshots or (kind != "reserved" and step_record.detail != "full"):
        return None
    states_at_peak = (step_record.live_at_peak or {}).get("optimizer_states") or 0
    states_now = (snapshots[-1].live or {}).get("optimizer_states") or 0
    growth = max(0, int(states_now) - int(states_at_peak))
    field = SNAPSHOT_FIELD[kind]
    if kind == "allocated":
        gap: int | None = 0
    elif kind == "reserved":
        # The caching allocator keeps what it reserved (no empty_cache in a step): the most reserved
        # in the step is what was reserved at its allocated peak, or more.
        reserved = [int(getattr(s, field)) for s in snapshots if getattr(s, field) is not None]
        gap = max(reserved) - int(peak) if reserved else None
    else:
        if baseline is None:
            return None
        footprints = [int(getattr(s, field)) for s in snapshots if getattr(s, field) is not None]
        if not footprints:
            return None
        gap = peak_gap([baseline, FootprintReading(baseline.time, int(peak), max(footprints))])
    if gap is None:
        return None
    return StepFootprint(int(step_record.step or 0), kind, int(peak), max(0, int(gap)), growth)


# -- expandable segments -------------------------------------------------------------------------
# PyTorch's advice for fragmentation: a reserve gap above this share of the reserved bytes at the
# peak, or any allocation retried after freeing the cache, is what expandable segments address.
EXPANDABLE_GAP_SHARE = 0.10


def allocator_settings() -> str:
    """The CUDA caching allocator's settings in force: the environment's, then those set in the process.

    ``torch._C._accelerator_getAllocatorSettings()`` holds what ``PYTORCH_ALLOC_CONF`` /
    ``PYTORCH_CUDA_ALLOC_CONF`` set at start and what ``_accelerator_setAllocatorSettings`` set since;
    later entries override earlier ones (:func:`expandable_segments_enabled` reads the last).
    """
    parts = [os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), os.environ.get("PYTORCH_ALLOC_CONF", "")]
    from ..compat.torch_cuda_memory import allocator_settings_in_process

    parts.append(allocator_settings_in_process())
    return ",".join(part for part in parts if part)


def expandable_segments_enabled(settings: str) -> bool:
    """Whether ``settings`` (``key:value,...``) turn expandable segments on (the last mention wins).

    Example:
        >>> expandable_segments_enabled("max_split_size_mb:128,expandable_segments:True")
        True
        >>> expandable_segments_enabled("expandable_segments:True,expandable_segments:False"), expandable_segments_enabled("")
        (False, False)
    """
    enabled = False
    for item in settings.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            enabled = value.strip().lower() in ("true", "1")
    return enabled


def expandable_segments_advice(reserved: int | None, allocated: int | None, retries: int | None,
                               settings: str, share: float = EXPANDABLE_GAP_SHARE) -> str | None:
    """One sentence recommending ``expandable_segments:True`` with the figures, or ``None``.

    ``reserved``/``allocated``: the reserved bytes and the allocated bytes at the peak; ``retries``:
    ``num_alloc_retries`` (cudaMalloc failed, the cache was freed and the allocation retried).
    Nothing is recommended when ``settings`` already turn expandable segments on.
    """
    if expandable_segments_enabled(settings) or reserved is None or allocated is None or reserved <= 0:
        return None
    gap = max(0, reserved - allocated)
    if gap <= share * reserved and not retries:
        return None
    why = f"{format_bytes(gap)} reserved beyond the {format_bytes(allocated)} allocated at the peak ({gap / reserved:.0%} of " \
          f"{format_bytes(reserved)} reserved)"
    if retries:
        why += f", {retries} allocation(s) retried after freeing the cache"
    return (f"set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts: {why}; expandable "
            "segments grow one mapping instead of caching blocks of fixed sizes, which cuts that gap")


def advice_from_stats(stats: Mapping[str, Any], settings: str) -> str | None:
    """:func:`expandable_segments_advice` from a ``torch.cuda.memory_stats`` dict (its peak keys when
    present: they are the figures at the peak since the last ``reset_peak_memory_stats``)."""
    reserved = stats.get("reserved_bytes.all.peak", stats.get("reserved_bytes.all.current"))
    allocated = stats.get("allocated_bytes.all.peak", stats.get("allocated_bytes.all.current"))
    return expandable_segments_advice(
        None if reserved is None else int(reserved), None if allocated is None else int(allocated),
        int(stats.get("num_alloc_retries") or 0), settings,
    )
