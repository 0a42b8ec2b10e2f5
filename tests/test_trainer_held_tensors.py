"""What the Trainer holds between tracked steps is counted from the step's first snapshot (issue 23).

Before ``on_step_begin`` the Trainer makes, outside the CPU tracker's window, the step's loss
divisor (``num_items_in_batch``, returned by ``get_batch_samples`` with the micro-batches) and,
once per ``train()``, its running loss (``_tr_loss``). PyTorch's CPU allocator counts both: the
profiler's ``[memory]`` events are the truth here, read at the very instants MemWatch snapshots
(a profiler range opened by a callback placed just before MemWatch). Without them, the step-begin
snapshots of this run read 8 B (step 1) and 4 B (step 2) under the truth.

``after_forward`` is left out: the Python numbers of ``0.5 * x`` and the like become 8-byte tensors
inside the operator call, which autograd saves for backward and no dispatch mode sees returned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import Trainer, TrainerCallback

from hf_memwatch import MemWatch
from hf_memwatch.testing.truth import cpu_memory_deltas, cpu_memory_profile

MARK = "test.memwatch_instant"


class Instants(TrainerCallback):
    """Marks, in the profiler's timeline, the events at which MemWatch snapshots (it runs just before)."""

    def __init__(self) -> None:
        self.phases: list[tuple[int, str]] = []

    def _mark(self, state: Any, phase: str) -> None:
        with torch.profiler.record_function(MARK):
            self.phases.append((state.global_step + (phase != "step_end"), phase))  # step_end: after +1

    def on_step_begin(self, args, state, control, **kwargs):
        self._mark(state, "step_begin")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._mark(state, "after_optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        self._mark(state, "step_end")


def test_step_begin_snapshots_count_what_the_trainer_fetched_and_keeps(tmp_path: Path) -> None:
    model = gpt2_model(n_embd=64)
    weights = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                   for t in list(model.parameters()) + list(model.buffers())}.values())
    instants = Instants()
    args = training_args(tmp_path, per_device_train_batch_size=2, max_steps=2, gradient_accumulation_steps=2,
                         logging_steps=10_000)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(8, 32, 1000),
                      callbacks=[instants, MemWatch(detail="full", report=False, summary=False)])
    with cpu_memory_profile() as prof:
        trainer.train()
    marks = sorted(e.start_ns() for e in prof.profiler.kineto_results.events() if e.name() == MARK)
    deltas = cpu_memory_deltas(prof)
    truth, running, index = [], weights, 0
    for mark in marks:
        while index < len(deltas) and deltas[index][0] < mark:
            running += deltas[index][1]
            index += 1
        truth.append(running)
    snaps = {(r["step"], r["phase"]): r["allocated"] for r in read_records(tmp_path) if r["event"] == "snapshot"}
    measured = [snaps[instant] for instant in instants.phases]
    assert len(marks) == len(instants.phases) == 6
    assert measured == truth, list(zip(instants.phases, measured, truth))
    assert "get_batch_samples" not in vars(trainer)  # the Trainer's own method again after train()
