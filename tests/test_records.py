"""``core/records.py``: every record a real run writes is read back by the one reader
(:func:`parse_record`) into its dataclass, and written out again unchanged."""

from __future__ import annotations

import pytest
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import Trainer

from hf_memwatch import MemWatch
from hf_memwatch.core.records import PlannedBatch, PlanRecord, Snapshot, parse_record, validate_record


def test_every_record_of_a_planned_run_round_trips_through_its_dataclass(out_dir) -> None:
    args = training_args(out_dir, max_steps=2, per_device_train_batch_size=4, eval_strategy="steps", eval_steps=2)
    watch = MemWatch(auto=True, budget="2GiB", detail="full", report=False, summary=False)
    trainer = Trainer(model=gpt2_model(n_layer=1, n_embd=32), args=args, train_dataset=token_dataset(16, 16, 1000),
                      eval_dataset=token_dataset(8, 16, 1000, seed=1), callbacks=[watch])
    trainer.train()
    records = read_records(out_dir)
    kinds = {r["event"] for r in records}
    assert {"plan", "meta", "snapshot", "step", "eval", "peak_tensors"} <= kinds
    for record in records:
        typed = parse_record(record)
        assert typed.to_dict() == record, record["event"]
        assert not validate_record(typed.to_dict())
    eval_snapshot = next(parse_record(r) for r in records if r["event"] == "snapshot" and "stage" in r)
    assert isinstance(eval_snapshot, Snapshot) and eval_snapshot.stage == "eval" and eval_snapshot.batch == 0
    [plan] = [parse_record(r) for r in records if r["event"] == "plan"]
    assert isinstance(plan, PlanRecord) and isinstance(plan.sample, PlannedBatch)
    # The batch planned for, typed: the longest sample repeated (a fixed-length dataset: sample 0), its tokens.
    assert plan.sample.indices == [plan.sample.index] * plan.micro_batch_size
    assert plan.sample.tokens == plan.sample.seq_len * plan.micro_batch_size == 16 * plan.micro_batch_size
    # The callback's saved state is the plan record as written, and restores the same PlanRecord.
    saved = watch.state()["attributes"]["auto_plan"]
    assert saved == plan.to_dict()
    rebuilt = MemWatch(**watch.state()["args"])
    rebuilt.auto_plan = saved
    assert rebuilt.auto_plan == saved


def test_unknown_fields_are_kept_and_a_missing_required_field_is_named() -> None:
    plan = PlanRecord.from_dict({"event": "plan", "micro_batch_size": 2, "gradient_accumulation_steps": 1,
                                 "activation_checkpointing": False, "optim": "sgd", "predicted_peak": 1,
                                 "budget": 2, "reason": "fits", "added_later": [1, 2]})
    assert plan.extra == {"added_later": [1, 2]} and plan.to_dict()["added_later"] == [1, 2]
    assert "status" not in plan.to_dict() and plan.in_force  # optional fields are written only when known
    with pytest.raises(ValueError, match="'reason'"):
        PlanRecord.from_dict({"event": "plan", "micro_batch_size": 2, "gradient_accumulation_steps": 1,
                              "activation_checkpointing": False, "optim": "sgd", "predicted_peak": 1, "budget": 2})
    with pytest.raises(ValueError, match="unknown event"):
        parse_record({"event": "nonsense"})
