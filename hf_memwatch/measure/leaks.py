"""Drift and leaks: a memory class that grows step after step, found from the ``step_end`` snapshots.

At ``step_end`` a healthy step is back where the previous one ended: activations freed, gradients
zeroed, the optimizer state created once. A class that keeps growing there (tensors kept across
steps — a list of losses with their graphs, a growing cache; or host memory: ``host_rss``) is a
leak that will end in out-of-memory. Detection is robust to noise: over the last ``window`` steps
(at least ``min_steps``) the least-squares slope must reach ``threshold`` bytes per step *and*
most consecutive differences must be positive. The first ``skip_steps`` step ends are left out
(the first step creates the optimizer state and warms caches up).

:func:`find_leaks` is pure; :class:`LeakWatch` keeps the history of one run and reports each
growing class once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.categories import LIVE_CLASSES
from ..core.records import LeakRecord, Snapshot

MiB = 1 << 20
LEAK_THRESHOLD = 1 * MiB  # bytes per step
LEAK_WINDOW = 8  # steps looked at
LEAK_MIN_STEPS = 5  # steps needed before any verdict
LEAK_POSITIVE_SHARE = 0.75  # share of consecutive step-to-step differences that must be growth
LEAK_SKIP_STEPS = 1  # first step ends left out (optimizer state creation, warm-up)
HOST_RSS = "host_rss"
# The process's resident size moves by tens of MiB between steps as malloc grows and trims its heap
# (measured on the demo: 994-1089 MiB, no leak): host_rss is judged on a full window and must be
# explained by the line (coefficient of determination), not by a few lucky rises.
HOST_RSS_MIN_STEPS = LEAK_WINDOW
HOST_RSS_MIN_FIT = 0.8


def step_end_figures(snapshot: Snapshot) -> dict[str, int]:
    """``{class: bytes}`` of one ``step_end`` snapshot: each live class and ``host_rss`` (when known).

    Example:
        >>> step_end_figures(Snapshot.from_dict({"live": {"weights": 10, "other": None}, "host_rss": 99}, lenient=True))
        {'weights': 10, 'host_rss': 99}
    """
    figures = {name: int(value) for name, value in (snapshot.live or {}).items()
               if name in LIVE_CLASSES and value is not None}
    if snapshot.host_rss is not None:
        figures[HOST_RSS] = int(snapshot.host_rss)
    return figures


def slope(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` over their positions (bytes per step).

    Example:
        >>> slope([0, 2, 4, 6]), slope([5, 5, 5])
        (2.0, 0.0)
    """
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def fit(values: Sequence[float]) -> float:
    """Coefficient of determination of the least-squares line through ``values`` (1: a straight line).

    Example:
        >>> fit([0, 2, 4, 6]), round(fit([0, 5, 1, 6]), 2)
        (1.0, 0.38)
    """
    n = len(values)
    mean_y = sum(values) / n if n else 0.0
    total = sum((v - mean_y) ** 2 for v in values)
    if total == 0:
        return 1.0
    rate, mean_x = slope(values), (n - 1) / 2
    residual = sum((v - (mean_y + rate * (i - mean_x))) ** 2 for i, v in enumerate(values))
    return 1.0 - residual / total


def positive_share(values: Sequence[float]) -> float:
    """Share of consecutive differences that are positive."""
    deltas = [b - a for a, b in zip(values, values[1:])]
    return sum(d > 0 for d in deltas) / len(deltas) if deltas else 0.0


def predicted_oom_step(last_step: int, bytes_per_step: float, headroom: int | None) -> int | None:
    """The step at which ``headroom`` bytes are used up growing ``bytes_per_step`` (``None`` unknown).

    Example:
        >>> predicted_oom_step(10, 2 * MiB, 100 * MiB)
        60
    """
    if headroom is None or bytes_per_step <= 0:
        return None
    return last_step + max(0, math.ceil(headroom / bytes_per_step))


def find_leaks(
    history: Sequence[Mapping[str, Any]],
    *,
    threshold: float = LEAK_THRESHOLD,
    window: int = LEAK_WINDOW,
    min_steps: int = LEAK_MIN_STEPS,
    share: float = LEAK_POSITIVE_SHARE,
    skip_steps: int = LEAK_SKIP_STEPS,
    headroom: Callable[[str], int | None] | None = None,
    rank: int = 0,
) -> list[LeakRecord]:
    """Classes growing step after step in ``history`` (``[{"step": n, "figures": {class: bytes}}, ...]``).

    Returns one ``leak`` record (:class:`~hf_memwatch.core.records.LeakRecord`: ``klass``,
    ``bytes_per_step``, ``since_step``, ``step``, ``predicted_oom_step``, ``rank``) per growing class;
    ``headroom(class)`` gives the bytes left before the limit for the prediction (``None``: not predicted).

    Example:
        >>> h = [{"step": s, "figures": {"other": 100 + (s - 1) * 2 * MiB}} for s in range(1, 8)]
        >>> [(f.klass, f.bytes_per_step, f.since_step) for f in find_leaks(h)]
        [('other', 2097152, 2)]
    """
    usable = list(history[skip_steps:])
    if len(usable) < min_steps:
        return []
    recent = usable[-window:]
    last_step = int(recent[-1]["step"])
    names = set(recent[-1]["figures"])
    findings = []
    for name in sorted(names):
        values = [row["figures"].get(name) for row in recent]
        if any(v is None for v in values):
            continue
        rate = slope(values)
        if rate < threshold or positive_share(values) < share:
            continue
        if name == HOST_RSS and (len(values) < HOST_RSS_MIN_STEPS or fit(values) < HOST_RSS_MIN_FIT):
            continue
        findings.append(LeakRecord(
            klass=name,
            bytes_per_step=int(round(rate)),
            since_step=growth_start(usable, name, len(recent)),
            step=last_step,
            predicted_oom_step=predicted_oom_step(last_step, rate, headroom(name) if headroom else None),
            rank=rank,
        ))
    return findings


def growth_start(rows: Sequence[Mapping[str, Any]], name: str, window: int) -> int:
    """The step from which ``name`` has grown: the window's first step, earlier while it kept growing."""
    start = len(rows) - window
    while start > 0:
        before, after = rows[start - 1]["figures"].get(name), rows[start]["figures"].get(name)
        if before is None or after is None or after <= before:
            break
        start -= 1
    return int(rows[start]["step"])


@dataclass
class LeakWatch:
    """The step-end history of one run; reports each growing class once.

    ``rate`` is the largest growth (bytes per step) among the classes found growing at the last
    step, 0 once reported leaks stopped growing, ``None`` before any leak was found.
    """

    threshold: float = LEAK_THRESHOLD
    history: list[dict[str, Any]] = field(default_factory=list)
    reported: dict[str, LeakRecord] = field(default_factory=dict)
    rate: int | None = None
    rank: int = 0  # written in the leak records

    def observe(
        self, step: int, snapshot: Snapshot, headroom: Callable[[str], int | None] | None = None
    ) -> list[LeakRecord]:
        """Add one ``step_end`` snapshot; the leak records found for the first time at this step."""
        if self.history and self.history[-1]["step"] >= step:  # a resumed or repeated step restarts the trend
            self.history.clear()
        self.history.append({"step": step, "figures": step_end_figures(snapshot)})
        del self.history[: -(LEAK_WINDOW + LEAK_SKIP_STEPS + 64)]  # growth_start looks back; keep it bounded
        growing = find_leaks(self.history, threshold=self.threshold, rank=self.rank)
        if growing:
            self.rate = max(int(f.bytes_per_step) for f in growing)
        elif self.reported:
            self.rate = 0
        new = [f for f in growing if f.klass not in self.reported]
        if new and headroom is not None:  # predictions only for what is reported (reads the limits)
            new = find_leaks(self.history, threshold=self.threshold, headroom=headroom, rank=self.rank)
            new = [f for f in new if f.klass not in self.reported]
        for finding in new:
            self.reported[finding.klass] = finding
        return new
