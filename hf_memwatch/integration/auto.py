"""The auto mode: ``MemWatch(auto=True, budget=...)`` plans a run that fits before it starts.

How it reaches the run without an extra call from the user: at ``on_init_end`` the callback wraps
the Trainer instance's ``train`` (:meth:`AutoMode.install`). Before the original ``train()`` runs —
before a dataloader, optimizer or scheduler exists — :meth:`AutoMode.before_train`:

1. reads the run (:meth:`RunConfig.from_trainer <hf_memwatch.core.run_config.RunConfig.from_trainer>`)
   and resolves the budget (:mod:`hf_memwatch.planning.budget`);
2. plans with the one planning core (:func:`hf_memwatch.planning.chooser.plan_run`): candidates
   from the remedy catalogue, each predicted by the estimator replaying *this Trainer's own step*
   on fake tensors (:class:`~hf_memwatch.planning.predict.EstimatorPredictor`) — nothing is run
   on the live model, no batch is drawn from the user's iterator, no counter of the Trainer moves;
3. writes the plan into the Trainer (:func:`~hf_memwatch.integration.apply.apply_plan`) exactly
   as a user would configure it by hand, records it (timeline ``plan`` event, one log line, the
   callback's saved state) and calls the original ``train()``.

The plan is made against what the limit counts, not the allocated bytes alone: the budget's margin
is sized from the process's footprint (:func:`~hf_memwatch.planning.budget.margin_before_training`),
and after each of the first :data:`MEASURED_STEPS` steps :meth:`AutoMode.after_step` measures the
footprint the step really took (:func:`~hf_memwatch.measure.footprint.step_footprint`: CUDA reserved
bytes, the host's virtual or resident size) and the optimizer states it left allocated. That gap,
as a share of the allocated bytes, becomes the margin of any later plan (the safety net's), and
when the next step — the measured one plus its new states, or the planned worst batch — would not
fit with it, activation checkpointing is turned on between steps (``footprint`` and ``plan``
records, one log line with the figures). Later, checkpointing is turned on when a measured peak
comes within :data:`CHECKPOINT_TRIGGER` of the budget.

On resume from a checkpoint the recorded plan is kept when the run is resumed with the
configuration the plan was made for (its optimizer state and step count belong to that plan); a
run resumed with another batch size, accumulation or world size is planned anew for what the user
now asks, and the log says so.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ..core.errors import MemWatchConfigError, PlanError, is_oom_error
from ..core.run_config import RunConfig, generation_kwargs
from ..core.units import format_bytes
from ..estimation.trainer_replay import RngStates, is_one_pass, training_dataset
from ..measure.attribution import weight_storages
from ..measure.backends import backend_for
from ..measure.footprint import (
    FootprintKind,
    FootprintReading,
    StepFootprint,
    allocator_settings,
    expandable_segments_advice,
    host_reading,
    step_footprint,
)
from ..planning.budget import (
    Budget,
    BudgetSpec,
    footprint_kind,
    margin_before_training,
    resolve_budget,
    with_predicted_reserve,
)
from ..planning.catalogue import advice, with_state_share
from ..planning.chooser import PlanResult, no_fit_message, plan_run
from ..planning.eval_plan import plan_eval
from ..planning.lengths import WorstBatch, worst_batch
from ..planning.plan import Plan
from ..planning.predict import ESTIMATE_MARGIN, EstimatorPredictor
from .apply import apply_eval_plan, apply_plan, enable_checkpointing_now
from .patches import keep_effective_batch

logger = logging.getLogger("hf_memwatch")

# The safety net: out-of-memory errors in the first step recovered at most this many times, each
# planning against this share of the last failed plan's predicted peak.
MAX_RECOVERIES = 3
RECOVERY_SHRINK = 0.7
# Checkpointing is switched on between steps once a measured peak reaches this share of the budget.
CHECKPOINT_TRIGGER = 0.95
# The first steps whose footprint is measured against the limit: the first allocates the optimizer
# states, the second is the first to hold them through a whole step, the third confirms the gap.
MEASURED_STEPS = 3
# The configuration a plan was made for: a resumed run keeps the plan only when these are unchanged.
CONFIGURED_FIELDS = ("micro_batch_size", "gradient_accumulation_steps", "world_size")


def plan_record(result: PlanResult, run: RunConfig, budget: Budget, sample: dict[str, Any] | None) -> dict[str, Any]:
    """The ``plan`` event of the timeline contract for a chosen plan."""
    chosen = result.chosen
    assert chosen is not None
    return {
        "event": "plan",
        "micro_batch_size": chosen.micro_batch_size,
        "gradient_accumulation_steps": chosen.gradient_accumulation_steps,
        "activation_checkpointing": chosen.activation_checkpointing,
        "optim": chosen.optim,
        "predicted_peak": int(chosen.predicted_peak or 0),
        "budget": int(budget.total),
        "budget_source": budget.source,
        "budget_bound_by": budget.bound_by,
        "margin": round(budget.margin_ratio, 4),
        "margin_source": budget.margin_source,
        "reason": chosen.reason,
        "configured": {name: getattr(run, name) for name in CONFIGURED_FIELDS},
        "sample": sample,
        "source": "predicted",
    }


def log_advice(record: dict[str, Any], *, pressed: bool) -> None:
    """The plan record's advice in the log: a warning when memory pressed the plan (it changed the
    run), otherwise at INFO (a run that fits as given stays quiet: one plan line)."""
    for item in record.get("advice", ()):
        logger.log(logging.WARNING if pressed else logging.INFO, "hf-memwatch advice (not applied): %s would save %s: %s",
                   item["name"], format_bytes(item["saving"]), item["how"])


class EstimatorUnavailable(RuntimeError):
    """The estimator cannot replay this Trainer's step: the run trains as configured, with a warning."""


class AutoMode:
    """Plans before ``train()`` and keeps the run under budget between steps.

    ``plan`` (a dict, the ``plan`` event) survives in the callback's saved state.
    """

    def __init__(self, budget: BudgetSpec, record: Callable[[dict[str, Any]], None], *,
                 allow_over_budget: bool = False) -> None:
        self.budget_spec = budget
        self.allow_over_budget = allow_over_budget  # nothing fits: train as configured with an ERROR line
        self.record = record  # writes a timeline record and the callback state
        self.budget: Budget | None = None
        self.plan: dict[str, Any] | None = None
        self.planning_seconds: float | None = None
        self.recoveries: list[dict[str, Any]] = []  # oom_recovered records (written again at train begin)
        self._custom_optimizer = False
        self._checkpointing_refused = False
        self.installed = False  # train() wrapped: planning happens before the loop is built
        self.predictor: EstimatorPredictor | None = None  # the plan's, for a re-plan between steps
        self.kind: FootprintKind | None = None  # what the limit counts (None: not measured)
        self.baseline: FootprintReading | None = None  # the host footprint when training began
        self.measured: list[StepFootprint] = []  # the first steps' footprints
        self.advised = False  # the expandable-segments advice was logged
        self.plan_changed_the_run = False  # the last plan differs from the run as configured
        self._pending_why: str | None = None  # distributed: this rank's reason to switch, until agreed
        self._agreements = 0  # distributed: between-step agreements joined (the first MEASURED_STEPS steps)

    # -- wiring -------------------------------------------------------------------------------
    def train_call(self, trainer: Any, call: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """``train(*args, **kwargs)`` through ``call`` (the Trainer's own ``train``, guarded), planned first.

        Called by the ``train`` entry point of :mod:`hf_memwatch.integration.patches`, before a
        dataloader, optimizer or scheduler exists. Planning leaves no trace: the RNG states are put
        back, so the run draws what it would have drawn.
        """
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        rng = RngStates.capture()
        try:
            try:
                self.before_train(trainer, resume)
            except (PlanError, MemWatchConfigError):
                raise  # the run cannot fit, or was misconfigured: stop before training
            except Exception as exc:  # noqa: BLE001 - not predicted: measured (integration/measured.py)
                self._planning_failed(trainer, exc)
        except PlanError as exc:
            if not self.allow_over_budget:
                raise
            self._train_over_budget(trainer, exc)
        finally:
            rng.restore()
        return self._train_with_safety_net(trainer, call, resume, args, kwargs)

    def _train_with_safety_net(self, trainer: Any, original: Callable[..., Any], resume: Any,
                               args: tuple, kwargs: dict[str, Any]) -> Any:
        """``original(*args, **kwargs)``; an out-of-memory in the first optimizer step (no weight
        updated yet) is recovered: planned again under a lower limit and the step run again from the
        same RNG states — same samples, same order, the effective batch kept — at most
        :data:`MAX_RECOVERIES` times. Later OOMs propagate (the post-mortem has been written)."""
        rng = RngStates.capture()
        while True:
            try:
                return original(*args, **kwargs)
            except Exception as exc:
                if not self._recoverable(trainer, exc, resume):
                    raise
                self._recover(trainer, exc)
                rng.restore()

    def _recoverable(self, trainer: Any, exc: BaseException, resume: Any) -> bool:
        return (is_oom_error(exc) and self.plan is not None and self.plan.get("status") not in ("failed", "over_budget")
                and resume in (None, False) and int(trainer.state.global_step) == 0
                and len(self.recoveries) < MAX_RECOVERIES and not self._custom_optimizer)

    def _recover(self, trainer: Any, exc: BaseException) -> None:
        """Plan again below what failed, undo what the failed attempt built, record it."""
        assert self.plan is not None and self.budget is not None
        failed = dict(self.plan)
        trainer.optimizer, trainer.lr_scheduler = None, None  # built again by train(), with the new plan
        trainer.model.zero_grad(set_to_none=True)
        trainer.accelerator.free_memory()
        gc.collect()
        # Learn from the failure: the limit is below what the failed plan was predicted to need.
        # The margin measured so far (before training, or in the steps before) is kept above it.
        limit = int(RECOVERY_SHRINK * min(self.budget.usable, int(failed.get("predicted_peak") or self.budget.usable)))
        self.budget = self.budget.with_usable(limit, f"{RECOVERY_SHRINK:.0%} of the plan that ran out of memory")
        run = RunConfig.from_trainer(trainer).replace(
            micro_batch_size=int(failed["configured"]["micro_batch_size"]),
            gradient_accumulation_steps=int(failed["configured"]["gradient_accumulation_steps"]))
        apply_plan(trainer, Plan.of(run))  # back to the configuration as given, then plan it again
        record = self._decide_with_peers(trainer, RunConfig.from_trainer(trainer), self.budget)
        apply_plan(trainer, Plan.from_dict(record))
        apply_eval_plan(trainer, record)
        recovered = {
            "event": "oom_recovered", "attempt": len(self.recoveries) + 1, "error": f"{type(exc).__name__}: {str(exc)[:200]}",
            "failed_plan": {k: failed.get(k) for k in ("micro_batch_size", "gradient_accumulation_steps",
                                                      "activation_checkpointing", "optim", "predicted_peak")},
            "budget": limit,
        }
        self.recoveries.append(recovered)
        self.plan = dict(record, recovered_from_oom=len(self.recoveries))
        logger.warning("hf-memwatch: out of memory in the first step (%s); planned again: %s",
                       recovered["error"].splitlines()[0][:120], record["reason"])
        self.record(recovered)
        self.record(self.plan)

    def timeline_records(self) -> list[dict[str, Any]]:
        """What a timeline started at train begin must hold: the recoveries, then the plan in force."""
        return [*self.recoveries, *([self.plan] if self.plan else [])]

    def check_installed(self) -> None:
        """Warn when training starts without a plan: the callback came too late to wrap ``train()``."""
        if not self.installed and self.plan is None:
            logger.warning(
                "hf-memwatch: MemWatch(auto=True) was added after the Trainer was built (add_callback), so it "
                "could not plan before training; pass it as Trainer(callbacks=[MemWatch(auto=True)])."
            )

    def _planning_failed(self, trainer: Any, exc: BaseException) -> None:
        """The estimator could not predict the run: plan it from micro-steps measured live
        (:mod:`hf_memwatch.integration.measured`). Where even that fails, the run is not known to fit:
        :class:`PlanError` (stop before training), or with ``allow_over_budget`` an ERROR line."""
        from .measured import over_budget_error, plan_by_measuring

        if self.budget is None:
            raise over_budget_error(f"hf-memwatch: the auto mode could not plan this run ({type(exc).__name__}: "
                                    f"{exc}) nor resolve its budget; it would train unprotected.", None, None) from exc
        try:
            run = RunConfig.from_trainer(trainer)
            result, predictor, fields = plan_by_measuring(trainer, run, self.budget.usable, exc)
        except PlanError:
            raise
        except Exception as measuring:  # noqa: BLE001 - said, and the run stops unless asked otherwise
            raise over_budget_error(
                f"hf-memwatch: the auto mode could neither predict this run ({type(exc).__name__}: {exc}) nor measure "
                f"its micro-steps ({type(measuring).__name__}: {measuring}); it is not known to fit the budget "
                f"{self.budget.describe()}. Pass MemWatch(auto=True, allow_over_budget=True) to train as configured "
                "anyway.", None, self.budget.usable) from measuring
        record = dict(plan_record(result, run, self.budget, None), **fields)
        record = agree(record, int(result.given.predicted_peak or 0) - self.budget.usable)
        self.predictor = predictor  # answers from its measurements only (frozen)
        self.plan_changed_the_run = result.chosen is not None and result.chosen.key() != result.given.key()
        apply_plan(trainer, Plan.from_dict(record))
        self.plan = record
        logger.warning("hf-memwatch plan: %s", record["reason"])
        self.record(record)
        self._start_measuring(trainer)

    def _train_over_budget(self, trainer: Any, exc: PlanError) -> None:
        """``allow_over_budget``: the run goes on as configured, with an ERROR line that says how far over."""
        need, limit = getattr(exc, "need", None), getattr(exc, "budget", None)
        over = (f"{format_bytes(need - limit)} ({(need - limit) / limit:.1%}) over the budget {format_bytes(limit)}"
                if need is not None and limit else "by an unknown amount over the budget (not predicted, not measured)")
        reason = f"training as configured, {over} (allow_over_budget=True): {exc}"
        logger.error("hf-memwatch: %s", reason)
        run = RunConfig.from_args(trainer.args)
        self.plan = {
            "event": "plan", "status": "over_budget" if need is not None else "failed",
            "micro_batch_size": run.micro_batch_size,
            "gradient_accumulation_steps": run.gradient_accumulation_steps,
            "activation_checkpointing": None, "optim": None, "predicted_peak": None if need is None else int(need),
            "budget": None if self.budget is None else int(self.budget.total), "reason": reason,
            "source": "measured" if "measured live" in str(exc) else "predicted" if need is not None else "none",
        }
        self.record(self.plan)

    # -- before train -------------------------------------------------------------------------
    def before_train(self, trainer: Any, resume_from_checkpoint: Any = None) -> dict[str, Any]:
        """Decide, apply and record the plan. Raises :class:`PlanError` when nothing fits.

        With ``auto_find_batch_size`` set by the user, the Trainer's retry stays the last resort for an
        OOM the plan did not prevent, and each retry keeps the plan's effective batch.
        """
        self._custom_optimizer = RunConfig.from_trainer(trainer).custom_optimizer  # before train() builds one
        record = self._plan_and_apply(trainer, resume_from_checkpoint)
        self._start_measuring(trainer)
        if RunConfig.from_args(trainer.args).auto_find_batch_size:
            keep_effective_batch(trainer, record["micro_batch_size"] * record["gradient_accumulation_steps"])
        return record

    def _plan_and_apply(self, trainer: Any, resume_from_checkpoint: Any) -> dict[str, Any]:
        backend = backend_for(torch.device(trainer.args.device))
        self.budget = resolve_budget(self.budget_spec, backend)
        self.kind = footprint_kind(self.budget, backend)
        try:
            self.budget = margin_before_training(self.budget, backend)
        except Exception as exc:  # noqa: BLE001 - a probe that fails leaves the prior margin, planning goes on
            logger.warning("hf-memwatch: the footprint margin was not measured before training (%s: %s)",
                           type(exc).__name__, exc)
        run = RunConfig.from_trainer(trainer)
        saved = self._saved_plan(trainer, resume_from_checkpoint)
        if saved is not None and all(saved.get("configured", {}).get(name) == getattr(run, name)
                                     for name in CONFIGURED_FIELDS):
            apply_plan(trainer, Plan.from_dict(saved))
            apply_eval_plan(trainer, saved)
            self.plan = saved  # unchanged: trainer_state.json stays that of an uninterrupted run
            logger.warning("hf-memwatch plan (resumed from checkpoint, kept): %s", saved.get("reason", ""))
            self.record(dict(saved, resumed=True))
            return saved
        if saved is not None:
            logger.warning(
                "hf-memwatch: resumed with another configuration (%s) than the checkpoint's plan was made for (%s): "
                "planning anew for the effective batch now asked for.",
                {name: getattr(run, name) for name in CONFIGURED_FIELDS}, saved.get("configured"),
            )
        record = self._decide_with_peers(trainer, run, self.budget)
        apply_plan(trainer, Plan.from_dict(record))
        apply_eval_plan(trainer, record)
        self.plan = record
        logger.warning("hf-memwatch plan: %s", record["reason"])
        log_advice(record, pressed=self.plan_changed_the_run)
        self.record(record)
        return record

    def _start_measuring(self, trainer: Any) -> None:
        """The host footprint as training begins: the first steps' gaps are growths from here."""
        self.measured = []
        if self.kind in ("vms", "rss"):
            weights = sum(weight_storages(trainer.model, torch.device(trainer.args.device)).values())
            self.baseline = host_reading(weights, self.kind)

    def _saved_plan(self, trainer: Any, resume: Any) -> dict[str, Any] | None:
        """The plan recorded in a checkpoint's trainer_state.json (``MemWatch`` attributes)."""
        if resume is None or resume is False:
            return None
        if resume is True:
            from transformers.trainer_utils import get_last_checkpoint

            resume = get_last_checkpoint(trainer.args.output_dir)
            if resume is None:
                return None
        path = os.path.join(str(resume), "trainer_state.json")
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as fh:
            stateful = json.load(fh).get("stateful_callbacks", {})
        data = stateful.get("MemWatch")
        data = data[0] if isinstance(data, list) and data else data
        if not isinstance(data, dict):
            return None
        plan = data.get("attributes", {}).get("auto_plan")
        return plan if isinstance(plan, dict) and plan.get("status") != "failed" else None

    def _decide_with_peers(self, trainer: Any, run: RunConfig, budget: Budget) -> dict[str, Any]:
        """:meth:`_decide`; in a distributed run a rank that fails tells the others, so none waits."""
        from ..measure.distributed import PeerFailure, share_failure

        try:
            return self._decide(trainer, run, budget)
        except PeerFailure as exc:
            if exc.fatal:  # another rank's plan error stops every rank with its message
                raise PlanError(f"hf-memwatch: {exc}") from exc
            raise
        except Exception as exc:
            share_failure(exc, fatal=isinstance(exc, (PlanError, MemWatchConfigError)))
            raise

    def _decide(self, trainer: Any, run: RunConfig, budget: Budget) -> dict[str, Any]:
        started = time.perf_counter()
        weights = sum(weight_storages(trainer.model, torch.device(trainer.args.device)).values())
        if weights >= budget.usable:
            from .measured import over_budget_error

            raise over_budget_error(
                f"hf-memwatch: the budget {budget.describe()} is below what the weights alone need "
                f"({format_bytes(weights)}): {format_bytes(weights - budget.usable)} missing. No remedy here "
                "(accumulation, activation checkpointing, 8-bit AdamW) reduces weight memory; raise the budget, "
                "use a smaller model, lower precision or sharding.", weights, budget.usable)
        worst = worst_batch_of(trainer, run)
        predictor = EstimatorPredictor(trainer, run, sample_index=worst.index if worst is not None else None)
        self.predictor = predictor
        try:
            given_estimate = predictor.estimate(Plan.of(run))
            budget = self.budget = with_predicted_reserve(budget, given_estimate)  # CUDA: the reserve replayed
            run = with_state_share(run.replace(seq_len=int(given_estimate.config.get("seq_len") or 1)),
                                   given_estimate)
            predictor.run = run
            result = plan_run(run, predictor, budget.usable)
        except MemWatchConfigError as exc:  # the model, not the user's configuration: not fatal
            raise EstimatorUnavailable(f"the estimator cannot replay this run: {exc}") from exc
        self.planning_seconds = time.perf_counter() - started
        self.plan_changed_the_run = result.chosen is not None and result.chosen.key() != result.given.key()
        if result.chosen is None:
            from .measured import over_budget_error

            raise over_budget_error(no_fit_message(result, budget.describe()), result.best_effort().predicted_peak,
                                    budget.usable)
        if result.chosen.key() != result.given.key():
            for name, why in result.unavailable.items():
                logger.warning("hf-memwatch: remedy %s unavailable: %s", name, why)
        eval_fields = self._plan_eval(trainer, run, budget, predictor, result.chosen)
        sample = {"index": None if worst is None else worst.index, "seq_len": run.seq_len,
                  "source": None if worst is None else worst.source,
                  "notes": [*(worst.notes if worst is not None else ()), *given_estimate.notes]}
        record = dict(plan_record(result, run, budget, sample), **eval_fields)
        # Savings that change what is trained or computed (DPO's reference model): shown, never applied.
        from ..estimation.estimate import logits_bytes

        found = advice(run, given_estimate.frozen_models, logits_bytes(given_estimate), given_estimate.peak_bytes,
                       classes=given_estimate.classes)
        if found:
            record["advice"] = [item.as_dict() for item in found]
        # The rank that must cut the most from the configured run decides (issue 7): its plan fits
        # every rank with a larger budget. A chosen plan's own peak would pick the laxest rank.
        return agree(record, int(result.given.predicted_peak or 0) - budget.usable)

    def _plan_eval(self, trainer: Any, run: RunConfig, budget: Budget, predictor: EstimatorPredictor,
                   chosen: Plan) -> dict[str, Any]:
        """The evaluation loop planned too (:mod:`hf_memwatch.planning.eval_plan`), when there is an eval
        dataset the loop can be predicted for; the fields the ``plan`` record gains."""
        dataset = getattr(trainer, "eval_dataset", None)
        if dataset is None or isinstance(dataset, dict) or is_one_pass(dataset) or len(dataset) == 0:
            return {}
        from ..estimation.estimate import estimate_eval

        worst = worst_batch(dataset, trainer.data_collator, micro_batch_size=int(run.eval_batch_size or 8),
                            max_length=run.max_length, truncation=run.max_length is not None)
        seq_len = int(worst.length or run.seq_len or 1)
        states = int(predictor.estimate(chosen).classes.get("optimizer_states", 0))
        eval_run = run.replace(seq_len=seq_len)
        # A preprocess_logits_for_metrics is taken to reduce the logits as argmax does (what the Trainer's
        # documentation proposes it for); its own code is not replayed.
        reduces = getattr(trainer, "preprocess_logits_for_metrics", None) is not None

        def predict(batch: int, steps: int | None, argmax: bool = reduces) -> int:
            loop = estimate_eval(
                trainer.model, eval_batch_size=batch, eval_samples=len(dataset), seq_len=seq_len,
                precision=run.precision, device="cuda" if run.device == "cuda" else "cpu",
                eval_accumulation_steps=steps, prediction_loss_only=run.prediction_loss_only,
                optimizer_state_bytes=states, preprocess_argmax=argmax, **generation_kwargs(run),
            )
            return int(math.ceil(loop.peak_bytes * (1.0 + ESTIMATE_MARGIN)))

        try:
            return plan_eval(eval_run, predict, budget.usable).record_fields()
        except PlanError:
            raise  # only a change of the metrics code would fit: stop before training
        except Exception as exc:  # noqa: BLE001 - the training plan stands without an eval plan
            logger.warning("hf-memwatch: the evaluation loop was not planned (%s: %s); eval runs as configured.",
                           type(exc).__name__, exc)
            return {"eval_reason": f"not planned ({type(exc).__name__}: {exc})"}

    # -- between steps ------------------------------------------------------------------------
    def after_step(self, trainer: Any, step_record: dict[str, Any] | None,
                   snapshots: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        """Between two steps: measure the first steps' footprint against the limit, and turn on
        activation checkpointing when the next step would not fit it, or a measured peak approaches
        the budget. ``snapshots``: the step's ``snapshot`` records."""
        if self.plan is None or not step_record or trainer is None or self.plan.get("status") == "failed":
            return None
        if self.budget is None:  # a callback the Trainer rebuilt from checkpoint state
            self.budget = resolve_budget(self.budget_spec, backend_for(torch.device(trainer.args.device)))
        try:
            measured = self._measure_footprint(step_record, snapshots or [])
        except Exception as exc:  # noqa: BLE001 - the plan stands without a measured margin
            logger.warning("hf-memwatch: the footprint of step %s was not measured (%s: %s)",
                           step_record.get("step"), type(exc).__name__, exc)
            measured = None
        peak = step_record.get("peak")
        if peak is None or self.plan.get("activation_checkpointing") or self._checkpointing_refused:
            if measured is not None and not measured["fits"]:
                logger.warning("hf-memwatch: %s; activation checkpointing is %s, nothing else can change between "
                               "steps: lower the micro-batch or raise the limit", self._footprint_text(measured),
                               "on already" if self.plan.get("activation_checkpointing") else "unavailable")
            return None
        if measured is not None and not measured["fits"]:
            why = self._footprint_text(measured)
        elif peak >= CHECKPOINT_TRIGGER * self.budget.usable:
            why = (f"step {step_record.get('step')} peaked at {format_bytes(peak)}, "
                   f"{peak / self.budget.usable:.0%} of the budget {format_bytes(self.budget.usable)}")
        else:
            return None
        refused = RunConfig.from_trainer(trainer).checkpointing_unavailable
        if refused:
            logger.warning("hf-memwatch: %s, but %s", why, refused)
            self._checkpointing_refused = True  # warn once
            return None
        if _distributed():
            # Every rank must run the same plan: the switch waits for the agreement of the first
            # steps (agree_between_steps), which every rank joins, its own check failed or not.
            self._pending_why = why
            return None
        return self._switch_checkpointing(trainer, why)

    def agree_between_steps(self, trainer: Any) -> dict[str, Any] | None:
        """Distributed runs, after each of the first :data:`MEASURED_STEPS` steps: every rank says whether
        its next step would not fit (:meth:`after_step`'s verdict), in one ``all_gather_object``; when
        any rank's would not, every rank turns activation checkpointing on before the next step.

        Called on every rank at every step end, whether this rank's monitoring worked or not (its
        verdict is then None), so no rank waits in the collective alone."""
        if not _distributed() or self.plan is None or self.plan.get("status") == "failed" or trainer is None:
            return None
        if self._agreements >= MEASURED_STEPS:
            return None
        self._agreements += 1
        from ..measure.distributed import gather_objects

        why, self._pending_why = self._pending_why, None
        verdicts = gather_objects(why)
        pressed = [(rank, text) for rank, text in enumerate(verdicts) if text]
        if not pressed or self.plan.get("activation_checkpointing"):
            return None
        rank, text = pressed[0]
        return self._switch_checkpointing(trainer, f"rank {rank}: {text}" + (
            f" (and {len(pressed) - 1} more rank(s))" if len(pressed) > 1 else "") + "; agreed by all ranks")

    def _switch_checkpointing(self, trainer: Any, why: str) -> dict[str, Any]:
        """Activation checkpointing on now, recorded as the plan in force."""
        assert self.plan is not None and self.budget is not None
        enable_checkpointing_now(trainer)
        record = dict(self.plan, activation_checkpointing=True,
                      reason=f"{why}: activation checkpointing turned on between steps",
                      margin=round(self.budget.margin_ratio, 4), margin_source=self.budget.margin_source)
        checkpointed = self._checkpointed_peak()
        if checkpointed is not None:
            record["predicted_peak"] = checkpointed
            fits = checkpointed <= self.budget.usable
            tokens = (self.plan.get("sample") or {}).get("seq_len")
            record["reason"] += (f" (predicted peak {format_bytes(checkpointed)} with it on the planned batch of "
                                 f"{tokens or '?'} tokens per sample"
                                 + ("" if fits else ", still above the budget with the measured margin: lower the "
                                    "micro-batch in a new run") + ")")
        self.plan = record
        logger.warning("hf-memwatch plan: %s", record["reason"])
        log_advice(record, pressed=True)
        self.record(record)
        return record

    def _measure_footprint(self, step_record: dict[str, Any], snapshots: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The ``footprint`` record of one of the first steps (written), its gap made the budget's margin."""
        assert self.budget is not None and self.plan is not None
        if self.kind is None or len(self.measured) >= MEASURED_STEPS:
            return None
        measured = step_footprint(step_record, snapshots, self.kind, self.baseline)
        if measured is None:
            return None
        self.measured.append(measured)
        worst = max(self.measured, key=lambda m: m.gap)
        steps = ", ".join(str(m.step) for m in self.measured)
        if self.kind != "allocated":  # a byte budget on the CPU keeps its zero margin and why
            self.budget = self.budget.with_margin(
                worst.gap, f"measured in step(s) {steps}: {self.kind} {format_bytes(worst.gap)} beyond "
                           f"{format_bytes(worst.allocated_peak)} allocated at the peak (step {worst.step})")
        # The next step needs what this one took plus the states it left, or the planned worst batch
        # (predicted in allocated bytes) with the measured gap, whichever is more.
        planned = int(self.plan.get("predicted_peak") or 0) + worst.gap
        need = max(measured.need, planned)
        advice = None
        if self.kind == "reserved":
            reserved = max((int(s["reserved"]) for s in snapshots if s.get("reserved") is not None), default=None)
            advice = expandable_segments_advice(reserved, measured.allocated_peak,
                                                snapshots[-1].get("num_alloc_retries"), allocator_settings())
        record = {
            "event": "footprint", "step": measured.step, "kind": self.kind,
            "allocated_peak": measured.allocated_peak, "states_growth": measured.states_growth,
            "footprint_gap": measured.gap, "margin": round(self.budget.margin_ratio, 4), "planned_need": planned,
            "next_step_need": need, "budget": int(self.budget.total), "fits": need <= self.budget.total,
            "advice": advice,
        }
        if advice is not None and not self.advised:
            self.advised = True  # said once; the records of later steps repeat it for the summary
            logger.warning("hf-memwatch: %s", advice)
        logger.info("hf-memwatch: %s", self._footprint_text(record))
        self.record(record)
        return record

    @staticmethod
    def _footprint_text(record: dict[str, Any]) -> str:
        fits = "fits" if record["fits"] else "would not fit"
        return (f"step {record['step']} measured {format_bytes(record['allocated_peak'])} allocated at its peak "
                f"+ {format_bytes(record['states_growth'])} optimizer states allocated after it + "
                f"{format_bytes(record['footprint_gap'])} {record['kind']} beyond the allocated bytes (margin "
                f"{record['margin']:.1%}); the next step needs {format_bytes(record['next_step_need'])} as the limit "
                f"counts it (planned worst batch: {format_bytes(record['planned_need'])}), which {fits} the budget "
                f"{format_bytes(record['budget'])}")

    def _checkpointed_peak(self) -> int | None:
        """The plan in force with checkpointing, predicted by the plan's own predictor (None: unknown)."""
        if self.predictor is None or self.plan is None:
            return None
        try:
            plan = dataclasses.replace(Plan.from_dict(self.plan), activation_checkpointing=True)
            return self.predictor.peak(plan)
        except Exception as exc:  # noqa: BLE001 - checkpointing is on either way; only the figure is missing
            logger.warning("hf-memwatch: the checkpointed step was not predicted (%s: %s)", type(exc).__name__, exc)
            return None


def worst_batch_of(trainer: Any, run: RunConfig) -> WorstBatch | None:
    """The longest batch the sampler can form over the whole train dataset (None: no dataset)."""
    dataset = training_dataset(trainer)
    if dataset is None:
        return None
    tokenizer = getattr(trainer, "processing_class", None)
    model_max_length = getattr(tokenizer, "model_max_length", None)
    return worst_batch(
        dataset, trainer.data_collator, micro_batch_size=run.micro_batch_size, max_length=run.max_length,
        truncation=run.max_length is not None, group_by_length=run.group_by_length, padding_free=run.padding_free,
        packing=run.packing,
        model_max_length=model_max_length if isinstance(model_max_length, int) and model_max_length < 10**9 else None,
    )


# -- distributed agreement -----------------------------------------------------------------------
def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(record: dict[str, Any], need_bytes: int) -> dict[str, Any]:
    """The same plan on every rank: the rank that needs the most memory decides for all."""
    if not _distributed():
        return record
    from ..measure.distributed import agree_plan

    return dict(agree_plan(record, need_bytes))
