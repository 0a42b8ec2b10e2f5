"""``core/records.py``: every record a real run writes is read back by the one reader
(:func:`parse_record`) into its dataclass, and written out again unchanged."""

from __future__ import annotations

import json

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


def test_an_older_timeline_is_read_typed_with_absent_fields_and_a_newer_event_is_named(tmp_path) -> None:
    """The one reader (``core.timeline.read_records``) and the picture's loader on a timeline an older
    version wrote (no ``rank``, ``time``, ``host_vms``, ...) with an event this version does not define."""
    from hf_memwatch.core.records import StepRecord
    from hf_memwatch.core.timeline import Unread, read_records
    from hf_memwatch.reporting.report import load_run

    live = {"weights": 60, "gradients": 0, "optimizer_states": 0, "activations": 40, "other": 0}
    lines = [{"event": "snapshot", "step": 1, "micro_step": 0, "phase": "step_begin", "allocated": 100,
              "peak": 120, "live": live, "spike": 20},
             {"event": "step", "step": 1, "peak": 120, "peak_phase": "step_begin"},
             {"event": "from_a_newer_version", "step": 1},
             {"event": "step", "step": 2, "peak": "big"}]
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    unread: list[Unread] = []
    snapshot, step = read_records(path, unread)
    assert isinstance(snapshot, Snapshot) and snapshot.live == live and snapshot.rank is None
    assert snapshot.host_vms is None and snapshot.stage is None and snapshot.frozen_models is None
    assert isinstance(step, StepRecord) and step.live_at_peak == {} and step.peak_micro_step is None
    assert [(u.number, u.event) for u in unread] == [(3, "from_a_newer_version"), (4, None)]
    [run] = load_run(tmp_path)
    assert run.snapshots == [snapshot] and run.steps == [step]
    assert run.unknown == ["timeline.jsonl record 3: unknown event 'from_a_newer_version'"]
    assert len(run.skipped) == 1 and "peak='big'" in run.skipped[0]
