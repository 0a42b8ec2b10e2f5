"""The memory budget of the auto mode: what ``MemWatch(budget=...)`` means in bytes on this device.

* ``None`` (default): 90% of what this process may use — on CUDA the device total from
  ``mem_get_info`` minus what other processes already hold, on the CPU the available RAM.
* an ``int``: bytes; a ``str`` with a unit (``"20GiB"``, ``"500MB"``); a ``float`` in (0, 1]: a
  fraction of the device capacity (CUDA: total memory; CPU: available RAM).

On devices with a caching allocator (CUDA) a margin is kept below the budget for fragmentation:
the caching allocator reserves more than it hands out, so a plan is made against
``budget - margin`` (see :data:`CUDA_FRAGMENTATION_MARGIN`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import MemWatchConfigError
from ..core.units import format_bytes, parse_bytes
from ..measure.backends import AllocatorBackend

DEFAULT_FRACTION = 0.9
# Share of the budget kept free for allocator fragmentation on caching allocators (CUDA and the
# torch.accelerator devices). Not yet sized from GPU measurements: see docs/auto.md.
CUDA_FRAGMENTATION_MARGIN = 0.05

BudgetSpec = int | float | str | None


def validate_budget(budget: BudgetSpec) -> None:
    """Fail fast on a budget that can never work, before any device is known.

    Example:
        >>> validate_budget("20GiB"); validate_budget(0.8); validate_budget(None)
        >>> validate_budget("twenty")
        Traceback (most recent call last):
        ...
        hf_memwatch.core.errors.MemWatchConfigError: cannot parse budget 'twenty': expected a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '20GiB'
    """
    if budget is None:
        return
    # A fraction needs the capacity only to scale; any positive capacity validates its range.
    parse_bytes(budget, capacity=1 << 40, what="budget")


@dataclass(frozen=True)
class Budget:
    """A resolved budget: ``total`` as the user meant it, ``usable`` what plans are made against."""

    total: int
    margin: int
    source: str  # how it was obtained, for the plan's log line

    @property
    def usable(self) -> int:
        return self.total - self.margin

    def describe(self) -> str:
        margin = f" (planning against {format_bytes(self.usable)}, fragmentation margin kept)" if self.margin else ""
        return f"{format_bytes(self.total)} [{self.source}]{margin}"


def resolve_budget(budget: BudgetSpec, backend: AllocatorBackend) -> Budget:
    """Turn ``MemWatch(budget=...)`` into bytes for the device behind ``backend``.

    Example:
        >>> from hf_memwatch.measure.backends import backend_for
        >>> import torch
        >>> resolve_budget("1GiB", backend_for(torch.device("cpu"))).usable
        1073741824
    """
    if budget is None:
        available = backend.available()
        if available is None:
            raise MemWatchConfigError(
                f"MemWatch(auto=True) cannot read how much memory {backend.device} has; "
                "pass budget= in bytes or as a size such as '20GiB'"
            )
        total = int(DEFAULT_FRACTION * available)
        source = f"{DEFAULT_FRACTION:.0%} of available {backend.device} memory"
    elif isinstance(budget, float) and not isinstance(budget, bool):
        capacity = backend.available() if backend.kind == "cpu" else backend.capacity()
        if capacity is None:
            raise MemWatchConfigError(
                f"MemWatch(budget={budget}) is a fraction, but the capacity of {backend.device} is unknown; "
                "pass bytes or a size such as '20GiB'"
            )
        total = parse_bytes(budget, capacity=capacity)
        source = f"{budget:g} of {format_bytes(capacity)}"
    else:
        total = parse_bytes(budget)
        source = "user budget"
    margin = int(CUDA_FRAGMENTATION_MARGIN * total) if backend.exact else 0
    return Budget(total=total, margin=margin, source=source)
