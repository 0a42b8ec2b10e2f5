"""Drift and leaks (measure/leaks.py) on synthetic series and on real Trainer runs with a real leak."""

from __future__ import annotations

import logging
import mmap
import random
from pathlib import Path

import pytest
import torch
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import Trainer, TrainerCallback

from hf_memwatch import MemWatch
from hf_memwatch.measure.leaks import find_leaks, predicted_oom_step

MiB = 1 << 20


def history(values: list[float], name: str = "other") -> list[dict]:
    return [{"step": i + 1, "figures": {name: int(v)}} for i, v in enumerate(values)]


def test_a_steady_growth_under_noise_is_found_with_its_rate_and_start():
    rng = random.Random(0)
    values = [500 * MiB] * 3 + [500 * MiB + k * 1.2 * MiB + rng.uniform(-0.3, 0.3) * MiB for k in range(1, 8)]
    found = find_leaks(history(values), headroom=lambda name: 120 * MiB)
    assert len(found) == 1
    leak = found[0]
    assert leak.klass == "other" and leak.EVENT == "leak"  # a typed record (core/records.py)
    assert 1.0 * MiB < leak.bytes_per_step < 1.4 * MiB
    assert leak.since_step <= 4 and leak.step == 10
    assert leak.predicted_oom_step == predicted_oom_step(10, leak.bytes_per_step, 120 * MiB)
    assert 100 < leak.predicted_oom_step < 120


@pytest.mark.parametrize(
    "values",
    [
        [100 * MiB + random.Random(1).uniform(-3, 3) * MiB for _ in range(12)],  # noise, no trend
        [100 * MiB] * 3 + [150 * MiB] * 9,  # one jump (a cache filled once), then flat
        [100 * MiB + k * 0.5 * MiB for k in range(12)],  # below the 1 MiB/step threshold
        [100 * MiB + k * 4 * MiB for k in range(5)],  # too few steps for a verdict
        [100 * MiB + (k % 2) * 8 * MiB + k * 1.5 * MiB for k in range(12)],  # sawtooth: half the steps fall
    ],
)
def test_no_alarm_without_a_sustained_growth(values):
    assert find_leaks(history(values)) == []


class InjectedLeak(TrainerCallback):
    """The classic leak: a tensor kept across steps (here 2 MiB appended to a list every step)."""

    def __init__(self, mib: float = 2.0) -> None:
        self.kept: list[torch.Tensor] = []
        self.numel = int(mib * MiB) // 4

    def on_step_end(self, args, state, control, **kwargs):
        self.kept.append(torch.ones(self.numel))


class InjectedHostLeak(TrainerCallback):
    """Host memory kept across steps outside torch (a growing buffer of metrics, a worker's cache):
    fresh anonymous pages, touched, every step, so the resident size grows whatever malloc holds."""

    def __init__(self, mib: float = 2.0) -> None:
        self.kept: list[mmap.mmap] = []
        self.size = int(mib * MiB)

    def on_step_end(self, args, state, control, **kwargs):
        block = mmap.mmap(-1, self.size)
        block.write(b"\x01" * self.size)
        self.kept.append(block)


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = next(log_dir.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def run(out: Path, callbacks: list, **args) -> list[dict]:
    trainer = Trainer(model=gpt2_model(n_embd=64), args=training_args(out, **args),
                      train_dataset=token_dataset(64, 32, 1000), callbacks=callbacks)
    trainer.train()
    return read_records(out)


def test_an_injected_leak_is_found_within_10_steps_once_with_a_warning_and_a_tensorboard_scalar(tmp_path, caplog):
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        records = run(out, [InjectedLeak(2.0), MemWatch(detail="full")], max_steps=10, logging_steps=1,
                      report_to=["tensorboard"])
    leaks = [r for r in records if r["event"] == "leak"]
    print("leak records:", leaks)
    by_class = {r["class"]: r for r in leaks}
    assert len(leaks) == len(by_class) >= 1  # each class once
    # Every step is tracked in full: the tensors are counted as "other". (host_rss grows too in a
    # fresh process; in a long one malloc may first reuse memory freed earlier, so it is not required.)
    assert "other" in by_class and set(by_class) <= {"other", "host_rss"}
    other = by_class["other"]
    assert other["step"] <= 10 and other["bytes_per_step"] == 2 * MiB and other["since_step"] <= 3
    assert other["predicted_oom_step"] is not None and other["predicted_oom_step"] > other["step"]
    warnings = [r.getMessage() for r in caplog.records if "per step at step end" in r.getMessage()]
    assert len(warnings) == len(leaks) and any(w.startswith("hf-memwatch: other grows 2.00 MiB") for w in warnings)
    tb = tensorboard_scalars(out)
    rate = tb["memory/leak_bytes_per_step"]
    first = min(r["step"] for r in leaks)
    assert min(rate) == first and rate[10] >= 2 * MiB
    assert "memory/peak" in tb


def test_a_host_side_leak_is_found_from_host_rss_when_steps_are_light(tmp_path):
    leak_source = InjectedHostLeak(2.0)
    records = run(tmp_path / "run", [leak_source, MemWatch()], max_steps=10, logging_steps=5)
    for block in leak_source.kept:
        block.close()
    leak = next(r for r in records if r["event"] == "leak")
    print("leak record:", leak)
    assert leak["class"] == "host_rss" and leak["step"] <= 10
    assert 1.5 * MiB <= leak["bytes_per_step"] <= 3 * MiB
    ends = [r for r in records if r["event"] == "snapshot"]
    assert all(isinstance(r["host_rss"], int) and r["host_rss"] > 0 for r in ends)


def test_no_alarm_on_a_clean_run(tmp_path, caplog):
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        records = run(out, [MemWatch()], max_steps=14, logging_steps=1, report_to=["tensorboard"])
    assert [r for r in records if r["event"] == "leak"] == []
    assert not [r for r in caplog.records if "per step at step end" in r.getMessage()]
    assert "memory/leak_bytes_per_step" not in tensorboard_scalars(out)
