"""An adapted model built at the depth the replays keep gives every figure of the full build (issue 36).

``estimation/short_model.py``: a LoRA on a base built from a config is adapted and made fake at 4 layers where
every layer gets the same adapter, standing for the configured depth; the full build is made only where
every layer must be replayed. Each estimate here is compared, every figure, with the planning shortcuts off
(``memo.shortcuts(False)``: the whole depth built, as before).
"""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig

from hf_memwatch import estimate
from hf_memwatch.estimation import memo
from hf_memwatch.estimation.fake_model import count_params
from hf_memwatch.estimation.peft import LoraSpec
from hf_memwatch.estimation.short_model import BUILT_LAYERS, ShortModel, fake_model_at_depth, index_free

pytest.importorskip("peft")

NOT_FIGURES = ("seconds", "cpu_seconds")


def figures(estimated) -> dict:
    return {k: v for k, v in dataclasses.asdict(estimated).items() if k not in NOT_FIGURES}


def llama(layers: int = 8) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512, pad_token_id=0)


def both_paths(config, **kwargs):
    """(shortcuts off, on) estimates of the same run, and the short model the shortcut built (None: none)."""
    with memo.shortcuts(False):
        old = estimate(config, **kwargs)
    with memo.sharing() as cache:
        new = estimate(config, **kwargs)
    (_, built, _), = cache.values()
    return old, new, built[4]


ALL_LINEAR = LoraSpec(r=4, targets="all-linear")
CASES = {
    "cuda bf16": dict(lora=ALL_LINEAR, precision="bf16", device="cuda"),
    "cuda bf16 checkpointed": dict(lora=ALL_LINEAR, precision="bf16", device="cuda", activation_checkpointing=True),
    "cpu fp32 default targets, dropout": dict(lora=LoraSpec(r=8, dropout=0.1), device="cpu"),
    "named targets, accumulation": dict(lora=LoraSpec(r=4, targets=("q_proj", "v_proj")), device="cuda",
                                        precision="fp16", gradient_accumulation_steps=2),
    "sequence classification": dict(lora=ALL_LINEAR, task="seq-cls", device="cpu"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_short_model_gives_every_figure_of_the_full_build(name):
    old, new, short = both_paths(llama(), micro_batch_size=2, seq_len=64, **CASES[name])
    assert isinstance(short, ShortModel) and len(short.stack) == BUILT_LAYERS and short.depth == 8
    assert short.built_full is None  # extrapolated from the short model alone
    assert figures(new) == figures(old)
    assert (new.params, new.trainable_params) == count_params(short.full())


def test_where_the_line_is_not_exact_every_layer_is_replayed_on_the_full_build(monkeypatch):
    """The line through the short depths refused (as ``layers.extrapolate`` does where the backward's high
    moves): the estimate is the full build's every-layer replay, as the old path's."""
    from hf_memwatch.estimation import depth

    monkeypatch.setattr(depth, "extrapolate", lambda *args, **kwargs: None)
    old, new, short = both_paths(llama(), micro_batch_size=2, seq_len=64, lora=ALL_LINEAR, device="cuda",
                                 precision="bf16")
    assert isinstance(short, ShortModel) and short.built_full is not None
    assert any(note.startswith("every layer replayed") for note in new.notes)
    assert figures(new) == figures(old)


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_base_is_built_short_too(bits, checkpointed):
    """QLoRA: quantized and adapted after the cut, then copied (``fake_copy``): the stack is found again in the
    copy (one kept from before the copy counted 383,040 parameters against 309,312, and cut nothing)."""
    pytest.importorskip("bitsandbytes")
    from hf_memwatch.estimation.quantized import QuantSpec

    quant = QuantSpec(bits=4, quant_type="nf4", double_quant=True, compute_dtype="bf16") if bits == 4 else \
        QuantSpec(bits=8)
    old, new, short = both_paths(llama(), micro_batch_size=2, seq_len=64, lora=ALL_LINEAR, device="cuda",
                                 precision="bf16", quantization=quant, activation_checkpointing=checkpointed)
    assert isinstance(short, ShortModel) and short.built_full is None
    assert any(short.stack is module for module in short.model.modules())  # the copy's own stack
    assert figures(new) == figures(old)
    assert (new.params, new.trainable_params) == count_params(short.full())


@pytest.mark.parametrize(("layers", "kwargs"), [
    (8, dict(extrapolate_layers=False)),  # every layer replayed: the full build
    (6, dict(activation_checkpointing=True)),  # a checkpointed run is extrapolated from 8 layers on
    (8, dict(eval_batch_size=2, eval_samples=4)),  # the eval loop replays every layer
])
def test_where_every_layer_is_replayed_the_full_build_is(layers, kwargs):
    old, new, short = both_paths(llama(layers), micro_batch_size=2, seq_len=64, lora=ALL_LINEAR, device="cuda",
                                 precision="bf16", **kwargs)
    assert isinstance(short, ShortModel) and short.built_full is not None
    assert figures(new) == figures(old)


def test_an_engine_gets_the_full_build():
    old, new, short = both_paths(llama(), micro_batch_size=2, seq_len=64, lora=ALL_LINEAR, device="cuda",
                                 precision="bf16", world_size=4, shard="zero3")
    assert short.built_full is not None and figures(new) == figures(old)


def test_an_adapter_that_differs_by_layer_is_built_at_full_depth(tmp_path):
    """A saved adapter on layers 0 and 1 only: the stack is not homogeneous, every layer replayed. Built at 4
    layers it would be extrapolated from the adapted ones (what ``index_free`` guards)."""
    from peft import LoraConfig

    adapter = tmp_path / "adapter"
    LoraConfig(r=4, target_modules=["q_proj", "v_proj"], layers_to_transform=[0, 1], task_type="CAUSAL_LM"
               ).save_pretrained(adapter)
    old, new, short = both_paths(llama(), micro_batch_size=2, seq_len=64, adapter=adapter, device="cuda",
                                 precision="bf16")
    assert short is None and figures(new) == figures(old)
    assert not any(note.startswith("depth extrapolated") for note in new.notes)
    # the same folder without the layer list is built short
    LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM").save_pretrained(adapter)
    old, new, short = both_paths(llama(), micro_batch_size=2, seq_len=64, adapter=adapter, device="cuda",
                                 precision="bf16")
    assert isinstance(short, ShortModel) and figures(new) == figures(old)


def test_index_free_refuses_every_per_layer_field():
    from peft import LoraConfig

    assert index_free(LoraConfig(r=4, target_modules="all-linear"))
    assert index_free(LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["score"]))
    assert index_free(LoraConfig(r=4))  # PEFT's default targets for the architecture
    for refused in (dict(target_modules=["q_proj"], layers_to_transform=[0]),
                    dict(target_modules=["q_proj"], rank_pattern={"layers.0.": 8}),
                    dict(target_modules=["q_proj"], alpha_pattern={"q_proj": 8}),
                    dict(target_modules=["q_proj"], exclude_modules=["layers.0.self_attn.q_proj"]),
                    dict(target_modules=r".*layers\.0\..*q_proj"),  # a string: a regular expression
                    dict(target_modules=["layers.0.self_attn.q_proj"])):  # a dotted name: one layer's
        assert not index_free(LoraConfig(r=4, **refused)), refused


def test_a_built_module_is_copied_whole_and_a_config_built_short():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_memwatch.estimation.fake_model import auto_class

    module = auto_class("causal-lm").from_config(llama())
    *_, short = fake_model_at_depth(module, None, FakeTensorMode(allow_non_fake_inputs=True), ALL_LINEAR)
    assert short is None
    *_, short = fake_model_at_depth(llama(), None, FakeTensorMode(allow_non_fake_inputs=True), ALL_LINEAR)
    assert isinstance(short, ShortModel)
