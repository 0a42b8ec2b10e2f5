"""hf_memwatch.estimation.request: one frozen request, RunConfig's names, the public keywords in its errors."""

import dataclasses

import pytest

from hf_memwatch.core.errors import MemWatchConfigError
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.estimation.request import RUN_SETTINGS, EstimateRequest, EstimateSettings


def test_the_request_holds_a_run_config_not_a_copy_of_its_fields():
    run_fields = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    assert [f.name for f in dataclasses.fields(EstimateRequest)] == ["settings", "run", "given", "gpu"]
    assert set(RUN_SETTINGS) <= set(run_fields)  # no renaming: every run setting is RunConfig's own name
    assert not set(RUN_SETTINGS) & {f.name for f in dataclasses.fields(EstimateSettings)}
    resolved = EstimateRequest(micro_batch_size=4, seq_len=64).resolved(None)
    assert isinstance(resolved.run, RunConfig)
    for name in ("gradient_accumulation_steps", "activation_checkpointing", "optim", "precision", "device",
                 "world_size", "shard", "max_grad_norm"):
        assert getattr(resolved, name) == getattr(resolved.run, name) == run_fields[name], name
    run = resolved.run
    assert (run.micro_batch_size, run.seq_len, run.effective_batch) == (4, 64, 4)
    assert not hasattr(resolved, "run_config")


def test_replace_routes_each_keyword_to_its_part():
    request = EstimateRequest(micro_batch_size=2, seq_len=8, budget="1GiB")
    assert request.run is None and dict(request.given) == {"micro_batch_size": 2, "seq_len": 8}
    changed = request.replace(seq_len=16, top_tensors=3, gpu="H100")
    assert (changed.seq_len, changed.settings.top_tensors, changed.gpu, changed.budget) == (16, 3, "H100", "1GiB")
    resolved = changed.resolved(None)
    moved = resolved.replace(micro_batch_size=4, eval_samples=8)
    assert (moved.run.micro_batch_size, moved.settings.eval_samples, moved.run.seq_len) == (4, 8, 16)
    assert resolved.run.micro_batch_size == 2  # frozen: a copy
    with pytest.raises(TypeError, match="not_a_setting"):
        request.replace(not_a_setting=1)


def test_a_request_is_frozen_and_given_values_win():
    request = EstimateRequest(micro_batch_size=2, precision="bf16", gradient_accumulation_steps=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.micro_batch_size = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.resolved(None).run = None
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
    # RunConfig checks its counts when the request is resolved, validate() the rest: one line either way
    with pytest.raises(MemWatchConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EstimateRequest(**{"micro_batch_size": 2, "seq_len": 8, **changes}).resolved(None).validate()


def test_generation_needs_predict_with_generate():
    request = EstimateRequest(micro_batch_size=1, generation_max_length=8).resolved(None)
    with pytest.raises(MemWatchConfigError, match="need predict_with_generate"):
        request.generation  # noqa: B018
    assert EstimateRequest(predict_with_generate=True, generation_max_length=8).generation.max_length == 8
