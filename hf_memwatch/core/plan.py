"""``Plan``: one configuration of a run that planning may choose — the one definition (re-exported by
:mod:`hf_memwatch.planning.plan`, where the planning core uses it).

It lives on the ground floor because the auto mode's ``plan`` record
(:class:`~hf_memwatch.core.records.PlanRecord`) nests it: the plan keeps one form from the chooser to
:func:`~hf_memwatch.integration.apply.apply_plan`. Light: no torch (a :class:`RunConfig` is only read).

A plan changes only what the remedies of :mod:`hf_memwatch.planning.catalogue` may change: the
micro-batch with the accumulation (effective batch kept exactly), activation checkpointing and
the optimizer's state precision (8-bit AdamW for AdamW). Everything else about training is the
run's own.

Example:
    >>> from hf_memwatch.core.run_config import RunConfig
    >>> run = RunConfig(micro_batch_size=16, gradient_accumulation_steps=1)
    >>> plan = Plan(4, 4, True, "adamw_torch")
    >>> plan.changes_from(run)
    ['micro-batch 16 -> 4 x accumulation 4', 'activation checkpointing']
    >>> plan.configure(run).effective_batch
    16
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .units import format_bytes

if TYPE_CHECKING:
    from .run_config import RunConfig


@dataclass
class Plan:
    """A configuration with what it is predicted to need.

    ``relative_throughput`` is predicted samples per second relative to the run as configured (1.0);
    ``verified`` is true when ``predicted_peak`` comes from a prediction of this very configuration
    (not interpolated between others).
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    activation_checkpointing: bool
    optim: str
    predicted_peak: int | None = None
    relative_throughput: float = 1.0
    verified: bool = False
    reason: str = ""

    @classmethod
    def of(cls, run: RunConfig) -> Plan:
        """The run as configured, as a plan."""
        return cls(run.micro_batch_size, run.gradient_accumulation_steps, run.activation_checkpointing, run.optim)

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps

    def key(self) -> tuple[int, int, bool, str]:
        return (self.micro_batch_size, self.gradient_accumulation_steps, self.activation_checkpointing, self.optim)

    def configure(self, run: RunConfig) -> RunConfig:
        """``run`` with this plan applied."""
        return run.replace(micro_batch_size=self.micro_batch_size,
                           gradient_accumulation_steps=self.gradient_accumulation_steps,
                           activation_checkpointing=self.activation_checkpointing, optim=self.optim)

    def changes_from(self, run: RunConfig) -> list[str]:
        """What this plan changes in ``run``, in words (empty: the run as configured)."""
        changes = []
        if self.micro_batch_size != run.micro_batch_size:
            changes.append(f"micro-batch {run.micro_batch_size} -> {self.micro_batch_size} x accumulation "
                           f"{self.gradient_accumulation_steps}")
        if self.activation_checkpointing != run.activation_checkpointing:
            changes.append("activation checkpointing")
        if self.optim != run.optim:
            changes.append(f"optim {run.optim} -> {self.optim}")
        return changes

    def describe(self) -> str:
        parts = [f"micro-batch {self.micro_batch_size} x accumulation {self.gradient_accumulation_steps}",
                 "activation checkpointing" if self.activation_checkpointing else "no checkpointing",
                 f"optim {self.optim}"]
        if self.predicted_peak is not None:
            parts.append(f"predicted peak {format_bytes(self.predicted_peak)}")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (the CLI's ``plan`` object)."""
        return {
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "activation_checkpointing": self.activation_checkpointing,
            "optim": self.optim,
            "predicted_peak": None if self.predicted_peak is None else int(self.predicted_peak),
            "relative_throughput": round(self.relative_throughput, 3),
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The inverse of :meth:`as_dict` (and of a ``plan`` record's plan fields)."""
        return cls(
            int(data["micro_batch_size"]), int(data["gradient_accumulation_steps"]),
            bool(data["activation_checkpointing"]), str(data["optim"]),
            predicted_peak=data.get("predicted_peak"),
            relative_throughput=float(data.get("relative_throughput", 1.0) or 1.0),
            reason=str(data.get("reason", "")),
        )

    def replace(self, **changes: Any) -> Plan:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)
