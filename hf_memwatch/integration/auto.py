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

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..core.errors import MemWatchConfigError, PlanError, is_oom_error
from ..core.records import OomRecoveredRecord, PlanRecord, Record
from ..core.run_config import RunConfig
from ..core.units import format_bytes
from ..estimation.read_ahead import sample_stream, start_read_ahead
from ..estimation.trainer_replay import RngStates, is_one_pass
from ..measure.attribution import weight_storages
from ..measure.backends import backend_for
from ..planning.budget import (
    Budget,
    BudgetSpec,
    footprint_kind,
    margin_before_training,
    resolve_budget,
    with_predicted_reserve,
)
from ..planning.catalogue import advice, with_state_share
from ..planning.chooser import no_fit_message, plan_run
from ..planning.eval_plan import eval_request, plan_eval
from ..planning.lengths import worst_batch
from ..planning.plan import EvalSetting, Plan
from ..planning.predict import EstimatorPredictor, with_margin
from .apply import apply_eval_plan, apply_plan
from .between_steps import CHECKPOINT_TRIGGER, MEASURED_STEPS, BetweenSteps, distributed
from .measured import over_budget_error, plan_by_measuring
from .patches import keep_effective_batch
from .plan_records import (
    CONFIGURED_FIELDS,
    configured_of,
    eval_fields,
    log_advice,
    made_for,
    over_budget_record,
    plan_record,
    planned_batch,
    saved_plan,
    worst_batch_of,
)

logger = logging.getLogger("hf_memwatch")

# The safety net: out-of-memory errors in the first step recovered at most this many times, each
# planning against this share of the last failed plan's predicted peak.
MAX_RECOVERIES = 3
RECOVERY_SHRINK = 0.7

__all__ = ["AutoMode", "CHECKPOINT_TRIGGER", "CONFIGURED_FIELDS", "EstimatorUnavailable", "MAX_RECOVERIES",
           "MEASURED_STEPS", "RECOVERY_SHRINK", "agree", "log_advice", "plan_record", "worst_batch_of"]


class EstimatorUnavailable(RuntimeError):
    """The estimator cannot replay this Trainer's step: the run trains as configured, with a warning."""


class AutoMode(BetweenSteps):
    """Plans before ``train()`` and keeps the run under budget between steps (:class:`BetweenSteps`).

    ``plan`` (a :class:`~hf_memwatch.core.records.PlanRecord`) survives in the callback's saved state;
    ``record`` receives each record to write (typed: the timeline writer serialises it).
    """

    def __init__(self, budget: BudgetSpec, record: Callable[[Record], None], *,
                 allow_over_budget: bool = False) -> None:
        self.budget_spec = budget
        self.record = record  # writes a timeline record (typed) and the callback state
        self.budget: Budget | None = None  # resolved before planning; its margin measured (between steps)
        self.plan: PlanRecord | None = None  # in force: planned, recovered, restored from a checkpoint
        self.predictor: EstimatorPredictor | Any | None = None  # the plan's, for a re-plan between steps
        super().__init__()  # what the limit counts and the first steps' footprints (BetweenSteps)
        self.allow_over_budget = allow_over_budget  # nothing fits: train as configured with an ERROR line
        self.planning_seconds: float | None = None
        self.recoveries: list[OomRecoveredRecord] = []  # written again at train begin
        self._custom_optimizer = False
        self.installed = False  # train() wrapped: planning happens before the loop is built
        self.plan_changed_the_run = False  # the last plan differs from the run as configured

    def _put_in_force(self, trainer: Any, record: PlanRecord, *, log: str = "hf-memwatch plan: %s",
                      timed: bool = False) -> None:
        """Write ``record`` into the Trainer, make it the plan in force, say it once (``timed``: with how
        long planning took), record it."""
        apply_plan(trainer, record.plan)  # the chooser's Plan, as the record nests it
        apply_eval_plan(trainer, record)
        self.plan = record
        took = f"; planned in {record.planning_seconds:.1f} s" if timed and record.planning_seconds is not None else ""
        logger.warning(log, record.reason + took)

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
        return (is_oom_error(exc) and self.plan is not None and self.plan.in_force
                and resume in (None, False) and int(trainer.state.global_step) == 0
                and len(self.recoveries) < MAX_RECOVERIES and not self._custom_optimizer)

    def _recover(self, trainer: Any, exc: BaseException) -> None:
        """Plan again below what failed, undo what the failed attempt built, record it."""
        assert self.plan is not None and self.budget is not None
        failed = self.plan
        trainer.optimizer, trainer.lr_scheduler = None, None  # built again by train(), with the new plan
        trainer.model.zero_grad(set_to_none=True)
        trainer.accelerator.free_memory()
        gc.collect()
        # Learn from the failure: the limit is below what the failed plan was predicted to need.
        # The margin measured so far (before training, or in the steps before) is kept above it.
        limit = int(RECOVERY_SHRINK * min(self.budget.usable, int(failed.predicted_peak or self.budget.usable)))
        self.budget = self.budget.with_usable(limit, f"{RECOVERY_SHRINK:.0%} of the plan that ran out of memory")
        configured = failed.configured or {}
        run = RunConfig.from_trainer(trainer).replace(
            micro_batch_size=int(configured["micro_batch_size"]),
            gradient_accumulation_steps=int(configured["gradient_accumulation_steps"]))
        apply_plan(trainer, Plan.of(run))  # back to the configuration as given, then plan it again
        record = self._decide_with_peers(trainer, RunConfig.from_trainer(trainer), self.budget)
        recovered = OomRecoveredRecord(
            attempt=len(self.recoveries) + 1, error=f"{type(exc).__name__}: {str(exc)[:200]}",
            failed_plan={"micro_batch_size": failed.micro_batch_size,
                         "gradient_accumulation_steps": failed.gradient_accumulation_steps,
                         "activation_checkpointing": failed.activation_checkpointing, "optim": failed.optim,
                         "predicted_peak": failed.predicted_peak},
            budget=limit,
        )
        self.recoveries.append(recovered)
        apply_plan(trainer, record.plan)
        apply_eval_plan(trainer, record)
        self.plan = record.replace(recovered_from_oom=len(self.recoveries))
        logger.warning("hf-memwatch: out of memory in the first step (%s); planned again: %s",
                       recovered.error.splitlines()[0][:120], record.reason)
        self.record(recovered)
        self.record(self.plan)

    def timeline_records(self) -> list[Record]:
        """What a timeline started at train begin must hold: the recoveries, then the plan in force."""
        return [*self.recoveries, *([self.plan] if self.plan else [])]

    def check_planned(self) -> None:
        """Training began without a plan: the callback was added (``add_callback``) after ``train()`` was
        entered, its batch already built, so nothing can be planned for this run. Never silent: a
        :class:`MemWatchConfigError` before the first step, or with ``allow_over_budget`` an ERROR line."""
        if self.plan is not None:
            return
        message = ("hf-memwatch: MemWatch(auto=True) was added after the Trainer was built (add_callback), so "
                   "train() began before it could plan the run; pass it as Trainer(callbacks=[MemWatch(auto=True)])")
        if not self.allow_over_budget:
            raise MemWatchConfigError(message + ".")
        logger.error("%s. Training as configured, unplanned (allow_over_budget=True).", message)

    def _planning_failed(self, trainer: Any, exc: BaseException) -> None:
        """The estimator could not predict the run: plan it from micro-steps measured live
        (:mod:`hf_memwatch.integration.measured`). Where even that fails, the run is not known to fit:
        :class:`PlanError` (stop before training), or with ``allow_over_budget`` an ERROR line."""
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
        record = plan_record(result, run, self.budget, None).replace(**fields)
        record = agree(record, int(result.given.predicted_peak or 0) - self.budget.usable)
        self.predictor = predictor  # answers from its measurements only (frozen)
        self.plan_changed_the_run = result.chosen is not None and result.chosen.key() != result.given.key()
        apply_plan(trainer, record.plan)
        self.plan = record
        logger.warning("hf-memwatch plan: %s", record.reason)
        self.record(record)
        self.start_measuring(trainer)

    def _train_over_budget(self, trainer: Any, exc: PlanError) -> None:
        """``allow_over_budget``: the run goes on as configured, with an ERROR line that says how far over."""
        need, limit = getattr(exc, "need", None), getattr(exc, "budget", None)
        over = (f"{format_bytes(need - limit)} ({(need - limit) / limit:.1%}) over the budget {format_bytes(limit)}"
                if need is not None and limit else "by an unknown amount over the budget (not predicted, not measured)")
        reason = f"training as configured, {over} (allow_over_budget=True): {exc}"
        logger.error("hf-memwatch: %s", reason)
        self.plan = over_budget_record(RunConfig.from_args(trainer.args), self.budget, need, reason,
                                       measured="measured live" in str(exc))
        self.record(self.plan)

    # -- before train -------------------------------------------------------------------------
    def before_train(self, trainer: Any, resume_from_checkpoint: Any = None) -> PlanRecord:
        """Decide, apply and record the plan. Raises :class:`PlanError` when nothing fits.

        With ``auto_find_batch_size`` set by the user, the Trainer's retry stays the last resort for an
        OOM the plan did not prevent, and each retry keeps the plan's effective batch.
        """
        self._custom_optimizer = RunConfig.from_trainer(trainer).custom_optimizer  # before train() builds one
        record = self._plan_and_apply(trainer, resume_from_checkpoint)
        self.start_measuring(trainer)
        if RunConfig.from_args(trainer.args).auto_find_batch_size:
            keep_effective_batch(trainer, record.micro_batch_size * record.gradient_accumulation_steps)
        return record

    def _plan_and_apply(self, trainer: Any, resume_from_checkpoint: Any) -> PlanRecord:
        backend = backend_for(torch.device(trainer.args.device))
        self.budget = resolve_budget(self.budget_spec, backend)
        self.measure_against(footprint_kind(self.budget, backend))
        try:
            self.budget = margin_before_training(self.budget, backend)
        except Exception as exc:  # noqa: BLE001 - a probe that fails leaves the prior margin, planning goes on
            logger.warning("hf-memwatch: the footprint margin was not measured before training (%s: %s)",
                           type(exc).__name__, exc)
        run = RunConfig.from_trainer(trainer)
        saved = saved_plan(trainer, resume_from_checkpoint)
        if saved is not None and made_for(saved, run):
            # unchanged: trainer_state.json stays that of an uninterrupted run
            self._put_in_force(trainer, saved, log="hf-memwatch plan (resumed from checkpoint, kept): %s")
            self.record(saved.replace(resumed=True))
            return saved
        if saved is not None:
            logger.warning(
                "hf-memwatch: resumed with another configuration (%s) than the checkpoint's plan was made for (%s): "
                "planning anew for the effective batch now asked for.", configured_of(run), saved.configured,
            )
        record = self._decide_streaming(trainer, run)
        self._put_in_force(trainer, record, timed=True)
        log_advice(record, pressed=self.plan_changed_the_run)
        self.record(record)
        return record

    def _decide_streaming(self, trainer: Any, run: RunConfig) -> PlanRecord:
        """:meth:`_decide_with_peers`; a stream with no length bound, or whose bound does not fit (a
        :class:`PlanError`), is planned again on its first micro-batches read ahead
        (:mod:`hf_memwatch.estimation.read_ahead`), which the Trainer then trains on in the same order."""
        assert self.budget is not None
        try:
            return self._decide_with_peers(trainer, run, self.budget)
        except (PlanError, EstimatorUnavailable) as exc:
            ahead = start_read_ahead(trainer, run.micro_batch_size, run.gradient_accumulation_steps)
            sampled = None if ahead is not None else sample_stream(trainer, run.micro_batch_size,
                                                                   run.gradient_accumulation_steps)
            if distributed():  # every rank reads its copy the same way, or none plans on it; then agreed as it trains
                from ..measure.ranks import gather_objects

                paths = gather_objects((ahead is not None, sampled is not None))
                if len(set(paths)) != 1:
                    raise
                if ahead is not None:
                    self.agree_on_the_stream()
            if ahead is None and sampled is None:
                raise
            how = ("read ahead" if ahead is not None else
                   "read from a copy of the stream (dataloader workers read the run's: their batches are measured "
                   "as they arrive)")
            read = ahead if ahead is not None else sampled
            logger.warning("hf-memwatch: the stream was not planned on its bound (%s); planning on its first %d "
                           "samples, %s (longest %d tokens)", str(exc).splitlines()[0][:160],
                           read.items_read, how, read.longest)
        return self._decide_with_peers(trainer, run, self.budget)

    def _decide_with_peers(self, trainer: Any, run: RunConfig, budget: Budget) -> PlanRecord:
        """:meth:`_decide`; in a distributed run a rank that fails tells the others, so none waits."""
        from ..measure.ranks import PeerFailure, share_failure

        try:
            return self._decide(trainer, run, budget)
        except PeerFailure as exc:
            if exc.fatal:  # another rank's plan error stops every rank with its message
                raise PlanError(f"hf-memwatch: {exc}") from exc
            raise
        except Exception as exc:
            share_failure(exc, fatal=isinstance(exc, (PlanError, MemWatchConfigError)))
            raise

    def _decide(self, trainer: Any, run: RunConfig, budget: Budget) -> PlanRecord:
        started = time.perf_counter()
        weights = sum(weight_storages(trainer.model, torch.device(trainer.args.device)).values())
        if weights >= budget.usable:
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
        if result.chosen is None:  # what was unavailable and why, and the advice with re-estimated figures
            from ..planning.no_fit import no_fit_report

            try:
                message, need = no_fit_report(result, predictor, budget.usable, budget.describe())
            except Exception:  # noqa: BLE001 - the message goes out without the advice
                message, need = no_fit_message(result, budget.describe()), result.best_effort().predicted_peak
            raise over_budget_error(message, need, budget.usable)
        # the remedies unavailable are named once, in the plan line (chooser.explain)
        sample = planned_batch(trainer, result.chosen.micro_batch_size, worst, run.seq_len, list(given_estimate.notes))
        record = plan_record(result, run, budget, sample).replace(
            **self._plan_eval(trainer, run, budget, predictor, result.chosen))
        # Savings that change what is trained or computed (DPO's reference model): shown, never applied.
        from ..estimation.estimate import logits_bytes

        found = advice(run, given_estimate.frozen_models, logits_bytes(given_estimate), given_estimate.peak_bytes,
                       classes=given_estimate.classes, peak_phase=given_estimate.peak_phase)
        if found:
            record = record.replace(advice=[item.as_dict() for item in found])
        # The rank that must cut the most from the configured run decides (issue 7): its plan fits
        # every rank with a larger budget. A chosen plan's own peak would pick the laxest rank.
        record = agree(record, int(result.given.predicted_peak or 0) - budget.usable)
        return record.replace(planning_seconds=round(time.perf_counter() - started, 3))  # this rank's

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

        def predict(setting: EvalSetting) -> int:
            request = eval_request(eval_run, setting, eval_samples=len(dataset), optimizer_state_bytes=states)
            return with_margin(estimate_eval(trainer.model, request).peak_bytes)

        try:
            given = EvalSetting.of(eval_run, preprocess_argmax=reduces)
            return eval_fields(plan_eval(eval_run, predict, budget.usable, given).record_fields())
        except PlanError:
            raise  # only a change of the metrics code would fit: stop before training
        except Exception as exc:  # noqa: BLE001 - the training plan stands without an eval plan
            logger.warning("hf-memwatch: the evaluation loop was not planned (%s: %s); eval runs as configured.",
                           type(exc).__name__, exc)
            return {"eval_reason": f"not planned ({type(exc).__name__}: {exc})"}


# -- distributed agreement -----------------------------------------------------------------------
def agree(record: PlanRecord, need_bytes: int) -> PlanRecord:
    """The same plan on every rank: the rank that needs the most memory decides for all."""
    if not distributed():
        return record
    from ..measure.ranks import agree_plan

    return agree_plan(record, need_bytes)  # the record itself crosses the ranks (pickled), no dict form
