"""``estimation/replay.py``: the one replay frame of the training step, the eval loop and generation."""

from __future__ import annotations

import pytest
from conftest import gpt2_model

from hf_memwatch.estimation.replay import (
    EVALUATION,
    GENERATION,
    TRAINING,
    mode_of,
    model_in_mode,
    new_tracker,
)
from hf_memwatch.estimation.request import EstimateRequest


def test_the_model_is_in_the_modes_state_inside_and_as_it_was_after_even_on_an_error() -> None:
    model = gpt2_model(n_layer=1, n_embd=32)
    model.eval()
    model.config.use_cache = True
    request = EstimateRequest(precision="bf16")
    with pytest.raises(RuntimeError, match="inside"), model_in_mode(model, request, TRAINING):
        assert model.training and model.config.use_cache is False
        assert "forward" in model.__dict__  # accelerate's autocast wrapper, as under mixed precision
        raise RuntimeError("inside")
    assert not model.training and model.config.use_cache is True and "forward" not in model.__dict__
    with model_in_mode(model, EstimateRequest(precision="fp32"), EVALUATION, use_cache=False):
        assert not model.training and model.config.use_cache is False and "forward" not in model.__dict__
    assert model.config.use_cache is True


def test_generation_is_the_eval_loops_mode_where_the_trainer_generates() -> None:
    assert mode_of(EstimateRequest()) is EVALUATION
    assert mode_of(EstimateRequest(predict_with_generate=True, generation_max_length=8)) is GENERATION
    # prediction_loss_only: the Trainer takes the plain prediction step even with predict_with_generate
    assert mode_of(EstimateRequest(predict_with_generate=True, prediction_loss_only=True)) is EVALUATION


def test_a_cuda_target_rounds_every_storage_to_the_allocators_blocks() -> None:
    assert new_tracker(EstimateRequest(device="cuda")).round_to == 512
    assert new_tracker(EstimateRequest(device="cpu")).round_to == 1
