"""``estimation/trainer_mirror``: what the Trainer and accelerate do around a forward, checked against the real
Trainer, accelerate and transformers objects (no mocks): each change the replay makes, and its undo."""

from __future__ import annotations

import torch
from conftest import bert_model, gpt2_model, training_args
from transformers import Trainer

from hf_memwatch.core.run_config import model_is_checkpointing
from hf_memwatch.estimation.trainer_mirror import (
    accepts_loss_kwargs,
    disable_checkpointing,
    disable_kv_cache,
    enable_checkpointing,
    make_batch,
    packed_rows,
    padded_rows,
    restore_forward,
    restore_kv_cache,
    wrap_autocast,
)


def test_the_batch_default_data_collator_hands_each_task() -> None:
    config = gpt2_model(n_layer=1, n_embd=32).config
    lm = make_batch(config, "causal-lm", 3, 16, 5, "cpu")
    assert (lm["input_ids"].shape, lm["labels"].shape) == ((3, 16), (3, 16))
    assert make_batch(config, "seq2seq", 3, 16, 5, "cpu")["labels"].shape == (3, 5)  # the target length
    classes = make_batch(bert_model(num_layers=1).config, "seq-cls", 3, 16, 5, "cpu")["labels"]
    assert classes.shape == (3,) and int(classes.max()) < 2  # one class of num_labels per sample


def test_num_items_in_batch_goes_where_the_trainer_sends_it(tmp_path) -> None:
    for model in (gpt2_model(n_layer=1, n_embd=32), bert_model(num_layers=1)):
        trainer = Trainer(model=model, args=training_args(tmp_path))
        assert accepts_loss_kwargs(model) == trainer.model_accepts_loss_kwargs


def test_checkpointing_is_enabled_as_train_does_and_undone() -> None:
    model = gpt2_model(n_layer=2, n_embd=32)
    assert enable_checkpointing(model) is True and model_is_checkpointing(model)
    assert enable_checkpointing(model) is False  # a model that checkpoints already is left as it is
    disable_checkpointing(model)
    assert not model_is_checkpointing(model)


def test_the_kv_cache_and_the_autocast_wrapper_come_off_again() -> None:
    model = gpt2_model(n_layer=1, n_embd=32)
    model.config.use_cache = True
    previous = disable_kv_cache(model)
    assert (previous, model.config.use_cache) == (True, False)
    restore_kv_cache(model, previous)
    assert model.config.use_cache is True
    ids = torch.randint(0, 1000, (1, 8))
    wrap_autocast(model, "cpu", "bf16")  # accelerate's native AMP: autocast inside, fp32 outputs
    assert model(input_ids=ids).logits.dtype == torch.float32 and "forward" in vars(model)
    restore_forward(model, None)
    assert "forward" not in vars(model)  # the class's own forward again


def test_padded_and_packed_rows_are_read_off_a_real_batch() -> None:
    assert padded_rows({"attention_mask": torch.tensor([[1, 1, 0]])})
    assert not padded_rows({"attention_mask": torch.ones(2, 3, dtype=torch.long)}) and not padded_rows(None)
    assert packed_rows({"position_ids": torch.tensor([[0, 1, 2, 0, 1]])})  # two sequences in one row
    assert not packed_rows({"position_ids": torch.arange(5).unsqueeze(0)})
