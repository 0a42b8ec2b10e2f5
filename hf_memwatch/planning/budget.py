"""The memory budget of the auto mode: what ``MemWatch(budget=...)`` means in bytes on this device.

* ``None`` (default): 90% of what this process may really use: the smallest of the limits that
  apply (:func:`device_limits`). On CUDA: free + this process's reserved bytes, and the cap of
  ``torch.cuda.set_per_process_memory_fraction``. On the CPU: ``MemAvailable``, the memory limit of
  the process's own cgroup (v2 ``memory.max`` − ``memory.current``, v1 ``memory.limit_in_bytes`` −
  ``memory.usage_in_bytes``, ancestors included), ``RLIMIT_AS`` − the virtual size and
  ``RLIMIT_DATA`` − the data segment. :attr:`Budget.bound_by` names the one that bound it.
* an ``int``: bytes; a ``str`` with a unit (``"20GiB"``, ``"500MB"``); a ``float`` in (0, 1]: a
  fraction of the device capacity (CUDA: total memory; CPU: the smallest host limit).

Host limits are what the process may still *take* on top of its present size, so bytes already
held (the loaded weights) are not added back: on the CPU the default budget is conservative by
the size of what is already allocated.

A plan is made against ``usable = total - margin``: the margin is the footprint the limit counts
beyond the allocated bytes (:mod:`hf_memwatch.measure.footprint`).
:func:`resolve_budget` starts from a prior (:data:`CUDA_FRAGMENTATION_MARGIN` on caching allocators,
none on the CPU); :func:`margin_before_training` replaces it with what the process measures before
training, and the auto mode with what the first steps measure (:meth:`Budget.with_margin`).
"""

from __future__ import annotations

import dataclasses
import os
import resource
from dataclasses import dataclass, field

import torch

from ..core.errors import MemWatchConfigError
from ..core.units import format_bytes, fraction_of, parse_bytes
from ..measure.backends import AllocatorBackend, per_process_fraction
from ..measure.footprint import (
    PROBE_BYTES,
    STATUS_PATH,
    FootprintKind,
    cuda_reserve_gap,
    parse_proc_status,
    probe_host_gap,
    read_text,
)

DEFAULT_FRACTION = 0.9
# Share of the budget kept free for allocator fragmentation on caching allocators (CUDA and the
# torch.accelerator devices) until the run has measured its own (on CUDA the first steps replace it,
# see hf_memwatch.integration.auto). Not sized from GPU measurements: see docs/auto.md.
CUDA_FRAGMENTATION_MARGIN = 0.05
# Host limits that count the virtual size (the data segment is part of it): their footprint is "vms".
VIRTUAL_SIZE_LIMITS = ("RLIMIT_AS", "RLIMIT_DATA")
# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX rounded to pages (9223372036854771712 on 4 KiB
# pages); anything this large is no limit.
UNLIMITED_CGROUP = 1 << 62
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"

BudgetSpec = int | float | str | None


@dataclass(frozen=True)
class Limit:
    """One limit on this process's memory: ``available`` bytes it may still take under it."""

    name: str  # "MemAvailable", "cgroup v2 memory.max", "RLIMIT_AS", "CUDA free + own reserved", ...
    available: int
    detail: str  # how ``available`` was obtained, for the log line

    def describe(self) -> str:
        return f"{self.name} ({format_bytes(self.available)} {self.detail})"


# -- parsers (pure; file contents in, numbers out) ---------------------------------------------
def parse_cgroup_value(text: str | None) -> int | None:
    """A cgroup limit or usage file's value in bytes; ``None`` for "max", no limit or no file.

    Example:
        >>> parse_cgroup_value("max\\n"), parse_cgroup_value("1073741824\\n"), parse_cgroup_value("9223372036854771712")
        (None, 1073741824, None)
    """
    if text is None:
        return None
    value = text.strip()
    if not value.isdigit():
        return None  # "max" (v2), or an unreadable value
    number = int(value)
    return None if number >= UNLIMITED_CGROUP else number


def parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory-controller path) of the process from the text of ``/proc/<pid>/cgroup``.

    Example:
        >>> parse_proc_cgroup("4:memory:/process_api/abc\\n1:cpu:/\\n0::/user.slice\\n")
        ('/user.slice', '/process_api/abc')
    """
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def cgroup_dirs(root: str, path: str) -> list[str]:
    """The cgroup folder of ``path`` under ``root`` and each of its ancestors up to ``root``, deepest first.

    Inside a container the process's path may not exist under the mount (the namespace's root
    is mounted): then the mount root alone is the process's group.
    """
    parts = [p for p in path.strip("/").split("/") if p]
    dirs = [os.path.join(root, *parts[:i]) for i in range(len(parts), 0, -1)]
    dirs.append(root)
    existing = [d for d in dirs if os.path.isdir(d)]
    return existing or []


def cgroup_limit(proc_cgroup: str = PROC_CGROUP, root: str = CGROUP_ROOT) -> Limit | None:
    """The tightest cgroup memory limit on this process: limit − usage of its group or an ancestor.

    cgroup v2 (``<root>/<path>/memory.max`` and ``memory.current``) is read first, then v1
    (``<root>/memory/<path>/memory.limit_in_bytes`` and ``memory.usage_in_bytes``). ``None``
    where no group sets a limit (or none can be read).
    """
    text = read_text(proc_cgroup)
    if text is None:
        return None
    v2, v1 = parse_proc_cgroup(text)
    candidates: list[Limit] = []
    if v2 is not None:
        candidates += _group_limits(cgroup_dirs(root, v2), "memory.max", "memory.current", "cgroup v2 memory.max")
    if v1 is not None:
        candidates += _group_limits(
            cgroup_dirs(os.path.join(root, "memory"), v1),
            "memory.limit_in_bytes", "memory.usage_in_bytes", "cgroup v1 memory.limit_in_bytes",
        )
    return min(candidates, key=lambda limit: limit.available, default=None)


def _group_limits(dirs: list[str], limit_file: str, usage_file: str, name: str) -> list[Limit]:
    limits = []
    for folder in dirs:
        limit = parse_cgroup_value(read_text(os.path.join(folder, limit_file)))
        usage = parse_cgroup_value(read_text(os.path.join(folder, usage_file)))
        if limit is None:
            continue
        used = usage or 0
        limits.append(Limit(
            name, max(0, limit - used),
            f"free of {format_bytes(limit)} in {folder}, {format_bytes(used)} used",
        ))
    return limits


def rlimit_limits(status_text: str | None) -> list[Limit]:
    """``RLIMIT_AS`` − virtual size (``VmSize``) and ``RLIMIT_DATA`` − data segment (``VmData``).

    ``status_text`` is the text of ``/proc/self/status``; the soft limits are this process's own.
    An unlimited resource gives no limit.
    """
    sizes = parse_proc_status(status_text or "")
    limits = []
    for name, size_field, what in (("RLIMIT_AS", "VmSize", "process size"), ("RLIMIT_DATA", "VmData", "data size")):
        soft = resource.getrlimit(getattr(resource, name))[0]
        if soft == resource.RLIM_INFINITY or soft < 0:
            continue
        size = sizes.get(size_field)
        if size is None:
            continue
        limits.append(Limit(name, max(0, soft - size), f"above the {what} of {format_bytes(size)}"))
    return limits


def meminfo_available(meminfo_text: str | None) -> int | None:
    """``MemAvailable`` of the text of ``/proc/meminfo``, in bytes."""
    return parse_proc_status(meminfo_text or "").get("MemAvailable")


# -- the limits of a device --------------------------------------------------------------------
def host_limits() -> list[Limit]:
    """Every limit on this process's host memory that can be read here."""
    limits = []
    available = meminfo_available(read_text("/proc/meminfo"))
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = None
    if available is not None:
        limits.append(Limit("MemAvailable", available, "available RAM"))
    group = cgroup_limit()
    if group is not None:
        limits.append(group)
    limits += rlimit_limits(read_text(STATUS_PATH))
    return limits


def cuda_limits(device: torch.device) -> list[Limit]:
    """On a CUDA device: free + this process's reserved bytes, and the per-process fraction's cap.

    Both count what this process's caching allocator may reserve in all, so they are comparable
    with each other and with the step's peak.
    """
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    limits = [Limit("CUDA free + own reserved", free + reserved,
                    f"= {format_bytes(free)} free + {format_bytes(reserved)} reserved by this process")]
    fraction = per_process_fraction(device)
    if fraction < 1.0:
        limits.append(Limit("set_per_process_memory_fraction", int(total * fraction),
                            f"= {fraction:g} of {format_bytes(total)}"))
    return limits


def device_limits(backend: AllocatorBackend) -> list[Limit]:
    """The limits that apply to the memory behind ``backend``."""
    if backend.kind == "cpu":
        return host_limits()
    if backend.kind == "cuda":
        return cuda_limits(backend.device)
    available = backend.available()
    return [] if available is None else [Limit(f"available {backend.device} memory", available, "free")]


def validate_budget(budget: BudgetSpec) -> None:
    """Fail fast on a budget that can never work, before any device is known.

    Example:
        >>> validate_budget("20GiB"); validate_budget(0.8); validate_budget(None)
        >>> validate_budget("twenty")
        Traceback (most recent call last):
        ...
        hf_memwatch.core.errors.MemWatchConfigError: cannot parse budget 'twenty': expected a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '20GiB', or a fraction such as '0.8'
    """
    if budget is None:
        return
    # A fraction needs the capacity only to scale; any positive capacity validates its range.
    parse_bytes(budget, capacity=1 << 40, what="budget")


@dataclass(frozen=True)
class Budget:
    """A resolved budget: ``total`` as the user meant it, ``usable`` what plans are made against.

    ``bound_by`` names the limit the default budget was taken from (``None`` for a user budget);
    ``limits`` keeps every candidate limit read, so a log line can say which bound and by how much.
    """

    total: int
    margin: int
    source: str  # how it was obtained, for the plan's log line
    bound_by: str | None = None
    limits: tuple[Limit, ...] = field(default=())
    margin_source: str = ""  # what the margin was sized from, for the log line and the plan record

    @property
    def usable(self) -> int:
        return self.total - self.margin

    @property
    def margin_ratio(self) -> float:
        """The margin as a share of the usable bytes: the footprint planned for beyond the allocated bytes."""
        return self.margin / max(1, self.usable)

    def with_margin(self, margin: int, source: str) -> Budget:
        """This budget keeping ``margin`` bytes for the footprint beyond the allocated ones (``source``: measured how).

        Example:
            >>> Budget(total=1250, margin=0, source="user budget").with_margin(250, "measured").margin_ratio
            0.25
        """
        return dataclasses.replace(self, margin=max(0, min(int(margin), self.total)), margin_source=source)

    def with_ratio(self, ratio: float, source: str) -> Budget:
        """This budget planning against ``total / (1 + ratio)``: a footprint ``ratio`` beyond the allocated bytes.

        Example:
            >>> Budget(total=1250, margin=0, source="user budget").with_ratio(0.25, "measured").usable
            1000
        """
        return self.with_margin(self.total - int(self.total / (1.0 + max(0.0, ratio))), source)

    def with_usable(self, usable: int, source: str) -> Budget:
        """A lower limit planned against, the same margin kept above it (the safety net's after an OOM)."""
        return dataclasses.replace(self, total=usable + self.margin, source=source)

    @property
    def binding_limit(self) -> Limit | None:
        return next((limit for limit in self.limits if limit.name == self.bound_by), None)

    def describe(self) -> str:
        margin = (f" (planning against {format_bytes(self.usable)}, margin {self.margin_ratio:.1%}: "
                  f"{self.margin_source or 'fragmentation'})" if self.margin else "")
        return f"{format_bytes(self.total)} [{self.source}]{margin}"

    def limits_record(self) -> dict[str, int]:
        """``{limit name: available bytes}`` of every candidate, for a plan record."""
        return {limit.name: limit.available for limit in self.limits}


def tightest(limits: list[Limit]) -> Limit | None:
    return min(limits, key=lambda limit: limit.available, default=None)


def machine_capacity(backend: AllocatorBackend) -> int | None:
    """All the memory the device behind ``backend`` has: the device's total, on the CPU the host's
    physical memory (``sysconf``); None when unreadable."""
    if backend.kind != "cpu":
        return backend.capacity()
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _within_machine(total: int, given: BudgetSpec, backend: AllocatorBackend) -> None:
    """A byte budget above all the memory the device has cannot be what the user meant."""
    capacity = machine_capacity(backend)
    if capacity is not None and total > capacity:
        raise MemWatchConfigError(
            f"MemWatch(budget={given!r}) is {format_bytes(total)}, more than {backend.device} has in all "
            f"({format_bytes(capacity)}); give a size below it or a fraction such as 0.8"
        )


def resolve_budget(budget: BudgetSpec, backend: AllocatorBackend) -> Budget:
    """Turn ``MemWatch(budget=...)`` into bytes for the device behind ``backend``.

    Example:
        >>> from hf_memwatch.measure.backends import backend_for
        >>> import torch
        >>> resolve_budget("1GiB", backend_for(torch.device("cpu"))).usable
        1073741824
        >>> b = resolve_budget(None, backend_for(torch.device("cpu")))
        >>> b.bound_by in b.limits_record()
        True
    """
    bound_by: str | None = None
    limits: tuple[Limit, ...] = ()
    fraction = fraction_of(budget)
    if budget is None:
        limits = tuple(device_limits(backend))
        binding = tightest(list(limits))
        if binding is None:
            raise MemWatchConfigError(
                f"MemWatch(auto=True) cannot read how much memory {backend.device} has; "
                "pass budget= in bytes or as a size such as '20GiB'"
            )
        total = int(DEFAULT_FRACTION * binding.available)
        bound_by = binding.name
        source = f"{DEFAULT_FRACTION:.0%} of {binding.describe()}"
    elif fraction is not None:
        if backend.kind == "cpu":
            limits = tuple(host_limits())
            binding = tightest(list(limits))
            capacity = None if binding is None else binding.available
            bound_by = None if binding is None else binding.name
        else:
            capacity = backend.capacity()
        if capacity is None:
            raise MemWatchConfigError(
                f"MemWatch(budget={budget}) is a fraction, but the capacity of {backend.device} is unknown; "
                "pass bytes or a size such as '20GiB'"
            )
        total = parse_bytes(fraction, capacity=capacity)
        source = f"{fraction:g} of {format_bytes(capacity)}" + (f" ({bound_by})" if bound_by else "")
    else:
        total = parse_bytes(budget)
        source = "user budget"
        _within_machine(total, budget, backend)
    margin = int(CUDA_FRAGMENTATION_MARGIN * total) if backend.exact else 0
    return Budget(total=total, margin=margin, source=source, bound_by=bound_by, limits=limits,
                  margin_source="prior for allocator fragmentation, not measured yet" if margin else "")


def footprint_kind(budget: Budget, backend: AllocatorBackend) -> FootprintKind | None:
    """What the limit behind ``budget`` counts (:data:`~hf_memwatch.measure.footprint.FootprintKind`).

    CUDA: reserved bytes. The CPU: the virtual size under ``RLIMIT_AS``/``RLIMIT_DATA``, the resident
    size under a cgroup or ``MemAvailable``, the allocated bytes for a budget the user gave in bytes
    (defined in them, see the module doc). ``None``: other devices (the prior margin stays).
    """
    if backend.kind == "cuda":
        return "reserved"
    if backend.kind != "cpu":
        return None
    if budget.bound_by is None:
        return "allocated"
    return "vms" if budget.bound_by in VIRTUAL_SIZE_LIMITS else "rss"


def margin_before_training(budget: Budget, backend: AllocatorBackend) -> Budget:
    """``budget`` with its margin sized from what this process can measure before training.

    The CPU under a real limit: :func:`~hf_memwatch.measure.footprint.probe_host_gap` — how much the
    limit's count grows beyond a small allocation made and freed twice (malloc's retained heap and
    page rounding). CUDA: the reserve gap now, when it exceeds the prior (nothing of the step is known
    yet, so the prior stays the floor until the first steps measure their own). A budget the user
    gave in bytes on the CPU counts allocated bytes: no margin.
    """
    kind = footprint_kind(budget, backend)
    if kind == "allocated":
        return budget.with_margin(0, "a byte budget on the CPU counts allocated tensor bytes")
    if kind in ("vms", "rss"):
        # The allocator's overhead per allocated byte, as a share of every byte planned.
        probe = min(PROBE_BYTES, max(1, budget.total // 8))
        gap = probe_host_gap(kind, probe)
        if gap is None:
            return budget
        return budget.with_ratio(gap / probe, f"{kind} peaked {format_bytes(gap)} beyond a "
                                              f"{format_bytes(probe)} probe allocation, before training")
    if kind == "reserved":
        gap = cuda_reserve_gap(torch.cuda.memory_stats(backend.device))
        if gap is not None and gap > budget.margin:  # the allocator's cache now, if above the prior
            return budget.with_margin(gap, f"reserved − allocated {format_bytes(gap)} before training")
    return budget



def remaining(backend: AllocatorBackend) -> int | None:
    """Bytes this process may still take on the memory behind ``backend`` under its tightest limit.

    Host limits already count what is left; CUDA limits count all the allocator may reserve, so
    what it has reserved is taken off.
    """
    binding = tightest(device_limits(backend))
    if binding is None:
        return None
    if backend.kind == "cuda":
        return max(0, binding.available - torch.cuda.memory_reserved(backend.device))
    return binding.available


def with_predicted_reserve(budget: Budget, estimate: object) -> Budget:
    """On CUDA, the margin planned for the configured step's *predicted* reserve (before any step ran).

    ``estimate``: the configured step's :class:`~hf_memwatch.estimation.estimate.MemoryEstimate`. Its
    ``reserved_bytes`` (the caching allocator replayed over the step's allocations) above its
    ``peak_bytes`` becomes the margin's ratio when larger than the margin in force, so a plan's
    allocated peak is compared with the budget as its reserve will be; NCCL buffers (not allocated
    before the first collective) are kept free on top. The CUDA default budget (free + this
    process's reserved) already leaves out the context the process holds. Unchanged without a
    reserve prediction (the CPU, other devices).

    Example:
        >>> from types import SimpleNamespace as Est
        >>> b = Budget(total=1250, margin=0, source="user budget")
        >>> with_predicted_reserve(b, Est(peak_bytes=1000, reserved_bytes=1250, device_overheads={})).usable
        1000
        >>> with_predicted_reserve(b, Est(peak_bytes=1000, reserved_bytes=None)).usable
        1250
    """
    reserved = getattr(estimate, "reserved_bytes", None)
    peak = int(getattr(estimate, "peak_bytes", 0) or 0)
    if reserved is None or peak <= 0:
        return budget
    ratio = max(0.0, (int(reserved) - peak) / peak)
    nccl = int((getattr(estimate, "device_overheads", None) or {}).get("nccl_buffers") or 0)
    planned = budget
    if ratio > budget.margin_ratio:
        planned = budget.with_ratio(ratio, f"predicted reserve {format_bytes(int(reserved))}, {ratio:.1%} above "
                                           "the allocated peak (the caching allocator replayed)")
    if nccl:
        planned = planned.with_margin(planned.margin + nccl, f"{planned.margin_source} + NCCL buffers {format_bytes(nccl)}")
    return planned
