"""The one predictor of the planning core: the estimator, replaying the run's own step on fake tensors.

Given a Trainer, each plan is predicted by :func:`hf_memwatch.estimate` on that Trainer — its own
``training_step`` and ``compute_loss`` (subclass overrides included), accelerate's autocast path in
the run's precision, its collator on the longest sample of its dataset — so the prediction is of
the step training will really run, and nothing is allocated or left behind. Given a model or a
config (the command line, the planner API), the estimator replays the plain Trainer's step.

:data:`ESTIMATE_MARGIN` covers what the replay does not see (measured: median 0.02% and worst
1.5% from the CPU profiler's truth, ``benchmarks/results/accuracy.md``), so a predicted peak is
meant to lie above the measured one by less than 3%.
"""

from __future__ import annotations

import math
from typing import Any

from ..core.categories import AFTER_OPTIMIZER, FORWARD_BACKWARD_PHASES, STEP_END
from ..core.run_config import RunConfig
from .chooser import PeakParts
from .plan import Plan

ESTIMATE_MARGIN = 0.015


def with_margin(peak_bytes: int, margin: float = ESTIMATE_MARGIN) -> int:
    """A predicted peak as plans are held to it: ``peak_bytes`` with the ``margin``, rounded up.

    Example:
        >>> with_margin(1000)
        1015
    """
    return int(math.ceil(peak_bytes * (1.0 + margin)))


class EstimatorPredictor:
    """Exact predictions of plans of ``run`` by the estimator, cached per plan.

    ``subject``: a Trainer, a model, a config or a config path. ``estimator`` replaces
    :func:`hf_memwatch.estimate` (same keywords), e.g. a memoised one in tests; ``extra`` keywords go
    to every estimate (``lora=``, ``adapter=``).
    """

    def __init__(self, subject: Any, run: RunConfig, *, margin: float = ESTIMATE_MARGIN,
                 estimator: Any = None, sample_index: int | None = None, extra: dict[str, Any] | None = None) -> None:
        self.subject = subject
        self.run = run
        self.margin = margin
        self.estimator = estimator
        self.sample_index = sample_index
        self.extra = dict(extra or {})
        self.estimates: dict[tuple, Any] = {}
        self.floors: dict[tuple, Any] = {}  # forward/backward-only estimates
        self.calls = 0
        self.floor_calls = 0
        self.models: dict = {}  # the fake models the estimates share

    def estimate(self, plan: Plan) -> Any:
        """The :class:`~hf_memwatch.estimation.estimate.MemoryEstimate` of ``plan`` (cached)."""
        if plan.key() not in self.estimates:
            self.calls += 1
            self.estimates[plan.key()] = self._estimate(plan)
        return self.estimates[plan.key()]

    def remember(self, plan: Plan, estimate: Any) -> None:
        """Take ``estimate`` (a :class:`~hf_memwatch.estimation.estimate.MemoryEstimate` of ``plan`` made
        by the caller with the same keywords) as this predictor's: it is not predicted again."""
        self.estimates.setdefault(plan.key(), estimate)

    def _estimate(self, plan: Plan, **options: Any) -> Any:
        estimate = self.estimator
        if estimate is None:
            from ..estimation.estimate import estimate
        kwargs = plan.configure(self.run).estimate_kwargs()
        if self.sample_index is not None:
            kwargs["sample_index"] = self.sample_index
        kwargs.update(self.extra, **options)
        from ..estimation.memo import sharing

        with sharing(self.models):  # one fake model for every plan of the run (estimation/memo.py)
            return estimate(self.subject, **kwargs)

    def peak(self, plan: Plan) -> int:
        """Predicted step peak of ``plan`` with the margin, bytes per device."""
        return self._with_margin(self.estimate(plan).peak_bytes)

    def parts(self, plan: Plan) -> PeakParts:
        """The forward/backward part of ``plan``'s estimate (made already), without optimizer states.

        The states are known at the step's peak: when that is the optimizer step, they are at least
        those resident during the forward and backward, so the figure stays a floor.
        """
        return self._parts(self.estimate(plan))

    def floor_parts(self, plan: Plan) -> PeakParts:
        """The forward and backward of ``plan`` replayed alone (``optimizer_step=False``): cheaper
        than :meth:`estimate`, a floor under its peak once the optimizer's states are added."""
        if plan.key() not in self.floors:
            self.floor_calls += 1
            self.floors[plan.key()] = self._estimate(plan, optimizer_step=False)
        return self._parts(self.floors[plan.key()])

    def step_floor(self, plan: Plan) -> int:
        """What every plan of the run holds at its optimizer step — weights + gradients + ``plan``'s
        optimizer states, margin included — from the estimates in hand (0: none yet).

        None of the three depends on the micro-batch, the accumulation or checkpointing. Weights and
        gradients are read from estimates whose peak is at the optimizer step or ``zero_grad``: there
        the rank holds exactly the step's (inside the forward and backward it may hold more — layers a
        sharded engine gathered, unreduced gradients, casts). States, once made, stay until the run
        ends, so ``plan``'s optimizer's states at any estimate's peak are at most those at the step;
        without an estimate of that ``optim``:
        :func:`~hf_memwatch.planning.catalogue.state_bytes_floor` on the rank's share. Measured on the
        Llama-3.1-70B-shaped plan of ``benchmarks/planning_cost.py`` (fp32 master weights, budget
        916.8 GiB): 262.8 + 262.8 + 525.7 (AdamW) GiB = 1,051 GiB at every AdamW plan's step, so the
        checkpointed AdamW plans are ruled out without a replay (2 full and 1 forward/backward replays
        of 80 layers, 27 of 50 CPU seconds).
        """
        from .catalogue import state_bytes_floor

        at_step = [e for e in self.estimates.values() if e.peak_phase in (AFTER_OPTIMIZER, STEP_END)]
        if not at_step:
            return 0
        weights = max(e.classes.get("weights", 0) for e in at_step)
        gradients = max(e.classes.get("gradients", 0) for e in at_step)
        states = max((e.classes.get("optimizer_states", 0) for key, e in self.estimates.items()
                      if key[3] == plan.optim), default=0)
        if not self.run.custom_optimizer:
            sharded = self.run.shard != "none" and self.run.world_size > 1
            share = 1.0 / self.run.world_size if sharded else 1.0
            states = max(states, math.floor(state_bytes_floor(plan.optim, at_step[0].trainable_params) * share))
        return self._with_margin(weights + gradients + states)

    def _parts(self, estimate: Any) -> PeakParts:
        forward_backward = max(estimate.phase_peaks.get(phase, 0) for phase in FORWARD_BACKWARD_PHASES)
        sharded = self.run.shard != "none" and self.run.world_size > 1
        return PeakParts(forward_backward - estimate.classes.get("optimizer_states", 0), estimate.trainable_params,
                         state_share=1.0 / self.run.world_size if sharded else 1.0, margin=self.margin,
                         named_optimizer=not self.run.custom_optimizer)

    def _with_margin(self, peak_bytes: int) -> int:
        return with_margin(peak_bytes, self.margin)
