"""The auto mode between steps: the first steps' footprint measured against the limit, and
activation checkpointing turned on when the next step would not fit it (or a measured peak nears
the budget). The base class of :class:`~hf_memwatch.integration.auto.AutoMode`, which plans before
``train()``. Each piece of state is declared by the class that owns it: the plan in force (a
:class:`~hf_memwatch.core.records.PlanRecord`), the budget and the plan's predictor are the auto mode's
(:meth:`AutoMode.__init__ <hf_memwatch.integration.auto.AutoMode.__init__>`: it plans, recovers and restores
them; between steps they are read and the plan and the budget's margin updated); what the limit counts, the first
steps' footprints and the between-step agreement are this class's (:meth:`BetweenSteps.__init__`, set through
:meth:`BetweenSteps.measure_against` and :meth:`BetweenSteps.start_measuring`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..core.records import FootprintRecord, PlanRecord, Record, Snapshot, StepRecord
from ..core.run_config import RunConfig
from ..core.units import format_bytes
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
from ..planning.budget import Budget, BudgetSpec, resolve_budget
from ..planning.predict import EstimatorPredictor
from .apply import enable_checkpointing_now
from .plan_records import log_advice

logger = logging.getLogger("hf_memwatch")

# Checkpointing is switched on between steps once a measured peak reaches this share of the budget.
CHECKPOINT_TRIGGER = 0.95
# The first steps whose footprint is measured against the limit: the first allocates the optimizer
# states, the second is the first to hold them through a whole step, the third confirms the gap.
MEASURED_STEPS = 3


def _on_cpu(value: Any) -> Any:
    """``value`` (a sample or a collated micro-batch) with every tensor in it moved to the CPU, to cross ranks."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {key: _on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(item) for item in value)
    return value


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class BetweenSteps:
    """After each optimizer step: :meth:`after_step` (every rank), :meth:`agree_between_steps`
    (distributed runs, the first :data:`MEASURED_STEPS` steps)."""

    # The auto mode's (AutoMode.__init__ declares and sets them): read here, the plan and the margin updated.
    budget_spec: BudgetSpec
    record: Callable[[Record], None]  # writes a timeline record (typed) and the callback state
    budget: Budget | None
    plan: PlanRecord | None
    predictor: EstimatorPredictor | Any | None  # the plan's, for a re-plan between steps

    def __init__(self) -> None:
        self.kind: FootprintKind | None = None  # what the limit counts (None: not measured)
        self.baseline: FootprintReading | None = None  # the host footprint when training began
        self.measured: list[StepFootprint] = []  # the first steps' footprints
        self.advised = False  # the expandable-segments advice was logged
        self._checkpointing_refused = False
        self._pending_why: str | None = None  # distributed: this rank's reason to switch, until agreed
        self._agreements = 0  # distributed: between-step agreements joined (the first MEASURED_STEPS steps)
        self.stop_requested = False  # a sample read ahead fits no plan: training stops before its step
        self._stop_before_sample: int | None = None  # that sample's index in the stream
        self._stream_agreement = False  # distributed, the stream read ahead on every rank: agreed every step

    def measure_against(self, kind: FootprintKind | None) -> None:
        """What the limit counts (:func:`~hf_memwatch.planning.budget.footprint_kind`): the first steps'
        footprints are measured in it."""
        self.kind = kind

    def start_measuring(self, trainer: Any) -> None:
        """The host footprint as training begins: the first steps' gaps are growths from here."""
        self.measured = []
        if self.kind in ("vms", "rss"):
            weights = sum(weight_storages(trainer.model, torch.device(trainer.args.device)).values())
            self.baseline = host_reading(weights, self.kind)

    def after_step(self, trainer: Any, step_record: StepRecord | None,
                   snapshots: list[Snapshot] | None = None) -> PlanRecord | None:
        """Between two steps: measure the first steps' footprint against the limit, and turn on
        activation checkpointing when the next step would not fit it, or a measured peak approaches
        the budget. ``snapshots``: the step's ``snapshot`` records. Returns the new plan, if any."""
        if self.plan is None or step_record is None or trainer is None or self.plan.status == "failed":
            return None
        if self.budget is None:  # a callback the Trainer rebuilt from checkpoint state
            self.budget = resolve_budget(self.budget_spec, backend_for(torch.device(trainer.args.device)))
        try:
            measured = self._measure_footprint(step_record, snapshots or [])
        except Exception as exc:  # noqa: BLE001 - the plan stands without a measured margin
            logger.warning("hf-memwatch: the footprint of step %s was not measured (%s: %s)",
                           step_record.step, type(exc).__name__, exc)
            measured = None
        if not distributed():  # several ranks: agreed on every rank (agree_longer_sample)
            replanned = self.longer_sample(trainer)
            self._stop_before_its_step(trainer)
            if replanned is not None or self._stop_before_sample is not None:  # nothing else changes before the stop
                return replanned
        elif self._stop_before_sample is not None:  # the ranks agreed to stop: nothing else changes before it
            return None
        why = self._pressure(step_record, measured)
        if why is None:
            return None
        refused = RunConfig.from_trainer(trainer).checkpointing_unavailable
        if refused:
            logger.warning("hf-memwatch: %s, but %s", why, refused)
            self._checkpointing_refused = True  # warn once
            return None
        if distributed():
            # Every rank must run the same plan: the switch waits for the agreement of the first
            # steps (agree_between_steps), which every rank joins, its own check failed or not.
            self._pending_why = why
            return None
        return self._switch_checkpointing(trainer, why)

    def longer_sample(self, trainer: Any) -> PlanRecord | None:
        """A stream read ahead (:mod:`hf_memwatch.estimation.read_ahead`) brought a sample longer than the
        plan in force was predicted for: the plan is predicted again on it, before the step that trains on
        it. It fits: the plan stays (its figure updated); it fits with activation checkpointing: that is
        turned on; else the run stops before that step with an ERROR line (``allow_over_budget``: it goes on)."""
        from ..estimation.read_ahead import ReadAhead

        ahead = getattr(trainer, "train_dataset", None)
        if not isinstance(ahead, ReadAhead) or ahead.longest <= ahead.planned or not self._replannable():
            return None
        before, first_longer = ahead.planned, ahead.first_longer
        ahead.planned_for(ahead.longest)
        record, over = self._predict_longer(trainer, ahead.longest, before, "read ahead",
                                            "training stops before the step that trains on the first longer sample")
        if over is not None:
            self._stop_before_sample = None if over else first_longer
        return record

    def agree_on_the_stream(self) -> None:
        """Every rank reads its copy of the stream ahead (the auto mode's plan, before training): from now on the
        ranks agree on the longest sample read every few steps (:meth:`agree_longer_sample`)."""
        self._stream_agreement = True

    def agree_longer_sample(self, trainer: Any) -> PlanRecord | None:
        """Distributed runs whose stream is read ahead, after every :meth:`_agreement_period` steps: the ranks
        agree on the longest sample any of them read (one ``all_gather_object``; under accelerate's dispatcher
        only rank 0 reads the stream while training), every rank takes that sample, and the plan in force is predicted again on it on every
        rank, as :meth:`longer_sample` does in one process, with the verdict the ranks' figures agree on: the
        plan stays where it fits every rank, checkpointing is turned on where that fits every rank, else every
        rank stops before the step that trains on the sample.

        Called on every rank at every step end, whatever its own monitoring did, so no rank waits alone (the
        period is the same on every rank); where a rank cannot predict, every rank raises the same error (the
        caller's WARNING: the plan stays)."""
        from ..estimation.read_ahead import ReadAhead

        ahead = getattr(trainer, "train_dataset", None) if trainer is not None else None
        if not self._stream_agreement or self.plan is None or not distributed() or not isinstance(ahead, ReadAhead):
            return None
        if int(trainer.state.global_step) % self._agreement_period(trainer, ahead):
            self._stop_before_its_step(trainer)
            return None
        longer = ahead.longest > ahead.planned
        agreed = self._agreed_longest(ahead.longest, ahead.planned,
                                      (ahead.longest_item, ahead.first_longer) if longer else None)
        replanned = None
        if agreed is not None:
            longest, rank, (item, first_longer) = agreed
            before = ahead.planned
            ahead.adopt(longest, item)
            ahead.planned_for(longest)
            replanned, over = self._predict_longer(
                trainer, longest, before, f"read ahead (rank {rank}; agreed by all ranks)",
                "training stops before the step that trains on the first longer sample")
            if over is not None:
                self._stop_before_sample = None if over else first_longer
        self._stop_before_its_step(trainer)
        return replanned

    def _agreement_period(self, trainer: Any, ahead: Any) -> int:
        """Every how many steps the ranks agree on the stream (:meth:`agree_longer_sample`), the same on every
        rank: the samples read ahead cover ``ahead.ahead // per_step`` optimizer steps beyond the one trained, so a
        sample first read just after an agreement is trained on no sooner than that many steps on; two are kept
        in hand (the buffer's refill lags a sample, the step that reads it may be the next). 8 micro-batches read
        ahead, no accumulation: every 6th step; accumulation 4 or more: every step."""
        return max(1, int(ahead.ahead) // max(1, self._samples_per_step(trainer)) - 2)

    def _samples_per_step(self, trainer: Any) -> int:
        """Samples one optimizer step of the plan in force takes from a rank's copy of the stream: every rank's
        micro-batch x accumulation (:func:`~hf_memwatch.estimation.read_ahead.samples_per_micro_step`)."""
        assert self.plan is not None
        from ..estimation.read_ahead import samples_per_micro_step

        return samples_per_micro_step(trainer, int(self.plan.micro_batch_size)) * int(
            self.plan.gradient_accumulation_steps)

    def longer_fetched(self, trainer: Any, fetched: Any) -> PlanRecord | None:
        """The micro-batches dataloader workers delivered for the next step (``get_batch_samples``), of a stream
        planned on a copy's first samples (:func:`~hf_memwatch.estimation.read_ahead.sample_stream`): one longer
        than the plan in force was predicted for is predicted on before the step trains on it, as in
        :meth:`longer_sample`; where no plan fits, the run stops here with a :class:`PlanError` (the step not
        taken; ``allow_over_budget``: it goes on). On several ranks every rank's fetch joins one
        ``all_gather_object``: the ranks agree on the longest micro-batch any fetched and take the same verdict."""
        from ..core.errors import PlanError
        from ..estimation.read_ahead import stream_sample

        sample = stream_sample(trainer)
        batches = fetched[0] if isinstance(fetched, tuple) and fetched else fetched
        if sample is None or not isinstance(batches, list):
            return None
        longer = sample.fetched(batches)
        how = "fetched by the dataloader workers"
        if distributed():
            agreed = self._agreed_longest(sample.longest, sample.planned, sample.longest_batch if longer else None)
            if agreed is None:
                return None
            longest, rank, batch = agreed
            sample.adopt(longest, batch)
            how = f"fetched by the dataloader workers (rank {rank}; agreed by all ranks)"
        elif not longer or not self._replannable():
            return None
        before = sample.planned
        sample.planned_for(sample.longest)
        record, over = self._predict_longer(trainer, sample.longest, before, how,
                                            "training stops before the step that trains on it")
        if over is False:
            raise PlanError(f"hf-memwatch: {record.reason}")
        return record

    def _agreed_longest(self, longest: int, planned: int, item: Any) -> tuple[int, int, Any] | None:
        """Several ranks: (the longest sample or micro-batch any rank holds, that rank, it) where it is longer than
        every rank's plan was predicted for, else None; one ``all_gather_object`` (tensors cross on the CPU).
        Raised on every rank where a rank has no estimator plan to predict it with."""
        from ..measure.ranks import gather_objects

        seen = gather_objects((longest, planned, _on_cpu(item), self._replannable()))
        most, planned = max(entry[0] for entry in seen), max(entry[1] for entry in seen)
        if most <= planned:
            return None
        rank = min(r for r, entry in enumerate(seen) if entry[0] == most)
        if not all(entry[3] for entry in seen):
            raise RuntimeError(f"a sample of {most} tokens (rank {rank}) was not predicted on: a rank has no "
                               "estimator plan to predict it with")
        return most, rank, seen[rank][2]

    def _replannable(self) -> bool:
        return self.plan is not None and self.budget is not None and isinstance(self.predictor, EstimatorPredictor)

    def _predict_longer(self, trainer: Any, longest: int, before: int, how: str,
                        stop: str) -> tuple[PlanRecord, bool | None]:
        """The plan in force predicted again on the longest batch now known: (the record, None where a plan fits,
        else whether training goes on over the budget: ``allow_over_budget``)."""
        assert self.plan is not None and self.budget is not None and isinstance(self.predictor, EstimatorPredictor)
        self.predictor.estimates.clear()  # the worst batch is the longest one known now
        self.predictor.floors.clear()
        if self.plan.sample is not None:
            self.plan = self.plan.replace(sample=self.plan.sample.replace(seq_len=longest))
        peak, fits = self._agreed_fit(lambda: self.predictor.peak(self.plan.plan))
        why = (f"a sample of {longest} tokens {how} (the plan was predicted for {before}): the plan in "
               f"force predicted at {format_bytes(peak)}")
        if fits:
            return self._replanned(self.plan.replace(predicted_peak=peak, reason=f"{why}, which fits the budget "
                                                     f"{format_bytes(self.budget.usable)}: the plan stays")), None
        if not self.plan.activation_checkpointing and not RunConfig.from_trainer(trainer).checkpointing_unavailable:
            checkpointed, fits = self._agreed_fit(
                lambda: self.predictor.peak(self.plan.plan.replace(activation_checkpointing=True)))
            if fits:
                return self._switch_checkpointing(trainer, f"{why}, over the budget "
                                                           f"{format_bytes(self.budget.usable)}"), None
            peak = checkpointed
        over = bool(getattr(self, "allow_over_budget", False))
        record = self.plan.replace(predicted_peak=peak, status="over_budget", reason=(
            f"{why}, {format_bytes(peak - self.budget.usable)} over the budget {format_bytes(self.budget.usable)} "
            "with every remedy that can change between steps: " + ("training goes on (allow_over_budget=True)" if over
                                                                   else f"{stop}; lower the micro-batch or "
                                                                   "max_length")))
        logger.error("hf-memwatch: %s", record.reason)
        self.plan = record
        self.record(record)
        return record, over

    def _agreed_fit(self, predict: Callable[[], int]) -> tuple[int, bool]:
        """(this rank's predicted peak, whether it fits the budget); on several ranks, whether every rank's
        fits its own (one ``all_gather_object``: every rank decides alike), and a rank's failure to predict
        raised on every rank."""
        assert self.budget is not None
        if not distributed():
            peak = int(predict())
            return peak, peak <= self.budget.usable
        from ..measure.ranks import gather_objects

        try:
            peak, error = int(predict()), None
        except Exception as exc:  # noqa: BLE001 - told to every rank, raised on every rank below
            peak, error = 0, f"{type(exc).__name__}: {exc}"
        seen = gather_objects((error is None and peak <= self.budget.usable, error))
        failed = [(rank, text) for rank, (_, text) in enumerate(seen) if text]
        if failed:
            raise RuntimeError(f"rank {failed[0][0]} could not predict the plan on the longer sample ({failed[0][1]})")
        return peak, all(fits for fits, _ in seen)

    def _stop_before_its_step(self, trainer: Any) -> None:
        """Training stops now when the next step trains on the sample no plan fits (its index in the stream
        below the samples trained through the next step: optimizer steps x every rank's micro-batch x
        accumulation)."""
        if self._stop_before_sample is None or self.plan is None:
            return
        if self._stop_before_sample < (int(trainer.state.global_step) + 1) * self._samples_per_step(trainer):
            self.stop_requested = True
            trainer.control.should_training_stop = True  # the Trainer's own control: checked after on_step_end
            logger.error("hf-memwatch: training stops after step %s: the next step trains on sample %s of the stream, "
                         "which no plan fits (the plan record says by how much)", trainer.state.global_step,
                         self._stop_before_sample)

    def _replanned(self, record: PlanRecord) -> PlanRecord:
        self.plan = record
        logger.warning("hf-memwatch plan: %s", record.reason)
        self.record(record)
        return record

    def _pressure(self, step_record: StepRecord, measured: FootprintRecord | None) -> str | None:
        """Why checkpointing should be turned on now (None: no reason, or nothing left to turn on)."""
        assert self.plan is not None and self.budget is not None
        peak = step_record.peak
        if peak is None or self.plan.activation_checkpointing or self._checkpointing_refused:
            if measured is not None and not measured.fits:
                logger.warning("hf-memwatch: %s; activation checkpointing is %s, nothing else can change between "
                               "steps: lower the micro-batch or raise the limit", footprint_text(measured),
                               "on already" if self.plan.activation_checkpointing else "unavailable")
            return None
        if measured is not None and not measured.fits:
            return footprint_text(measured)
        if peak >= CHECKPOINT_TRIGGER * self.budget.usable:
            return (f"step {step_record.step} peaked at {format_bytes(peak)}, "
                    f"{peak / self.budget.usable:.0%} of the budget {format_bytes(self.budget.usable)}")
        return None

    def agree_between_steps(self, trainer: Any) -> PlanRecord | None:
        """Distributed runs, after each of the first :data:`MEASURED_STEPS` steps: every rank says whether
        its next step would not fit (:meth:`after_step`'s verdict), in one ``all_gather_object``; when
        any rank's would not, every rank turns activation checkpointing on before the next step.

        Called on every rank at every step end, whether this rank's monitoring worked or not (its
        verdict is then None), so no rank waits in the collective alone."""
        if not distributed() or self.plan is None or self.plan.status == "failed" or trainer is None:
            return None
        if self._agreements >= MEASURED_STEPS:
            return None
        self._agreements += 1
        from ..measure.ranks import gather_objects

        why, self._pending_why = self._pending_why, None
        verdicts = gather_objects(why)
        pressed = [(rank, text) for rank, text in enumerate(verdicts) if text]
        if not pressed or self.plan.activation_checkpointing:
            return None
        rank, text = pressed[0]
        return self._switch_checkpointing(trainer, f"rank {rank}: {text}" + (
            f" (and {len(pressed) - 1} more rank(s))" if len(pressed) > 1 else "") + "; agreed by all ranks")

    def _switch_checkpointing(self, trainer: Any, why: str) -> PlanRecord:
        """Activation checkpointing on now, recorded as the plan in force."""
        assert self.plan is not None and self.budget is not None
        enable_checkpointing_now(trainer)
        record = self.plan.replace(activation_checkpointing=True,
                                   reason=f"{why}: activation checkpointing turned on between steps",
                                   margin=round(self.budget.margin_ratio, 4), margin_source=self.budget.margin_source)
        checkpointed = self._checkpointed_peak()
        if checkpointed is not None:
            fits = checkpointed <= self.budget.usable
            tokens = None if self.plan.sample is None else self.plan.sample.seq_len
            record = record.replace(predicted_peak=checkpointed, reason=record.reason + (
                f" (predicted peak {format_bytes(checkpointed)} with it on the planned batch of "
                f"{tokens or '?'} tokens per sample"
                + ("" if fits else ", still above the budget with the measured margin: lower the "
                   "micro-batch in a new run") + ")"))
        self.plan = record
        logger.warning("hf-memwatch plan: %s", record.reason)
        log_advice(record, pressed=True)
        self.record(record)
        return record

    def _measure_footprint(self, step_record: StepRecord, snapshots: list[Snapshot]) -> FootprintRecord | None:
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
        planned = int(self.plan.predicted_peak or 0) + worst.gap
        need = max(measured.need, planned)
        advice = None
        if self.kind == "reserved":
            reserved = max((int(s.reserved) for s in snapshots if s.reserved is not None), default=None)
            advice = expandable_segments_advice(reserved, measured.allocated_peak,
                                                snapshots[-1].num_alloc_retries, allocator_settings())
        record = FootprintRecord(
            step=measured.step, kind=self.kind, allocated_peak=measured.allocated_peak,
            states_growth=measured.states_growth, footprint_gap=measured.gap,
            margin=round(self.budget.margin_ratio, 4), planned_need=planned, next_step_need=need,
            budget=int(self.budget.total), fits=need <= self.budget.total, advice=advice,
        )
        if advice is not None and not self.advised:
            self.advised = True  # said once; the records of later steps repeat it for the summary
            logger.warning("hf-memwatch: %s", advice)
        logger.info("hf-memwatch: %s", footprint_text(record))
        self.record(record)
        return record

    def _checkpointed_peak(self) -> int | None:
        """The plan in force with checkpointing, predicted by the plan's own predictor (None: unknown)."""
        if self.predictor is None or self.plan is None:
            return None
        try:
            return self.predictor.peak(self.plan.plan.replace(activation_checkpointing=True))
        except Exception as exc:  # noqa: BLE001 - checkpointing is on either way; only the figure is missing
            logger.warning("hf-memwatch: the checkpointed step was not predicted (%s: %s)", type(exc).__name__, exc)
            return None


def footprint_text(record: FootprintRecord) -> str:
    """One log line for a ``footprint`` record."""
    fits = "fits" if record.fits else "would not fit"
    return (f"step {record.step} measured {format_bytes(record.allocated_peak)} allocated at its peak "
            f"+ {format_bytes(record.states_growth)} optimizer states allocated after it + "
            f"{format_bytes(record.footprint_gap)} {record.kind} beyond the allocated bytes (margin "
            f"{record.margin:.1%}); the next step needs {format_bytes(record.next_step_need)} as the limit "
            f"counts it (planned worst batch: {format_bytes(record.planned_need)}), which {fits} the budget "
            f"{format_bytes(record.budget)}")
