"""The run session and the auto mode's records, tested directly (issue #34: a test file names every module):
``integration/session``, ``integration/plan_records``, ``integration/between_steps``, ``reporting/context``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import RECORD_PROBLEMS

from hf_memwatch.core.plan import Plan
from hf_memwatch.core.records import FootprintRecord, MetaRecord, PlanRecord
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.integration.between_steps import distributed, footprint_text
from hf_memwatch.integration.plan_records import configured_of, made_for, over_budget_record, plan_of
from hf_memwatch.integration.session import RunSession, logging_interval, open_timeline
from hf_memwatch.measure.backends import backend_for
from hf_memwatch.measure.monitor import StepMonitor
from hf_memwatch.planning.budget import Budget
from hf_memwatch.reporting.context import KnownPlan

PLAN = PlanRecord(plan=Plan(2, 4, True, "adamw_torch", predicted_peak=300, reason="fits"), budget=400,
                  configured={"micro_batch_size": 8, "gradient_accumulation_steps": 1, "world_size": 1})


def test_the_timeline_opens_with_its_typed_records_and_refuses_a_dict(tmp_path: Path) -> None:
    meta = MetaRecord(model="M", params=1, trainable_params=1, micro_batch_size=2, gradient_accumulation_steps=4,
                      precision="fp32", optim="adamw_torch", world_size=1)
    writer = open_timeline(tmp_path, rank=1, fresh=True, records=[PLAN, meta])
    with pytest.raises(TypeError, match="typed record"):
        writer.write({"event": "meta"})  # only the writer serialises: a dict in flight is a mistake
    RECORD_PROBLEMS.remove("a dict handed to TimelineWriter.write, not a typed record")  # the suite saw it too
    writer.close()
    lines = (tmp_path / "timeline.rank1.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [PLAN.to_dict(), meta.to_dict()]
    assert lines[0].startswith('{"event":"plan","micro_batch_size":2,')  # compact, in the fields' order


def test_which_steps_are_tracked_in_full() -> None:
    session = RunSession(StepMonitor(backend_for(torch.device("cpu")), writer=None), training=True)
    session.first_step, session.logging_steps = 5, 10
    assert [s for s in range(5, 31) if session.is_full_step(s, "auto", 3)] == [5, 6, 7, 10, 20, 30]
    assert session.is_full_step(11, "full", 3) and not session.is_full_step(5, "light", 3)
    assert session.end_step(None) is None  # no step in progress: no record, nothing written


def test_the_logging_interval_in_optimizer_steps() -> None:
    assert logging_interval(SimpleNamespace(logging_strategy="steps", logging_steps=25), None) == 25
    fraction = SimpleNamespace(logging_strategy="steps", logging_steps=0.1)
    assert logging_interval(fraction, SimpleNamespace(max_steps=200)) == 20
    assert logging_interval(SimpleNamespace(logging_strategy="epoch", logging_steps=5), None) == 0


def test_a_plan_record_carries_its_plan_and_the_configuration_it_was_made_for() -> None:
    assert plan_of(PLAN) is PLAN.plan and PLAN.plan.key() == (2, 4, True, "adamw_torch")  # one form, nested
    assert PLAN.to_dict() == {"event": "plan", "micro_batch_size": 2, "gradient_accumulation_steps": 4,
                              "activation_checkpointing": True, "optim": "adamw_torch", "predicted_peak": 300,
                              "budget": 400, "reason": "fits", "configured": PLAN.configured}  # written flat
    assert PlanRecord.from_dict(PLAN.to_dict()) == PLAN
    moved = PLAN.replace(activation_checkpointing=False, reason="between steps", margin=0.1)
    assert (moved.plan.activation_checkpointing, moved.reason, moved.margin, PLAN.reason) == (
        False, "between steps", 0.1, "fits")
    run = RunConfig(micro_batch_size=8, gradient_accumulation_steps=1)
    assert configured_of(run) == PLAN.configured and made_for(PLAN, run)
    assert not made_for(PLAN, run.replace(gradient_accumulation_steps=2))  # resumed otherwise: planned anew
    budget = Budget(total=1000, margin=0, source="test")
    over = over_budget_record(run, budget, need=1500, reason="too big", measured=False)
    assert (over.status, over.source, over.predicted_peak, over.budget, over.in_force) == (
        "over_budget", "predicted", 1500, 1000, False)
    unknown = over_budget_record(run, None, need=None, reason="?", measured=False)
    assert (unknown.status, unknown.source, unknown.budget) == ("failed", "none", None)


def test_between_steps_says_what_the_footprint_measured() -> None:
    record = FootprintRecord(step=2, kind="reserved", allocated_peak=3 << 20, states_growth=1 << 20,
                             footprint_gap=2 << 20, margin=0.5, planned_need=5 << 20, next_step_need=6 << 20,
                             budget=5 << 20, fits=False, advice=None)
    text = footprint_text(record)
    assert text.startswith("step 2 measured 3.00 MiB allocated at its peak + 1.00 MiB optimizer states")
    assert "margin 50.0%" in text and text.endswith("which would not fit the budget 5.00 MiB")
    assert distributed() is False  # no process group here: the between-step agreement is skipped


def test_reporting_reads_the_budget_from_the_auto_mode_else_from_the_plan() -> None:
    assert KnownPlan(budget=900, plan=PLAN).budget_bytes == 900
    assert KnownPlan(budget=None, plan=PLAN).budget_bytes == 400
    assert KnownPlan(budget=0, plan=PLAN.replace(budget=None)).budget_bytes is None  # 0 is no budget
    assert KnownPlan(plan=PLAN.replace(predicted_peak=None)).predicted_peak is None
    assert KnownPlan(plan=PLAN).plan_dict() == PLAN.to_dict() and KnownPlan().plan_dict() is None


def test_the_callback_is_split_by_ownership() -> None:
    """``MemWatch`` adapts the Trainer's events; what lives as long as the run served is ``WatchedRun``'s
    (integration/lifetime.py); the options saved with the state are named in integration/options.py."""
    import inspect

    from hf_memwatch.integration import callback, lifetime, options
    from hf_memwatch.integration.callback import MemWatch

    watch = MemWatch(auto=True, budget="1GiB")
    assert isinstance(watch, lifetime.WatchedRun)
    assert watch.session is None and watch.trainer is None and watch._auto is not None
    assert watch.state()["args"].keys() == set(options.STATE_ARGS)
    events = {name for name, _ in inspect.getmembers(lifetime.WatchedRun) if name.startswith("on_") and name != "on_oom"}
    assert events == set()  # the Trainer's events are the callback's, not the lifetime's
    assert "def _bind" not in inspect.getsource(callback) and "def on_step_end" not in inspect.getsource(lifetime)


def test_between_steps_state_is_declared_by_the_class_that_owns_it() -> None:
    """The footprint state is BetweenSteps' own (the auto mode sets it only through its methods); the plan in
    force, the budget and the predictor are the auto mode's, declared in AutoMode.__init__."""
    import inspect

    from hf_memwatch.integration.auto import AutoMode
    from hf_memwatch.integration.between_steps import BetweenSteps

    own = set(vars(BetweenSteps()))
    assert own == {"kind", "baseline", "measured", "advised", "_checkpointing_refused", "_pending_why", "_agreements",
                   "stop_requested", "_stop_before_sample", "_stream_agreement"}  # the last three: a stream's longer
    # sample (read_ahead), agreed by the ranks
    auto = AutoMode("1GiB", lambda record: None)
    assert {"plan", "budget", "predictor", "budget_spec", "record"} <= set(vars(auto)) - own
    auto_source = inspect.getsource(AutoMode)
    assert not [name for name in own if f"self.{name} =" in auto_source]
    assert "self.plan =" not in inspect.getsource(BetweenSteps.__init__)
