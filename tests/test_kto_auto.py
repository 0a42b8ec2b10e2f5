"""Micro-batch-dependent trainers (issue 24, point 3): KTO pairs its KL completions at ``__init__``.

TRL's KTOTrainer rotates the completions within dataset batches of ``per_device_train_batch_size``
when it is built, so a plan with another micro-batch would train on other KL pairs than the
hand-configured run of that plan. The accumulation remedy is not offered for it (the log and the
plan say why); the plan it gets is the hand-configured run of its plan, grad norms rel 1e-6.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import read_records
from test_equivalence import FULL, assert_same_training

from hf_memwatch import MemWatch, PlanError, estimate
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.planning.catalogue import ACCUMULATION
from hf_memwatch.testing.tokenizers import word_tokenizer


def llama(seed: int = 0) -> Any:
    """A tiny Llama whose activations (not its logits) dominate a step: checkpointing matters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=1002, hidden_size=64, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=1000, eos_token_id=1001))


def kto(out: Path, callbacks: list[Any], **overrides: Any) -> Any:
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    generator = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 1000, (n,), generator=generator))

    data = Dataset.from_list([{"prompt": words(24), "completion": words(24), "label": bool(i % 2)} for i in range(8)])
    values = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=2, logging_steps=1, report_to=[],
                  save_strategy="no", use_cpu=True, disable_tqdm=True, max_length=64, seed=0, dataloader_num_workers=0,
                  optim="sgd", learning_rate=0.1, activation_checkpointing=False)  # TRL defaults it on
    values.update(overrides)
    return KTOTrainer(model=llama(), ref_model=llama(seed=1), args=KTOConfig(**values), train_dataset=data,
                      processing_class=word_tokenizer(), callbacks=callbacks)


def grad_norms(trainer: Any) -> list[float]:
    return [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]


def test_kto_micro_batch_is_fixed_and_the_planned_run_is_the_hand_configured_one(tmp_path: Path, caplog: Any) -> None:
    probe = kto(tmp_path / "probe", [])
    run = RunConfig.from_trainer(probe)
    assert run.micro_batch_fixed and "KL" in run.micro_batch_fixed
    assert ACCUMULATION.options(run) == [4]
    given = estimate(probe).peak_bytes
    checkpointed = estimate(probe, activation_checkpointing=True).peak_bytes
    assert checkpointed < given
    budget = (given + checkpointed) // 2
    del probe

    auto = kto(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **FULL)])
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        auto.train()
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"], plan["activation_checkpointing"]) == (4, 1, True)
    assert "paired its KL completions" in plan["reason"] and "paired its KL completions" in caplog.text

    hand = kto(tmp_path / "hand", [], activation_checkpointing=True)
    hand.train()
    assert_same_training(auto, hand, steps=2)

    # The defect the rule guards: by hand, micro-batch 2 x accumulation 2 trains on other KL pairs.
    other = kto(tmp_path / "other", [], per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1)
    other.train()
    plain = kto(tmp_path / "plain", [], max_steps=1)
    plain.train()
    assert grad_norms(other)[0] != pytest.approx(grad_norms(plain)[0], rel=1e-6)


def test_kto_below_the_checkpointed_peak_stops_and_says_why(tmp_path: Path) -> None:
    probe = kto(tmp_path / "probe", [])
    budget = int(0.97 * estimate(probe, activation_checkpointing=True).peak_bytes)  # only a smaller micro-batch would fit
    del probe
    trainer = kto(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **FULL)])
    with pytest.raises(PlanError, match="paired its KL completions"):
        trainer.train()
    assert trainer.state.global_step == 0
