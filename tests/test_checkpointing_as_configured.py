"""Checkpointing as configured (issue 24, point 4): the replay checkpoints exactly what the run does.

Partial checkpointing (``every_n_layers``, a subset of layers switched on in the model),
``use_reentrant`` true and false: ``estimate(trainer)`` against the profiler's peak of the same
``train()`` — never below it by more than 1%, and a partial layout is not estimated as full.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import gpt2_model, token_dataset, training_args
from transformers import Trainer

from hf_memwatch import estimate
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak

LAYERS = 4


def model_bytes(model: Any) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def trainer(out: Path, subset: bool = False, **args: Any) -> Trainer:
    model = gpt2_model(n_layer=LAYERS, n_embd=128)
    if subset:  # the user's own layout: checkpointing on the first layer only, set on the model
        model.activation_checkpointing_enable()
        for block in model.transformer.h[1:]:
            block.gradient_checkpointing = False
    return Trainer(model=model, args=training_args(out, per_device_train_batch_size=4, max_steps=2, **args),
                   train_dataset=token_dataset(n=8, seq_len=96, vocab=1000))


def truth(run: Trainer) -> int:
    baseline = model_bytes(run.model)
    with cpu_memory_profile() as prof:
        run.train()
    return window_peak(prof, baseline)


CASES = {
    "every 2nd layer": {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"every_n_layers": 2}},
    "use_reentrant=True": {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": True}},
    "use_reentrant=False": {"activation_checkpointing": True,
                            "activation_checkpointing_kwargs": {"use_reentrant": False}},
    "subset set on the model": {"subset": True},
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_replay_checkpoints_what_the_run_checkpoints(tmp_path: Path, case: str) -> None:
    run = trainer(tmp_path, **CASES[case])
    predicted = estimate(run).peak_bytes
    measured = truth(run)
    assert predicted >= 0.99 * measured, (case, predicted, measured)
    assert predicted <= 1.03 * measured, (case, predicted, measured)
    if CASES[case].get("subset") or "every_n_layers" in str(CASES[case]):
        full = estimate(trainer(tmp_path / "full", activation_checkpointing=True)).peak_bytes
        assert full < predicted  # a partial layout keeps more activations than full checkpointing


def test_a_checkpointed_run_is_extrapolated_per_recomputed_layer_and_equals_every_layer_replayed():
    """Under checkpointing the line through 2 and 3 replayed layers is not exact (issue 37's sweep: 6 of 68
    checkpointed draws off the full replay, -184,576 B to +4,137,796 B; this BERT was within 0.1%, not to
    the byte): 3 and 4 layers are replayed with the backward split where each layer's recomputation begins
    (layers.extrapolate_backward), equal to every layer replayed in each phase and class."""
    from transformers import BertConfig

    from hf_memwatch import estimate

    config = BertConfig(num_hidden_layers=8, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                        vocab_size=500, architectures=["BertForSequenceClassification"])
    kwargs = dict(task="seq-cls", micro_batch_size=4, seq_len=64, activation_checkpointing=True)
    asked = estimate(config, extrapolate_layers=True, **kwargs)
    assert any("per recomputed layer" in note for note in asked.notes), asked.notes
    full = estimate(config, extrapolate_layers=False, **kwargs)
    assert not any("depth extrapolated" in note for note in full.notes)
    assert asked.phase_peaks == full.phase_peaks and asked.classes == full.classes
    assert any("per recomputed layer" in note for note in estimate(config, **kwargs).notes)  # 8 layers: taken
    plain = estimate(config, **{**kwargs, "activation_checkpointing": False})
    assert any("depth extrapolated" in note for note in plain.notes)  # without checkpointing: the shortcut
