"""hf_memwatch.estimation.layers: when the layer stack is extrapolated in depth, and the line it extends."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2Model, T5Config, T5Model

from hf_memwatch.estimation.layers import SHORT_DEPTHS, extrapolate, homogeneous_layers, truncated


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
