"""``Plan`` (defined in :mod:`hf_memwatch.core.plan`, which the ``plan`` record nests; re-exported here
for the planning core): one configuration of a run that planning may choose — what the remedies of
:mod:`hf_memwatch.planning.catalogue` may change; and ``EvalSetting``, one configuration of an
evaluation loop (the eval remedies').

Example:
    >>> Plan(4, 4, True, "adamw_torch").effective_batch
    16
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..core.plan import Plan
from ..core.run_config import RunConfig

__all__ = ["EvalSetting", "Plan"]


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
