"""The planner API: the planning core for a model or a config described by plain values.

:func:`plan_for` is what ``hf-memwatch estimate --budget`` and Python users call; the auto mode
calls the same core (:func:`~hf_memwatch.planning.chooser.plan_run`) with the same predictor on
a live Trainer, so for the same configuration and budget both choose the same plan.

Usage:
    >>> from hf_memwatch.core.run_config import RunConfig                          # doctest: +SKIP
    >>> result = plan_for(cfg, RunConfig(micro_batch_size=16, seq_len=512), budget="8GiB")  # doctest: +SKIP
    >>> result.chosen.describe() if result.chosen else "nothing fits"                # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from ..core.errors import MemWatchConfigError
from ..core.run_config import RunConfig
from ..core.units import parse_bytes
from .chooser import PlanResult, plan_run
from .predict import EstimatorPredictor


def plan_for(model_or_config: Any, run: RunConfig, budget: int | str, *, estimator: Any = None,
             estimate_kwargs: dict[str, Any] | None = None) -> PlanResult:
    """The plan of ``run`` on ``model_or_config`` (a config, a path, a model or a Trainer) for ``budget``.

    ``estimator`` replaces :func:`hf_memwatch.estimate` (same keywords), e.g. a memoised one;
    ``estimate_kwargs`` are passed to every estimate (``lora=``, ``adapter=``: what is trained).
    """
    if run.seq_len is None:
        raise MemWatchConfigError("plan_for needs the run's seq_len")
    budget_bytes = parse_bytes(budget, what="budget")
    predictor = EstimatorPredictor(model_or_config, run, estimator=estimator, extra=estimate_kwargs)
    return plan_run(run, predictor, budget_bytes)
