"""What reporting knows of a run's plan: the small protocol the scalars, the summary and the
post-mortem read — never the callback itself.

Example:
    >>> from hf_memwatch.core.records import PlanRecord
    >>> from hf_memwatch.core.plan import Plan
    >>> plan = PlanRecord(plan=Plan(2, 2, False, "adamw_torch", predicted_peak=300, reason="fits"), budget=400)
    >>> known = KnownPlan(budget=None, plan=plan)
    >>> known.budget_bytes, known.predicted_peak, KnownPlan().budget_bytes
    (400, 300, None)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..core.records import PlanRecord


class PlanFacts(Protocol):
    """The budget (bytes), the plan in force and its predicted peak, each None when unknown."""

    @property
    def budget_bytes(self) -> int | None: ...
    @property
    def plan(self) -> PlanRecord | None: ...
    @property
    def predicted_peak(self) -> int | None: ...


def _positive(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


@dataclass(frozen=True)
class KnownPlan:
    """:class:`PlanFacts` from the auto mode's budget and plan record (either may be None)."""

    budget: int | None = None  # the resolved budget's bytes (the auto mode's)
    plan: PlanRecord | None = None

    @property
    def budget_bytes(self) -> int | None:
        """The budget when one is known: the auto mode's, else the plan record's."""
        known = _positive(self.budget)
        return known if known is not None else _positive(None if self.plan is None else self.plan.budget)

    @property
    def predicted_peak(self) -> int | None:
        return _positive(None if self.plan is None else self.plan.predicted_peak)

    def plan_dict(self) -> dict[str, Any] | None:
        """The plan record as the timeline writes it (what the summary and the post-mortem describe)."""
        return None if self.plan is None else self.plan.to_dict()
