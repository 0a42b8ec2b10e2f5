"""The x-axis on wall-clock seconds, for the picture (``hf-memwatch report RUN -o memory.png --x
seconds``) and the page (its "x: seconds" button): every snapshot records its ``time``
(``time.time()`` when it was taken), so a position on the step axis (snapshot ``i`` at ``i``, a
phase's middle at ``i - 0.5``) maps to seconds since the first snapshot of all ranks; a snapshot's band
or bar spans the phase it closes (from the previous snapshot to its own), so a slow phase is as wide as
it took.

Example:
    >>> XAxis([0.0, 2.0, 3.0]).span(1), XAxis().span(1)
    ((0.0, 2.0), (0.5, 1.5))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import MemWatchConfigError


def time_positions(xs: list[Any], times: list[float]) -> list[Any]:
    """Positions on the step axis (snapshot ``i`` at ``i``, a phase's middle at ``i - 0.5``) as seconds:
    linear between the snapshots' wall-clock ``times`` (seconds since the first snapshot), clamped to
    the first and the last; None (a gap in a line) stays None.

    Example:
        >>> time_positions([0, 0.5, 1, None, 2.5, -0.5], [0.0, 2.0, 3.0])
        [0.0, 1.0, 2.0, None, 3.0, 0.0]
    """
    out: list[Any] = []
    last = len(times) - 1
    for x in xs:
        if x is None:
            out.append(None)
            continue
        i = min(max(int(x // 1), 0), last)
        if x <= 0 or i >= last:
            out.append(times[0] if x <= 0 else times[last])
            continue
        out.append(round(times[i] + (x - i) * (times[i + 1] - times[i]), 3))
    return out


X_AXES = ("steps", "seconds")


@dataclass(frozen=True)
class XAxis:
    """Where the picture puts a position of the step axis (snapshot ``i`` at ``i``): there (``steps``),
    or at wall-clock seconds since the first snapshot of all ranks (``times``: this rank's snapshots)."""

    times: list[float] | None = None  # None: on steps

    def at(self, x: float) -> float:
        return x if self.times is None else time_positions([x], self.times)[0]

    def span(self, i: int) -> tuple[float, float]:
        """Snapshot ``i``'s band: ±0.5 around it on steps; on seconds the phase it closes (as the page)."""
        return (i - 0.5, i + 0.5) if self.times is None else (self.times[max(i - 1, 0)], self.times[i])


def timed(runs: list[Any]) -> bool:
    """Every snapshot has its wall-clock ``time`` (a timeline written by hand may not); ``runs``: the
    report's ``RankTimeline``s (each with its ``snapshots``), typed loosely to keep this module below it."""
    return all(isinstance(s.time, (int, float)) for run in runs for s in run.snapshots)


def x_axes(runs: list[Any], x_axis: str) -> list[XAxis]:
    """Each rank's :class:`XAxis` (``x_axis``: ``steps`` or ``seconds``; ranks on one clock)."""
    if x_axis not in X_AXES:
        raise MemWatchConfigError(f"the x-axis is one of {', '.join(X_AXES)}; got {x_axis!r}")
    if x_axis == "steps":
        return [XAxis() for _ in runs]
    if not timed(runs):
        raise MemWatchConfigError("the x-axis on seconds needs each snapshot's time, which this timeline lacks "
                                  "(written by hand or by an older version): use --x steps")
    start = min((s.time for run in runs for s in run.snapshots), default=0.0)
    return [XAxis([round(s.time - start, 3) for s in run.snapshots]) for run in runs]
