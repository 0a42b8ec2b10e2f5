"""The auto mode predicts the step training will really run: its precision, its loss path, its trainer.

For fp32 and bf16 ``Trainer`` runs and TRL ``SFTTrainer`` runs (full and LoRA), the predicted peak of
the chosen plan lies at most 3% above the peak PyTorch's own accounting measures (the profiler's
CPU memory events), never below it; with a budget, the plan is the fastest that the measurements
say fits (the next faster plan, run by hand, does not).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import gpt2_model, read_records, token_dataset, training_args
from test_equivalence import sft
from transformers import Trainer

from hf_memwatch import MemWatch
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.measure.attribution import weight_storages
from hf_memwatch.planning.chooser import candidates, relative_throughput
from hf_memwatch.planning.plan import Plan
from hf_memwatch.planning.predict import EstimatorPredictor
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak

LIGHT = {"detail": "light", "report": False, "summary": False}


def measured_peak(trainer: Any) -> int:
    """Peak live CPU bytes of ``trainer.train()`` by the profiler (weights included)."""
    baseline = sum(weight_storages(trainer.model, None).values())
    with cpu_memory_profile() as prof:
        trainer.train()
    return window_peak(prof, baseline)


def plain_trainer(out: Path, callbacks: list[Any], **overrides: Any) -> Trainer:
    values = {"per_device_train_batch_size": 8, "max_steps": 2, **overrides}
    return Trainer(model=gpt2_model(n_layer=2, n_embd=64), args=training_args(out, **values),
                   train_dataset=token_dataset(64, 64, 1000), callbacks=callbacks)


CASES = {
    "trainer-fp32": lambda out, cb, **kw: plain_trainer(out, cb, **kw),
    "trainer-bf16": lambda out, cb, **kw: plain_trainer(out, cb, bf16=True, **kw),
    "sft-full-bf16": lambda out, cb, **kw: sft(out, cb, bf16=True, **kw),
    "sft-lora-bf16": lambda out, cb, **kw: sft(out, cb, lora=True, bf16=True, **kw),
}


def given_peak(build: Any, out: Path) -> int:
    trainer = build(out, [])
    run = RunConfig.from_trainer(trainer)
    return EstimatorPredictor(trainer, run).estimate(Plan.of(run)).peak_bytes


@pytest.mark.parametrize("case", list(CASES))
def test_predicted_peak_is_within_3_percent_above_the_measured_one(tmp_path: Path, case: str) -> None:
    build = CASES[case]
    budget = int(0.75 * given_peak(build, tmp_path / "given"))  # a remedy is needed
    trainer = build(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **LIGHT)])
    measured = measured_peak(trainer)
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert measured <= plan["predicted_peak"] <= 1.03 * measured, (plan, measured)
    assert measured <= budget
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] == 8


def test_the_plan_is_the_fastest_that_fits_by_measurement(tmp_path: Path) -> None:
    build = CASES["sft-lora-bf16"]
    given = build(tmp_path / "given", [])
    budget = int(0.75 * given_peak(build, tmp_path / "given"))
    trainer = build(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **LIGHT)])
    trainer.train()
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    chosen = Plan.from_dict(plan)
    run = RunConfig.from_trainer(given).replace(seq_len=plan["sample"]["seq_len"])  # TRL: checkpointing on
    chosen.relative_throughput = relative_throughput(chosen, run)
    faster = [p for p in candidates(run) if p.relative_throughput > chosen.relative_throughput * 1.02]
    # The next faster plan the catalogue allows for this run.
    nearest = min(faster, key=lambda p: p.relative_throughput)
    hand = build(tmp_path / "hand", [], per_device_train_batch_size=nearest.micro_batch_size,
                 gradient_accumulation_steps=nearest.gradient_accumulation_steps,
                 activation_checkpointing=nearest.activation_checkpointing, optim=nearest.optim)
    assert measured_peak(hand) > budget, (plan, nearest)
