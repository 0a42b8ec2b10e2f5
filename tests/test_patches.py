"""Per-instance Trainer patches: ``auto_find_batch_size`` retries that keep the effective batch.

The out-of-memory error is simulated the way transformers' own tests do it
(``test_auto_batch_size_with_resume_from_checkpoint``): a callback raises
``RuntimeError("CUDA out of memory.")`` at the first step while the batch is large, and the Trainer's
real retry (``find_executable_batch_size``) runs.
"""

from __future__ import annotations

import logging

import pytest
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import Trainer, TrainerCallback

from hf_memwatch import MemWatch
from hf_memwatch.integration.patches import keep_effective_batch, largest_divisor_at_most


class OutOfMemoryWhileLarge(TrainerCallback):
    """Raise the message accelerate recognises as an OOM when a step starts with a batch above ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.raised = 0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.train_batch_size > self.limit:
            self.raised += 1
            raise RuntimeError("CUDA out of memory. (simulated)")


class SamplesPerStep(TrainerCallback):
    """Rows that went through the model's forward in each optimizer step."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._rows = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.per_step, self._rows = [], 0
        if not getattr(model, "_counted", False):
            model.register_forward_pre_hook(self._count, with_kwargs=True)
            model._counted = True

    def _count(self, module, args, kwargs):
        self._rows += int(kwargs["input_ids"].shape[0])

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(self._rows)
        self._rows = 0


def run_with_simulated_oom(out_dir, *, keep: bool):
    """A 2-step run (micro-batch 8 x accumulation 2) whose batches above 6 "run out of memory", with MemWatch."""
    oom, samples = OutOfMemoryWhileLarge(limit=6), SamplesPerStep()
    args = training_args(out_dir, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=2,
                         auto_find_batch_size=True)
    trainer = Trainer(model=gpt2_model(n_embd=32), args=args, train_dataset=token_dataset(64, 16, 1000),
                      callbacks=[oom, samples, MemWatch(report=False, summary=False)])
    undo = keep_effective_batch(trainer) if keep else None
    trainer.train()
    return trainer, oom, samples, undo


def test_retry_after_oom_keeps_the_effective_batch(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        trainer, oom, samples, undo = run_with_simulated_oom(tmp_path / "kept", keep=True)

    assert oom.raised == 1  # the retry happened: 8 failed, accelerate offered int(8 * 0.9) = 7
    # 7 does not divide 16: the micro-batch is 4, the accumulation 4.
    assert trainer.state.train_batch_size == 4
    assert trainer.args.gradient_accumulation_steps == 4
    assert samples.per_step == [16, 16]
    assert trainer.state.global_step == 2
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "micro-batch 7" in warning and "micro-batch 4" in warning and "stays 16" in warning
    assert "internal error" not in warning  # MemWatch followed the retry (a new loop, a new monitor)
    steps = [r for r in read_records(tmp_path / "kept") if r["event"] == "step"]
    assert [s["step"] for s in steps] == [1, 2]

    undo()
    assert "_inner_training_loop" not in vars(trainer)  # the class's method again
    undo()  # twice is harmless


def test_without_the_patch_the_retry_shrinks_the_effective_batch(tmp_path):
    """The defect the patch guards against, on the same run: accelerate alone ends at 6 x 2 = 12."""
    trainer, oom, samples, _ = run_with_simulated_oom(tmp_path / "plain", keep=False)
    assert oom.raised == 2  # 8, then 7, fail
    assert trainer.state.train_batch_size == 6
    assert samples.per_step == [12, 12]


@pytest.mark.parametrize(("number", "limit", "expected"), [(16, 7, 4), (16, 16, 16), (24, 21, 12), (7, 6, 1)])
def test_largest_divisor_at_most(number, limit, expected):
    assert largest_divisor_at_most(number, limit) == expected
