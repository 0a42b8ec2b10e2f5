"""hf_memwatch.estimation.layers: when the layer stack is extrapolated in depth, and the line it extends."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2Model, T5Config, T5Model

from hf_memwatch.estimation.layers import (
    SHORT_DEPTHS,
    extrapolate,
    extrapolate_backward,
    homogeneous_layers,
    truncated,
)


def _gpt2(layers: int) -> tuple[GPT2Model, GPT2Config]:
    config = GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return GPT2Model(config), config


def test_a_stack_of_identical_layers_is_found_and_a_shallow_one_is_not() -> None:
    model, config = _gpt2(6)
    assert homogeneous_layers(model, config) is model.h
    shallow, shallow_config = _gpt2(max(SHORT_DEPTHS))  # nothing to extrapolate to
    assert homogeneous_layers(shallow, shallow_config) is None


def test_a_layer_that_differs_or_two_stacks_leave_the_full_replay() -> None:
    model, config = _gpt2(6)
    model.h[4].mlp.c_fc.weight.requires_grad_(False)  # one layer frozen: not the same layer as the others
    assert homogeneous_layers(model, config) is None
    t5_config = T5Config(num_layers=6, num_decoder_layers=6, d_model=32, d_kv=8, d_ff=64, num_heads=2, vocab_size=64)
    assert homogeneous_layers(T5Model(t5_config), t5_config) is None  # an encoder and a decoder stack of 6


def test_truncated_keeps_the_first_layers_and_puts_every_one_back() -> None:
    model, config = _gpt2(6)
    layers = list(model.h)
    with truncated(model.h, config, 2):
        assert list(model.h) == layers[:2] and config.num_hidden_layers == 2
        out = model(torch.zeros(1, 4, dtype=torch.long)).last_hidden_state
    assert list(model.h) == layers and config.num_hidden_layers == 6 and out.shape == (1, 4, 32)


def test_the_line_through_two_depths_is_exact_for_an_affine_class_and_refused_when_phases_differ() -> None:
    short = {2: {"after_forward": {"activations": 2 * 300 + 50, "weights": 2 * 1000 + 400}},
             3: {"after_forward": {"activations": 3 * 300 + 50, "weights": 3 * 1000 + 400}}}
    assert extrapolate(short, 12) == {"after_forward": {"activations": 12 * 300 + 50, "weights": 12 * 1000 + 400}}
    assert extrapolate({2: {"a": {"w": 1}}, 3: {"b": {"w": 2}}}, 12) is None


def test_a_checkpointed_backward_is_refused_unless_split_at_every_layer_from_the_top_down() -> None:
    def run(depth: int, order=None) -> list:
        layers = list(range(depth - 1, -1, -1)) if order is None else order
        return [[("head", {"a": 10 * depth})] + [(k, {"a": 10 * depth + 3 * (depth - 1 - k)}) for k in layers]]

    assert extrapolate_backward({3: run(3), 4: run(4)}, 10) == {"a": 127}  # the bottom's line: 100 + 9 x 3
    assert extrapolate_backward({3: None, 4: run(4)}, 10) is None  # never split (no recomputation seen)
    assert extrapolate_backward({3: run(3), 4: run(4, [3, 1, 2, 0])}, 10) is None  # not from the top down
    assert extrapolate_backward({3: run(3), 4: run(4) * 2}, 10) is None  # a backward more at one depth


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("rows", [(1, 128), (8, 64)])
def test_a_checkpointed_run_extrapolated_per_window_equals_every_layer_replayed(rows, reentrant, monkeypatch,
                                                                              tmp_path) -> None:
    """A Llama-shaped Trainer, 8 layers, checkpointing: 3 and 4 layers replayed, the backward split where each
    layer's recomputation begins, equal to the full replay in every phase and class. At 1 x 128 the gradients
    outgrow the checkpointed inputs (the high is in the bottom layer's window), at 8 x 64 not. The windows
    seen are the start, then each layer from the top down."""
    import sys

    from conftest import token_dataset, training_args
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    from hf_memwatch import estimate

    module = sys.modules["hf_memwatch.estimation.depth"]
    seen = []

    def spy(short, depth):
        seen.append({d: [[label for label, _ in run] for run in runs] for d, runs in short.items()})
        return extrapolate_backward(short, depth)

    monkeypatch.setattr(module, "extrapolate_backward", spy)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1024))
    micro_batch, seq_len = rows
    args = training_args(tmp_path, per_device_train_batch_size=micro_batch, activation_checkpointing=True,
                         activation_checkpointing_kwargs={"use_reentrant": reentrant}, optim="sgd")
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(16, seq_len, 1024))
    short = estimate(trainer, extrapolate_layers=True)
    full = estimate(trainer, extrapolate_layers=False)
    assert any("per recomputed layer" in note for note in short.notes), short.notes
    assert seen == [{3: [["head", 2, 1, 0]], 4: [["head", 3, 2, 1, 0]]}]
    assert short.phase_peaks == full.phase_peaks and short.classes == full.classes
