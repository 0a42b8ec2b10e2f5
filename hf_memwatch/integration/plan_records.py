"""The auto mode's ``plan`` records (:class:`~hf_memwatch.core.records.PlanRecord`): built here, from
the planning core's answer, the budget and the batch planned for; read back from a checkpoint. A
record nests the chooser's :class:`~hf_memwatch.planning.plan.Plan` itself (``record.plan``): the one
form the plan keeps from the chooser to :func:`~hf_memwatch.integration.apply.apply_plan`.

Example:
    >>> from hf_memwatch.core.records import PlanRecord
    >>> record = PlanRecord(plan=Plan(2, 4, True, "adamw_torch", predicted_peak=100, reason="fits"), budget=200)
    >>> plan_of(record).key(), record.to_dict()["micro_batch_size"]
    ((2, 4, True, 'adamw_torch'), 2)
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ..core.records import PlannedBatch, PlanRecord
from ..core.run_config import RunConfig
from ..core.sequence_length import sequence_length
from ..core.units import format_bytes
from ..estimation.read_ahead import ReadAhead
from ..estimation.trainer_replay import (
    distinct_batch_reason,
    is_one_pass,
    longest_indices,
    training_dataset,
)
from ..planning.budget import Budget
from ..planning.chooser import PlanResult
from ..planning.lengths import WorstBatch, worst_batch
from ..planning.plan import Plan

logger = logging.getLogger("hf_memwatch")

# The configuration a plan was made for: a resumed run keeps the plan only when these are unchanged.
CONFIGURED_FIELDS = ("micro_batch_size", "gradient_accumulation_steps", "world_size")


def plan_record(result: PlanResult, run: RunConfig, budget: Budget, sample: PlannedBatch | None) -> PlanRecord:
    """The ``plan`` record of a chosen plan."""
    chosen = result.chosen
    assert chosen is not None
    return PlanRecord(
        plan=chosen.replace(predicted_peak=int(chosen.predicted_peak or 0)),  # the chooser's plan itself
        budget=int(budget.total),
        budget_source=budget.source,
        budget_bound_by=budget.bound_by,
        margin=round(budget.margin_ratio, 4),
        margin_source=budget.margin_source,
        configured=configured_of(run),
        sample=sample,
        source="predicted",
    )


def over_budget_record(run: RunConfig, budget: Budget | None, need: int | None, reason: str, *,
                       measured: bool) -> PlanRecord:
    """The record of a run let go on as configured (``allow_over_budget``): ``over_budget`` when its
    need is known (predicted or measured), ``failed`` when it is not."""
    return PlanRecord(
        status="over_budget" if need is not None else "failed",
        plan=Plan(run.micro_batch_size, run.gradient_accumulation_steps, None, None,  # type: ignore[arg-type]
                  predicted_peak=None if need is None else int(need), reason=reason),
        budget=None if budget is None else int(budget.total),
        source="measured" if measured else "predicted" if need is not None else "none",
    )


def configured_of(run: RunConfig) -> dict[str, int]:
    """The configuration a plan is made for (:data:`CONFIGURED_FIELDS`)."""
    return {name: getattr(run, name) for name in CONFIGURED_FIELDS}


def made_for(record: PlanRecord, run: RunConfig) -> bool:
    """Whether ``record`` was made for the configuration ``run`` asks for."""
    return all((record.configured or {}).get(name) == getattr(run, name) for name in CONFIGURED_FIELDS)


def plan_of(record: PlanRecord) -> Plan:
    """The configuration a plan record carries: its nested :class:`Plan` (no copy, no conversion)."""
    return record.plan


def log_advice(record: PlanRecord, *, pressed: bool) -> None:
    """The plan record's advice in the log: a warning when memory pressed the plan (it changed the
    run), otherwise at INFO (a run that fits as given stays quiet: one plan line)."""
    for item in record.advice or ():
        logger.log(logging.WARNING if pressed else logging.INFO, "hf-memwatch advice (not applied): %s would save %s: %s",
                   item["name"], format_bytes(item["saving"]), item["how"])


def worst_batch_of(trainer: Any, run: RunConfig) -> WorstBatch | None:
    """The longest batch the sampler can form over the whole train dataset (None: no dataset)."""
    dataset = training_dataset(trainer)
    if dataset is None or isinstance(dataset, ReadAhead):  # a stream read ahead: the estimate's note says so
        return None
    tokenizer = getattr(trainer, "processing_class", None)
    model_max_length = getattr(tokenizer, "model_max_length", None)
    return worst_batch(
        dataset, trainer.data_collator, micro_batch_size=run.micro_batch_size, max_length=run.max_length,
        truncation=run.max_length is not None, group_by_length=run.group_by_length, padding_free=run.padding_free,
        packing=run.packing,
        model_max_length=model_max_length if isinstance(model_max_length, int) and model_max_length < 10**9 else None,
    )


def planned_batch(trainer: Any, micro_batch_size: int, worst: WorstBatch | None, seq_len: int | None,
                  notes: list[str]) -> PlannedBatch:
    """The batch a plan of ``micro_batch_size`` is predicted on, as the estimator replays it: the
    ``micro_batch_size`` longest distinct samples where the sampler or collator forms such batches
    (:func:`~hf_memwatch.estimation.trainer_replay.distinct_batch_reason`), else the longest sample
    repeated; ``indices``/``tokens`` stay None where the dataset is not read (one-pass, none)."""
    batch = PlannedBatch(index=None if worst is None else worst.index, seq_len=seq_len,
                         source=None if worst is None else worst.source,
                         notes=[*(worst.notes if worst is not None else ()), *notes])
    dataset = training_dataset(trainer)
    if dataset is None or is_one_pass(dataset) or len(dataset) == 0:
        return batch
    try:
        if micro_batch_size > 1 and distinct_batch_reason(trainer) is not None:
            indices = longest_indices(dataset, micro_batch_size)
        elif batch.index is not None:
            indices = [int(batch.index)] * micro_batch_size
        else:
            return batch
        tokens = sum(sequence_length(dataset[index]) or 0 for index in indices)
    except Exception as exc:  # noqa: BLE001 - the plan stands; only the list of its samples is missing
        logger.info("hf-memwatch: the planned batch's samples were not listed (%s: %s)", type(exc).__name__, exc)
        return batch
    return batch.replace(indices=[int(i) for i in indices], tokens=int(tokens))


def saved_plan(trainer: Any, resume: Any) -> PlanRecord | None:
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
    if not isinstance(plan, dict) or plan.get("status") == "failed":
        return None
    return PlanRecord.from_dict(plan)


def eval_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """:meth:`~hf_memwatch.planning.eval_plan.EvalPlan.record_fields` as :class:`PlanRecord` fields."""
    allowed = {"eval_batch_size", "eval_accumulation_steps", "eval_predicted_peak", "eval_reason"}
    unknown = set(fields) - allowed
    if unknown:
        raise ValueError(f"not plan record fields: {sorted(unknown)}")
    return fields
