"""OOM post-mortem on a real CPU out-of-memory: a subprocess under ``RLIMIT_AS`` (no mocks), in a training
step and in an evaluation loop."""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from conftest import gpt2_model
from transformers import Trainer

from hf_memwatch import is_oom_error
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.core.units import format_bytes
from hf_memwatch.reporting.oom import estimate_remedies, requested_bytes

TESTS = Path(__file__).resolve().parent

# Measured on this project's venv (torch 2.13 CPU, transformers 5.23): the process maps ~2.19 GiB
# once both trainers are built; training GPT-2 (2 layers, 128 wide) at batch 4 x 32 tokens raised
# VmPeak by ~136 MiB, at batch 32 x 256 tokens by ~740 MiB. A limit 300 MiB above the mapped size
# lets the small run train and makes the big one fail in its first forward pass.
MARGIN_MIB = 300

# Both real OOMs in one subprocess (one import of torch and transformers, ~10 CPU s, instead of two), each
# under its own limit above the process's mapped size then: a training step, then an evaluation loop.
OOM_SCRIPT = r"""
import functools, gc, json, os, resource, sys, traceback
sys.path.insert(0, sys.argv[3])
from conftest import freeze_imported_objects, gpt2_model, token_dataset, training_args
from transformers import Trainer
from hf_memwatch import MemWatch
freeze_imported_objects()

out, margin, eval_margin = sys.argv[1], int(sys.argv[2]) << 20, int(sys.argv[4]) << 20
unlimited = resource.getrlimit(resource.RLIMIT_AS)

def vm_size():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))

def trainer(name, batch, seq):
    args = training_args(os.path.join(out, name), per_device_train_batch_size=batch, max_steps=2)
    return Trainer(model=gpt2_model(), args=args, train_dataset=token_dataset(2 * batch, seq, 1000),
                   callbacks=[MemWatch(report=False, summary=False)])

def failure(exc, **more):
    frames = traceback.extract_tb(exc.__traceback__)
    return dict(type=type(exc).__name__, message=str(exc), innermost=frames[-1].filename,
                frames=[f.filename for f in frames], **more)

small, big = trainer("small", 4, 32), trainer("big", 32, 256)
raised = []  # the exception as it left the model, to compare with what reaches the caller
forward = big.model.forward

@functools.wraps(forward)
def forward_recording(*args, **kwargs):
    try:
        return forward(*args, **kwargs)
    except BaseException as exc:
        raised.append(exc)
        raise

big.model.forward = forward_recording
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + margin, unlimited[1]))
small.train()
facts = {"small_steps": small.state.global_step, "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0]}
try:
    big.train()
    facts["big"] = "trained"
except BaseException as exc:
    facts.update(failure(exc, same_object=bool(raised) and raised[0] is exc))
resource.setrlimit(resource.RLIMIT_AS, unlimited)
print("FACTS" + json.dumps(facts), flush=True)
del small, big, raised
gc.collect()

# The eval loop: 4096 x 64 tokens x 1000 fp32 logits = 1 GiB accumulated, the cat fails well before the end.
import torch
torch.set_num_threads(2)

def metrics(prediction):
    return {"n": float(prediction.predictions.shape[0])}

def evaluator(name, samples):
    args = training_args(os.path.join(out, "eval", name), per_device_eval_batch_size=64)
    return Trainer(model=gpt2_model(n_layer=2, n_embd=32, vocab=1000), args=args,
                   eval_dataset=token_dataset(samples, 64, 1000), compute_metrics=metrics,
                   callbacks=[MemWatch(report=False, summary=False)])

small, big = evaluator("small", 128), evaluator("big", 4096)
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + eval_margin, unlimited[1]))
facts = {"small": small.evaluate()["eval_n"]}
try:
    big.evaluate()
    facts["big"] = "evaluated"
except BaseException as exc:
    facts.update(failure(exc))
print("EVAL" + json.dumps(facts), flush=True)
"""
EVAL_MARGIN_MIB = 400


@pytest.fixture(scope="module")
def ooms(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """The subprocess's folder, the training OOM's facts and the eval loop's."""
    folder = tmp_path_factory.mktemp("oom")
    proc = subprocess.run([sys.executable, "-c", OOM_SCRIPT, str(folder), str(MARGIN_MIB), str(TESTS),
                           str(EVAL_MARGIN_MIB)], capture_output=True, text=True, timeout=600)
    found = {tag: json.loads(line[len(tag):]) for line in proc.stdout.splitlines()
             for tag in ("FACTS", "EVAL") if line.startswith(tag)}
    assert proc.returncode == 0 and len(found) == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    return folder, found["FACTS"], found["EVAL"]


def test_real_cpu_oom_writes_the_post_mortem_and_the_error_reaches_the_user_unchanged(ooms):
    tmp_path, facts, _ = ooms

    assert facts["small_steps"] == 2  # the limit alone does not break a run that fits
    assert "DefaultCPUAllocator: can't allocate memory" in facts["message"]
    assert facts["same_object"]  # the very exception the model raised
    assert "hf_memwatch" not in facts["innermost"] and "torch" in facts["innermost"]
    # As the user's code raised it: no frame of hf_memwatch (the tracker's dispatch) inside the run.
    inner = facts["frames"][next(i for i, f in enumerate(facts["frames"]) if "transformers" in f):]
    assert not [f for f in inner if "/hf_memwatch/" in f], inner

    memwatch = tmp_path / "big" / "memwatch"
    assert not (tmp_path / "small" / "memwatch" / "oom_report.md").exists()
    report = (memwatch / "oom_report.md").read_text()
    # The limit that bound the run, with its figure (the soft RLIMIT_AS the script set).
    assert f"**Binding limit:** RLIMIT_AS = {format_bytes(facts['rlimit_as'])} (soft limit" in report, report[:1500]
    (oom,) = [json.loads(line) for line in (memwatch / "timeline.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "oom"]
    assert (oom["step"], oom["micro_step"], oom["last_phase"]) == (1, 0, "step_begin")
    assert "optimizer step 1, micro-batch 0, during the forward pass" in report
    assert oom["requested"] == requested_bytes(RuntimeError(facts["message"]))
    assert f"Failed allocation:** {oom['requested'] / 2**20:.2f} MiB" in report
    # What was live when it failed: classes add up; the failing forward's saved activations dominate.
    live = oom["live_at_failure"]
    assert sum(live.values()) == oom["allocated_at_failure"]
    assert live["activations"] > live["weights"] > 0 and live["optimizer_states"] == 0
    assert f"| activations | {live['activations'] / 2**20:.2f} MiB |" in report
    # The largest tensors alive at the failure, with the module that made each: every storage counted.
    tensors = report.split("## Largest tensors", 1)[1].split("## ", 1)[0]
    assert (f"every storage alive when the allocation failed (step 1, CPU tracker): "
            f"{oom['allocated_at_failure'] / 2**20:.2f} MiB") in tensors, tensors
    rows = [line for line in tensors.splitlines() if line.startswith("| ") and "MiB" in line]
    assert len(rows) == 10 and any("| transformer.h." in row and "| forward |" in row for row in rows), tensors
    # The dying process has no CPU memory left (the failing pass's activations are still held by the
    # traceback), so the report names the estimate command instead of running the estimator there;
    # the figures it gives are checked below, where memory allows.
    section = report.split("## What would have saved how much", 1)[1].split("## Plan in force", 1)[0]
    assert "CPU memory was exhausted" in section
    assert "hf-memwatch estimate" in section and "--micro-batch-size 32 --seq-len 256" in section, section


def test_a_real_cpu_oom_in_evaluate_names_the_loop_the_batch_the_outputs_and_the_remedies(ooms):
    """The eval loop of the subprocess: 4096 x 64 tokens x 1000 fp32 logits (1 GiB) accumulated under a
    limit 400 MiB above the process: the outputs' cat fails well before the end."""
    folder, _, facts = ooms
    tmp_path = folder / "eval"
    assert facts["small"] == 128  # the limit alone does not break a loop that fits
    assert "DefaultCPUAllocator: can't allocate memory" in facts["message"]
    assert "hf_memwatch" not in facts["innermost"]  # the user's error, unchanged

    memwatch = tmp_path / "big" / "memwatch"
    report = (memwatch / "oom_report.md").read_text()
    records = [json.loads(line) for line in (memwatch / "timeline.jsonl").read_text().splitlines()]
    (oom,) = [r for r in records if r["event"] == "oom"]
    (loop,) = [r for r in records if r["event"] == "eval"]
    assert oom["stage"] == "eval" and oom["batch"] == loop["batches"] > 1
    assert oom["outputs_at_failure"] >= (oom["batch"] - 1) * 64 * 64 * 1000 * 4  # the logits held so far
    assert sum(oom["live_at_failure"].values()) == oom["allocated_at_failure"]
    assert f"the eval loop (`Trainer.evaluate()`) at global step 0, eval batch {oom['batch']} of 64" in report
    assert f"{oom['outputs_at_failure'] / 2**20:.2f} MiB accumulated outputs" in report
    section = report.split("## Eval remedies and what each would save", 1)[1]
    assert "Predicted peak of this loop" in section, section
    for remedy in ("per_device_eval_batch_size 64 → 32", "eval_accumulation_steps=1",
                   "logits.argmax(-1)", "prediction_loss_only=True"):
        assert remedy in section
    # argmax keeps 8 bytes a token instead of 4000: it saves nearly the whole 1 GiB of logits.
    row = next(line for line in section.splitlines() if "argmax" in line)
    assert "GiB" in row.split("|")[3] or float(row.split("|")[3].split()[0]) > 900, row


def test_remedy_estimates_for_the_failing_configuration():
    """The estimates the post-mortem gives for the run above, computed where memory allows."""
    config = RunConfig(micro_batch_size=32, seq_len=256, precision="fp32", optim="adamw_torch_fused")
    baseline, rows, note = estimate_remedies(gpt2_model(), config)
    assert note == "" and baseline is not None
    saved = {description.split(" (")[0].split(",")[0]: baseline - peak for description, peak, _ in rows
             if peak is not None}
    assert saved["micro-batch 32 -> 16"] > 0 and saved["activation checkpointing on"] > 0, saved
    # The logits are most of this step: the fused/chunked loss routes come as advice, with their bytes.
    advice = [(description, note) for description, peak, note in rows if peak is None]
    assert [d.split(" ")[0] for d, _ in advice] == ["trl.SFTTrainer"], advice  # a CPU run: no CUDA-only Liger
    assert all(note.startswith("saves up to ") for _, note in advice)


class FailingLoss(Trainer):
    """``compute_loss`` fails after the forward: a real allocator failure, or ``error``."""

    error: BaseException | None = None

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        try:
            if self.error is not None:
                raise self.error
            torch.empty(1 << 60, dtype=torch.uint8)  # a real allocator failure, no limit needed
        except BaseException as exc:
            self.raised = exc
            raise
        return loss


def _failing(tmp_path, error=None):
    from conftest import token_dataset, training_args

    from hf_memwatch import MemWatch

    watch = MemWatch(detail="full", report=False, summary=False)
    trainer = FailingLoss(model=gpt2_model(n_layer=1, n_embd=32, vocab=100), args=training_args(tmp_path, max_steps=1),
                          train_dataset=token_dataset(4, 8, 100), callbacks=[watch])
    trainer.error = error
    return trainer, watch


def test_guard_reports_once_and_never_replaces_the_error(tmp_path, caplog):
    trainer, watch = _failing(tmp_path / "oom")
    seen = []
    watch.on_oom = seen.append
    inner = trainer.train

    @functools.wraps(inner)
    def outer(*args, **kwargs):  # another engineer's wrapper around ours
        return inner(*args, **kwargs)

    trainer.train = outer
    with pytest.raises(RuntimeError) as caught:
        trainer.train()
    assert caught.value is trainer.raised and is_oom_error(caught.value)
    assert seen == [trainer.raised]
    # The traceback is the user's: no frame of hf_memwatch between theirs and the failing operator.
    frames = [frame.filename for frame in traceback.extract_tb(caught.value.__traceback__)]
    inner_frames = frames[next(i for i, f in enumerate(frames) if "transformers" in f):]
    assert not [f for f in inner_frames if "/hf_memwatch/" in f], inner_frames

    broken, watch = _failing(tmp_path / "broken")
    watch.on_oom = lambda exc: 1 / 0
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"), pytest.raises(RuntimeError) as caught:
        broken.train()
    assert caught.value is broken.raised and "OOM report failed" in caplog.text

    other, watch = _failing(tmp_path / "other", ValueError("bad data"))
    seen2 = []
    watch.on_oom = seen2.append
    with pytest.raises(ValueError):
        other.train()
    assert seen2 == []
