"""Every exit path of ``train()`` leaves nothing of MemWatch behind (issue #21 point 3).

After ``train()`` returns or raises — an exception in the user's ``compute_loss``, a
``KeyboardInterrupt``, a real allocator failure, ``max_steps`` reached, a callback that stops
training — no dispatch mode, saved-tensor hook, module hook, run patch of the Trainer or open
timeline file remains, and a following ``torch.compile`` run compiles (Dynamo refuses to compile
frames under a Python dispatch mode).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import gpt2_model, token_dataset, training_args
from transformers import Trainer, TrainerCallback

from hf_memwatch import MemWatch
from hf_memwatch.integration.patches import ENTRY_POINTS, patched_names

RUN_PATCHES = ("log", "_inner_training_loop", "evaluation_loop", "prediction_step", "get_batch_samples")


class Failing(Trainer):
    """``compute_loss`` raises ``error`` in the first step, after the forward (monitoring is on)."""

    error: BaseException | None = None

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self.error is not None:
            raise self.error
        return loss


class OutOfMemoryInLoss(Trainer):
    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        torch.empty(1 << 60, dtype=torch.uint8)  # a real allocator failure
        return loss


class StopAtFirstStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = True


def open_files_under(folder: Path) -> list[str]:
    fds = Path("/proc/self/fd")
    paths = []
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(folder)):
            paths.append(target)
    return paths


def assert_nothing_left(trainer: Trainer, folder: Path) -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert _get_current_dispatch_mode_stack() == []
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    model = trainer.model
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks, type(module).__name__
    left = [name for name in RUN_PATCHES if name in trainer.__dict__]
    assert left == [], left
    assert set(patched_names(trainer)) <= set(ENTRY_POINTS)
    for callback in trainer.callback_handler.callbacks:
        assert "on_log" not in callback.__dict__, type(callback).__name__
    assert open_files_under(folder) == []


def compiles_afterwards() -> int:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x: torch.sin(x) + 1, backend="aot_eager")
    compiled(torch.randn(8))
    return int(counters["stats"]["unique_graphs"])


CASES = {
    "exception": (Failing, ValueError("bad batch"), ValueError),
    "interrupt": (Failing, KeyboardInterrupt(), KeyboardInterrupt),
    "oom": (OutOfMemoryInLoss, None, RuntimeError),
    "max_steps": (Trainer, None, None),
    "stopped": (Trainer, "stop", None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_exit_path_leaves_nothing_behind(tmp_path, case):
    cls, error, raised = CASES[case]
    args = training_args(tmp_path, max_steps=2)
    callbacks = [MemWatch(detail="full", report=False, summary=False)]
    if error == "stop":
        callbacks.append(StopAtFirstStep())
    trainer = cls(model=gpt2_model(n_layer=1, n_embd=32, vocab=100), args=args,
                  train_dataset=token_dataset(8, 8, 100), callbacks=callbacks)
    if isinstance(error, BaseException):
        trainer.error = error
    if raised is None:
        trainer.train()
    else:
        with pytest.raises(raised):
            trainer.train()
    assert_nothing_left(trainer, tmp_path)
    assert compiles_afterwards() > 0


def test_detach_restores_every_method(tmp_path):
    watch = MemWatch(report=False, summary=False)
    trainer = Trainer(model=gpt2_model(n_layer=1, n_embd=32, vocab=100), args=training_args(tmp_path, max_steps=1),
                      train_dataset=token_dataset(4, 8, 100), callbacks=[watch])
    assert set(patched_names(trainer)) == set(ENTRY_POINTS)
    trainer.train()
    watch.detach(trainer)
    assert patched_names(trainer) == []
    assert not any(name in trainer.__dict__ for name in (*ENTRY_POINTS, *RUN_PATCHES))


def test_auto_mode_added_after_the_trainer_was_built_never_trains_unplanned_silently(tmp_path, caplog):
    """``trainer.add_callback(MemWatch(auto=True))``: ``train()`` was entered before the callback could wrap
    it, so nothing can be planned. It stops before the first step with one clear message and leaves nothing
    installed; with ``allow_over_budget=True`` it trains as configured with an ERROR line."""
    from hf_memwatch.core.errors import MemWatchConfigError

    def built(watch):
        trainer = Trainer(model=gpt2_model(n_layer=1, n_embd=32, vocab=100), args=training_args(tmp_path, max_steps=1),
                          train_dataset=token_dataset(4, 8, 100))
        trainer.add_callback(watch)
        return trainer

    trainer = built(MemWatch(auto=True, budget="1GiB", report=False, summary=False))
    with pytest.raises(MemWatchConfigError, match="added after the Trainer was built"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert_nothing_left(trainer, tmp_path)
    trainer = built(MemWatch(auto=True, budget="1GiB", allow_over_budget=True, report=False, summary=False))
    with caplog.at_level("ERROR", logger="hf_memwatch"):
        trainer.train()
    assert trainer.state.global_step == 1
    assert any("unplanned" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
