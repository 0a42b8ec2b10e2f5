"""hf_memwatch.estimation.request: one frozen request, RunConfig's names, the public keywords in its errors."""

import dataclasses

import pytest

from hf_memwatch.core.errors import MemWatchConfigError
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.estimation.request import EstimateRequest

RUN_SECTION = ("micro_batch_size", "gradient_accumulation_steps", "activation_checkpointing", "optim", "precision",
               "device", "world_size", "shard", "max_grad_norm", "seq_len", "task", "seq2seq_target_len", "eval_batch_size",
               "eval_accumulation_steps", "prediction_loss_only", "predict_with_generate", "generation_max_length",
               "generation_num_beams", "engine")


def test_the_run_settings_carry_run_configs_names_and_defaults():
    run_fields = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    request_fields = [f.name for f in dataclasses.fields(EstimateRequest)]
    assert request_fields[:len(RUN_SECTION)] == list(RUN_SECTION)
    assert set(RUN_SECTION) <= set(run_fields)  # no renaming: every run setting is RunConfig's own name
    resolved = EstimateRequest(micro_batch_size=4, seq_len=64).resolved(None)
    for name in ("gradient_accumulation_steps", "activation_checkpointing", "optim", "precision", "device",
                 "world_size", "shard", "max_grad_norm"):
        assert getattr(resolved, name) == run_fields[name], name
    run = resolved.run_config()
    assert (run.micro_batch_size, run.seq_len, run.effective_batch) == (4, 64, 4)


def test_a_request_is_frozen_and_given_values_win():
    request = EstimateRequest(micro_batch_size=2, precision="bf16", gradient_accumulation_steps=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.micro_batch_size = 8
    resolved = request.resolved(None)
    assert (resolved.precision, resolved.gradient_accumulation_steps) == ("bf16", 3)
    assert resolved.target_len is None and resolved.replace(seq_len=16).target_len == 16


@pytest.mark.parametrize("changes, message", [
    (dict(micro_batch_size=0), "micro_batch_size must be a positive integer; got 0"),
    (dict(gradient_accumulation_steps=-1), "gradient_accumulation_steps must be a positive integer; got -1"),
    (dict(precision="fp8"), "unknown precision 'fp8'"),
    (dict(shard="zero2"), "shard='zero2' needs world_size >= 2"),
    (dict(eval_batch_size=4), "eval_batch_size and eval_samples go together"),
])
def test_validation_names_the_public_keyword(changes, message):
    request = EstimateRequest(**{"micro_batch_size": 2, "seq_len": 8, **changes}).resolved(None)
    with pytest.raises(MemWatchConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        request.validate()


def test_generation_needs_predict_with_generate():
    request = EstimateRequest(generation_max_length=8).resolved(None)
    with pytest.raises(MemWatchConfigError, match="need predict_with_generate"):
        request.generation  # noqa: B018
    assert EstimateRequest(predict_with_generate=True, generation_max_length=8).generation.max_length == 8
