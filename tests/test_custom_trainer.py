"""A user's own ``Trainer`` subclass (issue 24, point 3): its ``compute_loss`` and ``_prepare_inputs`` replayed.

The subclass below masks a share of the input tokens in ``_prepare_inputs`` (a new tensor per
micro-batch, drawn from torch's RNG) and adds a penalty on the hidden states to the LM loss in
``compute_loss`` (every layer's hidden states kept: more activations than the plain step). The
estimate replays that code — within 0.5% of the profiler's peak of the run without MemWatch, while
the plain step's figure (the same model and batch in a plain ``Trainer``) is further off than that —
and the auto mode plans it from that prediction (``source: "predicted"``), fits the budget and is
the hand-configured run of its plan. A step the replay cannot run: ``test_measured_fallback.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpt2_model, hand_configured, read_records, token_dataset, training_args
from test_equivalence import FULL, assert_same_training
from transformers import Trainer

from hf_memwatch import MemWatch, estimate
from hf_memwatch.testing.trainers import masking_trainer
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak

MaskingTrainer = masking_trainer()  # its own _prepare_inputs and compute_loss


def resident(model: torch.nn.Module) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def build(out: Path, callbacks: list[Any], cls: type = MaskingTrainer, **args: Any) -> Trainer:
    values = {"per_device_train_batch_size": 8, "max_steps": 2, "optim": "sgd", "learning_rate": 0.1, **args}
    return cls(model=gpt2_model(n_layer=2, n_embd=64), args=training_args(out, **values),
               train_dataset=token_dataset(n=16, seq_len=64, vocab=1000), callbacks=callbacks)


@pytest.fixture(scope="module")
def given(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """The subclass as configured: its estimate, the plain step's, and the profiler's peak (built and run once)."""
    out = tmp_path_factory.mktemp("given")
    trainer = build(out, [])
    state = torch.get_rng_state()
    predicted = estimate(trainer).peak_bytes
    rng_kept = torch.equal(torch.get_rng_state(), state)
    plain = estimate(build(out / "plain", [], cls=Trainer)).peak_bytes
    with cpu_memory_profile() as prof:
        trainer.train()
    return {"predicted": predicted, "plain": plain, "truth": window_peak(prof, resident(trainer.model)),
            "rng_kept": rng_kept}


def test_custom_compute_loss_and_prepare_inputs_are_predicted(given: dict[str, int]) -> None:
    predicted, plain, truth = given["predicted"], given["plain"], given["truth"]
    assert given["rng_kept"]
    assert abs(predicted - truth) <= 0.005 * truth, (predicted, truth)
    assert abs(plain - truth) > 0.005 * truth, (plain, truth)  # the user's step is not the plain one


def test_auto_mode_plans_the_custom_trainer_from_its_replay(given: dict[str, int], tmp_path: Path) -> None:
    budget = int(0.7 * given["truth"])  # 0.7 x the profiler's peak of the run as configured, without MemWatch
    auto = build(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **FULL)])
    with cpu_memory_profile() as prof:
        auto.train()
    assert window_peak(prof, resident(auto.model)) <= budget
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert plan["source"] == "predicted" and plan.get("status") is None, plan
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] == 8
    hand = build(tmp_path / "hand", [], **hand_configured(plan, leave=("optim",)))
    hand.train()
    assert_same_training(auto, hand, steps=2)
