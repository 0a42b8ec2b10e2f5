"""Memory scalars read back from real TensorBoard event files and real W&B offline runs (no mocks)."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState
from transformers.integrations import TensorBoardCallback, WandbCallback

from hf_memwatch import LIVE_CLASSES, MemWatch
from hf_memwatch.core.records import Snapshot, StepRecord
from hf_memwatch.reporting.sinks import (
    exact_name_routes,
    merge_ranks,
    routed_on_log,
    scalar_logging,
    step_scalars,
)
from hf_memwatch.testing.truth import StepMarker, cpu_memory_profile, step_peaks

LEVELDB_BLOCK = 32 * 1024


def wandb_history(run_dir: Path) -> list[dict]:
    """History rows of a W&B offline run, parsed from its ``.wandb`` file with wandb's own protobufs.

    The file is wandb's record log: a 7-byte header (``:W&B``, magic, version), then LevelDB-log
    records (crc32 4, length 2, type 1: full/first/middle/last) in 32 KiB blocks.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, rows = 7, b"", []
    while pos + 7 <= len(data):
        left = LEVELDB_BLOCK - pos % LEVELDB_BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (2, 3):
            continue
        record = pb.Record()
        record.ParseFromString(pending)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def finish_wandb() -> Path:
    """Finish the live W&B run and return its folder once its record file is complete.

    ``wandb.finish`` can return before wandb-core has written the file; ``wandb.teardown`` waits for
    the service process to exit (and drops the settings it kept, so the next run honours WANDB_DIR).
    """
    import wandb

    assert wandb.run is not None
    run_dir = Path(wandb.run.dir).parent
    wandb.finish()
    wandb.teardown()
    return run_dir


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag → {step: value} of every scalar in the run's event files (tensorboard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = list(log_dir.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


class KeysSeen(TrainerCallback):
    """A real callback placed before MemWatch: what an integration that does not prefix receives."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_scalars_land_under_exact_names_at_the_loss_step_in_tensorboard_and_wandb(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    model = gpt2_model()
    args = training_args(out, report_to=["tensorboard", "wandb"], max_steps=4, logging_steps=2,
                         eval_strategy="steps", eval_steps=2, run_name="memwatch-test")
    seen = KeysSeen()
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(16, 64, 1000),
                      eval_dataset=token_dataset(4, 64, 1000, seed=1),
                      callbacks=[seen, MemWatch(report=False, summary=False), StepMarker()])
    baseline = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*model.parameters(), *model.buffers()]}.values())
    with cpu_memory_profile() as prof:
        trainer.train()
    run_dir = finish_wandb()
    truth = step_peaks(prof, baseline)
    console = capsys.readouterr().out
    steps = {r["step"]: r for r in read_records(out) if r["event"] == "step"}

    # The figures are the timeline's, and the timeline's peak is PyTorch's own accounting.
    for step in (2, 4):
        assert abs(steps[step]["peak"] - truth[step - 1]) / truth[step - 1] <= 0.02, (steps, truth)

    tb = tensorboard_scalars(out)
    history = wandb_history(run_dir)
    rows = [row for row in history if "train/loss" in row]
    assert [row["train/global_step"] for row in rows] == [2, 4]
    assert sorted(tb["train/loss"]) == [2, 4]
    snapshots = [r for r in read_records(out) if r["event"] == "snapshot"]
    for row in rows:
        step = row["train/global_step"]
        record = steps[step]
        # The classes at the peak moment: the higher end of the phase that holds the peak.
        mine = [s for s in snapshots if s["step"] == step]
        i = next(k for k, s in enumerate(mine) if s["phase"] == record["peak_phase"]
                 and s["micro_step"] == record["peak_micro_step"])
        end = mine[i - 1] if i and mine[i - 1]["allocated"] > mine[i]["allocated"] else mine[i]
        expected = {"peak": record["peak"], "spike": record["spike_at_peak"], "allocated": end["allocated"],
                    **end["live"]}
        for name, value in expected.items():
            assert row[f"memory/{name}"] == value  # W&B: exact name, same row as the loss, exact bytes
            assert tb[f"memory/{name}"][step] == pytest.approx(value, rel=1e-6)  # float32 in TB
        assert sum(row[f"memory/{c}"] for c in LIVE_CLASSES) == row["memory/allocated"]
        assert row["memory/allocated"] + row["memory/spike"] == row["memory/peak"]
    # Every memory scalar at exactly the loss's steps (TB), in the loss's rows only (W&B).
    memory_tags = {tag for tag in tb if tag.startswith("memory/") and not tag.startswith("memory/eval_")}
    assert memory_tags == {f"memory/{name}" for name in ("peak", "allocated", "spike", *LIVE_CLASSES)}
    assert all(sorted(tb[tag]) == [2, 4] for tag in memory_tags)
    assert all("train/loss" in row for row in history
               if any(k.startswith("memory/") and not k.startswith("memory/eval_") for k in row))
    # No duplicate under the integrations' ``train/`` prefix, anywhere.
    assert not [tag for tag in tb if "memory/" in tag and not tag.startswith("memory/")]
    assert not [k for row in history for k in row if "memory/" in k and not k.startswith("memory/")]
    # CPU: PyTorch keeps no reserved/fragmentation figures; nothing is made up for them.
    assert "memory/reserved" not in tb and "memory/fragmentation" not in tb
    # Evaluation logs get the eval loop's figures (memory/eval_*), beside eval/loss, at the same step;
    # the console line stays as it was; log_history keeps them.
    loops = {r["step"]: r for r in read_records(out) if r["event"] == "eval"}
    eval_rows = [row for row in history if "eval/loss" in row]
    assert [row["train/global_step"] for row in eval_rows] == [2, 4] == sorted(loops)
    for row in eval_rows:
        loop = loops[row["train/global_step"]]
        assert row["memory/eval_peak"] == loop["peak"]
        assert tb["memory/eval_peak"][row["train/global_step"]] == pytest.approx(loop["peak"], rel=1e-6)
        assert row["memory/eval_outputs"] == loop["live"]["outputs"]
        assert not [k for k in row if k.startswith("memory/") and not k.startswith("memory/eval_")]
    assert sorted(tb["eval/loss"]) == sorted(tb["memory/eval_peak"]) == [2, 4]
    assert "'loss'" in console and "memory/" not in console
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["memory/peak"] for e in logged] == [steps[2]["peak"], steps[4]["peak"]]
    # Callbacks that do not prefix (MLflow and the like) get the keys, unprefixed, in ``logs``.
    assert [e["memory/peak"] for e in seen.logs if "loss" in e] == [steps[2]["peak"], steps[4]["peak"]]


def test_headroom_and_predicted_peak_come_from_the_plan(tmp_path):
    out = tmp_path / "run"
    args = training_args(out, report_to=["tensorboard"], max_steps=2, logging_steps=1)
    trainer = Trainer(model=gpt2_model(), args=args, train_dataset=token_dataset(16, 32, 1000),
                      callbacks=[MemWatch(auto=True, budget="4GiB", report=False, summary=False)])
    trainer.train()
    records = read_records(out)
    (plan,) = [r for r in records if r["event"] == "plan"]
    steps = {r["step"]: r for r in records if r["event"] == "step"}
    tb = tensorboard_scalars(out)
    for step in (1, 2):
        assert tb["memory/headroom"][step] == pytest.approx(plan["budget"] - steps[step]["peak"], rel=1e-6)
        assert tb["memory/predicted_peak"][step] == pytest.approx(plan["predicted_peak"], rel=1e-6)
    assert "train/memory/headroom" not in tb and "train/memory/predicted_peak" not in tb


def test_wandb_without_a_run_yet_gets_the_scalars_in_a_row_at_the_same_global_step(tmp_path, monkeypatch):
    # The fallback route: the W&B callback sets its run up inside this on_log, so nothing was staged.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    wandb.finish()  # no run left over from another test
    callback = WandbCallback()
    assert route_exact_names([callback, TrainerCallback()]) == 1
    assert route_exact_names([callback]) == 0  # once per callback
    args = training_args(tmp_path / "run", report_to=["wandb"], run_name="memwatch-fallback")
    state = TrainerState(global_step=5)
    callback.on_log(args, state, TrainerControl(), logs={"loss": 1.5, "memory/peak": 123})
    run_dir = finish_wandb()
    history = wandb_history(run_dir)
    loss_row = next(r for r in history if "train/loss" in r)
    memory_row = next(r for r in history if "memory/peak" in r)
    assert (loss_row["train/loss"], loss_row["train/global_step"]) == (1.5, 5)
    assert (memory_row["memory/peak"], memory_row["train/global_step"]) == (123, 5)
    assert not [k for row in history for k in row if k.startswith("train/memory")]


def test_a_fault_in_our_tensorboard_write_is_logged_and_the_integration_still_logs(tmp_path, caplog):
    callback = TensorBoardCallback()
    route_exact_names([callback])
    args = training_args(tmp_path / "run", report_to=["tensorboard"])
    state = TrainerState(global_step=3)
    callback.on_train_begin(args, state, TrainerControl())  # sets the log dir under output_dir
    # A value TensorBoard's real writer refuses: our write fails, the integration's own write must not.
    callback.on_log(args, state, TrainerControl(), logs={"loss": 2.5, "memory/peak": "not a number"})
    callback.on_train_end(args, state, TrainerControl())
    assert "memory scalars not written to TensorBoardCallback" in caplog.text
    tb = tensorboard_scalars(tmp_path / "run")
    assert tb["train/loss"] == {3: 2.5}
    assert not [tag for tag in tb if "memory" in tag]


def test_step_scalars_use_the_allocator_figures_where_the_device_keeps_them():
    # The shape of a CUDA step record (reserved, fragmentation); the CPU test above covers the rest.
    record = {"step": 3, "peak": 900, "peak_phase": "after_forward", "peak_micro_step": 0, "reserved": 2048,
              "spike_at_peak": 100, "live_at_peak": dict.fromkeys(LIVE_CLASSES, 160)}
    snaps = [{"phase": "step_begin", "micro_step": 0, "allocated": 500, "fragmentation": 64,
              "live": dict.fromkeys(LIVE_CLASSES, 100)},
             {"phase": "after_forward", "micro_step": 0, "allocated": 800, "fragmentation": 96,
              "live": dict.fromkeys(LIVE_CLASSES, 160)}]
    scalars = step_scalars(StepRecord.from_dict(record, lenient=True),
                           [Snapshot.from_dict(s, lenient=True) for s in snaps], budget=1000, predicted_peak=950)
    assert scalars == {
        "memory/peak": 900, "memory/allocated": 800, "memory/reserved": 2048, "memory/weights": 160,
        "memory/gradients": 160, "memory/optimizer_states": 160, "memory/activations": 160, "memory/other": 160,
        "memory/spike": 100, "memory/fragmentation": 96, "memory/headroom": 100, "memory/predicted_peak": 950,
    }


GATHER_SCRIPT = """
import json, sys, torch
from hf_memwatch.reporting.sinks import gather_over_ranks
rank = int(sys.argv[1])
torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
mine = {"memory/peak": 1000 * (rank + 1), "memory/headroom": 500 - 100 * rank, "memory/spike": 7 + rank}
merged = gather_over_ranks(mine if rank == 0 else {**mine, "memory/reserved": 4096})
open(sys.argv[3] + f"/rank{rank}.json", "w").write(json.dumps(merged))
torch.distributed.destroy_process_group()
"""


def test_ranks_merge_into_max_and_per_rank_values_over_a_real_process_group(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", GATHER_SCRIPT, str(rank), str(port), str(tmp_path)])
             for rank in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]  # every rank logs the same figures
    assert results[0] == {
        "memory/peak": 2000, "memory/headroom": 400, "memory/spike": 8, "memory/reserved": 4096,
        "memory/rank0/peak": 1000, "memory/rank0/spike": 7,
        "memory/rank1/peak": 2000, "memory/rank1/spike": 8, "memory/rank1/reserved": 4096,
    }
    assert merge_ranks([{"memory/peak": 5}]) == {"memory/peak": 5}


class _Recorder:
    """A stand-in trainer with a real ``log`` method: records what reaches it."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.state = type("State", (), {"global_step": 7})()

    def log(self, logs, start_time=None):
        self.received.append(dict(logs))


def route_exact_names(callbacks) -> int:
    """Route the TensorBoard/W&B callbacks as a run's patches do; how many were routed now."""
    routes = exact_name_routes(callbacks)
    for callback, before, after in routes:
        callback.on_log = routed_on_log(callback, callback.on_log, before, after)
    return len(routes)


def test_log_wrapper_composes_and_survives_its_own_faults(caplog):
    trainer = _Recorder()
    trainer.log = scalar_logging(trainer, trainer.log, lambda step: {"memory/peak": step})
    trainer.log({"loss": 1.0})
    trainer.log({"eval_loss": 2.0})  # evaluation: untouched
    trainer.log({"train_runtime": 3.0})  # end-of-training metrics: untouched
    assert trainer.received == [{"loss": 1.0, "memory/peak": 7}, {"eval_loss": 2.0}, {"train_runtime": 3.0}]

    broken = _Recorder()
    broken.log = scalar_logging(broken, broken.log, lambda step: 1 / 0)
    broken.log({"loss": 1.0})
    assert broken.received == [{"loss": 1.0}]
    assert "memory scalars not logged" in caplog.text


@pytest.mark.parametrize("flag", ["scalars", "report", "summary", "oom_report", "record_history"])
def test_reporting_flags_fail_fast(flag):
    from hf_memwatch import MemWatchConfigError

    with pytest.raises(MemWatchConfigError, match=rf"MemWatch\({flag}=\.\.\.\) must be True or False"):
        MemWatch(**{flag: "yes"})
    assert MemWatch(**{flag: False}).state()["args"][flag] is False  # kept in the callback's saved state
