"""``Plan``: one configuration of a run that planning may choose — the one definition.

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
from typing import Any

from ..core.run_config import RunConfig
from ..core.units import format_bytes


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
        return cls(run.micro_batch_size, run.gradient_accumulation_steps, run.checkpointing, run.optim)

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps

    def key(self) -> tuple[int, int, bool, str]:
        return (self.micro_batch_size, self.gradient_accumulation_steps, self.activation_checkpointing, self.optim)

    def configure(self, run: RunConfig) -> RunConfig:
        """``run`` with this plan applied."""
        return run.replace(micro_batch_size=self.micro_batch_size,
                           gradient_accumulation_steps=self.gradient_accumulation_steps,
                           checkpointing=self.activation_checkpointing, optim=self.optim)

    def changes_from(self, run: RunConfig) -> list[str]:
        """What this plan changes in ``run``, in words (empty: the run as configured)."""
        changes = []
        if self.micro_batch_size != run.micro_batch_size:
            changes.append(f"micro-batch {run.micro_batch_size} -> {self.micro_batch_size} x accumulation "
                           f"{self.gradient_accumulation_steps}")
        if self.activation_checkpointing != run.checkpointing:
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


@dataclass(frozen=True)
class EvalSetting:
    """One configuration of an evaluation loop that the eval remedies of
    :mod:`hf_memwatch.planning.catalogue` (:data:`~hf_memwatch.planning.catalogue.EVAL_REMEDIES`) may
    change: the eval batch, how often outputs leave the device, and — advice only, never applied by a
    planner — the metrics code's reduction of the logits (``preprocess_logits_for_metrics`` returning
    ``logits.argmax(-1)``) or no outputs kept at all (``prediction_loss_only``).

    Example:
        >>> EvalSetting.of(RunConfig(4, eval_batch_size=64)).replace(eval_batch_size=32)
        EvalSetting(eval_batch_size=32, eval_accumulation_steps=None, preprocess_argmax=False, prediction_loss_only=False)
    """

    eval_batch_size: int
    eval_accumulation_steps: int | None
    preprocess_argmax: bool = False
    prediction_loss_only: bool = False

    @classmethod
    def of(cls, run: RunConfig, *, preprocess_argmax: bool = False) -> EvalSetting:
        """The loop as ``run`` configures it (``preprocess_argmax``: its metrics code reduces the logits)."""
        return cls(int(run.eval_batch_size or 8), run.eval_accumulation_steps, preprocess_argmax,
                   bool(run.prediction_loss_only))

    def replace(self, **changes: Any) -> EvalSetting:
        return dataclasses.replace(self, **changes)
