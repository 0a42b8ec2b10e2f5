"""``integration/eval_watch.py``: the evaluation loop's wrappers, its output containers, decoding steps.

Real ``Trainer.evaluation_loop`` / ``prediction_step`` on a tiny GPT-2, wrapped as the patches wrap
them, with a watcher that records what it is handed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import gpt2_model, token_dataset, training_args
from transformers import DynamicCache, Trainer
from transformers import trainer as trainer_module

from hf_memwatch.integration.eval_watch import (
    container_tensors,
    decoding_step,
    held_tensors,
    loop_stage,
    wrap_evaluation_loop,
    wrap_prediction_step,
)


class RecordingWatcher:
    """The three calls the wrappers make, with what the loop's containers held at each."""

    def __init__(self) -> None:
        self.stages: list[str] = []
        self.containers: list[Any] = []
        self.held_at_forward: list[int] = []
        self.ended: list[tuple[Any, BaseException | None, int]] = []

    def eval_loop_begin(self, stage: str, containers: list[Any]) -> None:
        self.stages.append(stage)
        self.containers = containers

    def eval_forward_done(self) -> None:
        self.held_at_forward.append(sum(t.numel() * t.element_size() for t in container_tensors(self.containers)))

    def eval_loop_end(self, output: Any, error: BaseException | None) -> None:
        self.ended.append((output, error, len(self.containers)))


def _trainer(tmp_path, **overrides) -> Trainer:
    args = training_args(tmp_path, per_device_eval_batch_size=4, **overrides)
    return Trainer(model=gpt2_model(n_layer=1, n_embd=32, vocab=1000), args=args,
                   eval_dataset=token_dataset(12, 16, 1000, seed=1))


def _wrap(trainer: Trainer, watcher: RecordingWatcher):
    """The two wrappers as the patches install them (the loop calls ``self.prediction_step``)."""
    trainer.__dict__["prediction_step"] = wrap_prediction_step(trainer.prediction_step, watcher)
    return wrap_evaluation_loop(trainer.evaluation_loop, watcher)


def test_the_loop_hands_its_containers_and_outputs_to_the_watcher_and_keeps_none(tmp_path) -> None:
    trainer = _trainer(tmp_path)
    watcher = RecordingWatcher()
    loop = _wrap(trainer, watcher)
    original_class = trainer_module.EvalLoopContainer
    try:
        output = loop(trainer.get_eval_dataloader(), "Evaluation")
    finally:
        del trainer.__dict__["prediction_step"]
    assert watcher.stages == ["eval"]
    assert len(watcher.held_at_forward) == 3  # 12 samples, eval batch 4: one call per batch
    # The containers grow batch by batch: each forward sees the earlier batches' logits held.
    logits_per_batch = 4 * 16 * 1000 * 4
    assert watcher.held_at_forward[1] - watcher.held_at_forward[0] >= logits_per_batch
    [(handed, error, left)] = watcher.ended
    assert handed is output and error is None
    assert left == 0 and watcher.containers == []  # released before the end was reported
    assert trainer_module.EvalLoopContainer is original_class  # the registering subclass is gone
    held = sum(t.numel() * t.element_size() for t in held_tensors((output.predictions, output.label_ids)))
    assert held >= output.predictions.nbytes + output.label_ids.nbytes


def test_an_error_inside_the_loop_reaches_the_watcher_and_propagates(tmp_path) -> None:
    trainer = _trainer(tmp_path)
    trainer.eval_dataset.rows[5] = {"input_ids": torch.full((16,), 5000), "labels": torch.full((16,), 5000)}  # > vocab
    watcher = RecordingWatcher()
    loop = _wrap(trainer, watcher)
    original_class = trainer_module.EvalLoopContainer
    try:
        with pytest.raises(IndexError) as raised:
            loop(trainer.get_eval_dataloader(), "Prediction")
    finally:
        del trainer.__dict__["prediction_step"]
    assert watcher.stages == ["predict"]
    [(handed, error, left)] = watcher.ended
    assert handed is None and error is raised.value  # the same exception object reaches the user
    assert left == 4  # at the failure the post-mortem still sees the loop's four containers ...
    assert watcher.containers == []  # ... released as the error propagates
    assert trainer_module.EvalLoopContainer is original_class


def test_decoding_steps_are_told_from_the_first_forward_by_the_cache() -> None:
    model = gpt2_model(n_layer=1, n_embd=32, vocab=1000).eval()
    ids = torch.randint(0, 1000, (2, 8))
    cache = DynamicCache()
    assert not decoding_step({"input_ids": ids, "past_key_values": cache})  # prefill: the batch's length
    assert not decoding_step({"input_ids": ids})
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert decoding_step({"input_ids": ids[:, -1:], "past_key_values": cache})  # one new token per call


def test_loop_stage_names_the_trainers_loops() -> None:
    assert loop_stage("Prediction") == "predict"
    assert loop_stage("Evaluation") == "eval"
