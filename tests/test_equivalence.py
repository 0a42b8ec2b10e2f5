"""The auto mode changes nothing but the plan: a planned run *is* the hand-configured run of its plan.

What a defect would change is compared, not only what is convenient: per logged step the loss and
the grad norm (a gradient divided twice by the accumulation halves SGD's step and the logged norm,
while AdamW's losses barely move), with ``max_grad_norm`` clipping active, with SGD and AdamW,
plans with accumulation 1, 2 and 4; the Trainer's state after training (log history, tokens seen,
global step) and the RNG states; under TRL's ``SFTTrainer`` its token count and first metrics.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import gpt2_model, hand_configured, read_records, token_dataset, training_args
from transformers import Trainer

from hf_memwatch import MemWatch
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.planning.plan import Plan
from hf_memwatch.planning.planner import plan_for
from hf_memwatch.planning.predict import EstimatorPredictor
from hf_memwatch.testing.tokenizers import word_tokenizer

LIGHT = {"detail": "light", "report": False, "summary": False}
FULL = {"detail": "full", "report": False, "summary": False}  # snapshots split by class
GIVEN = {"per_device_train_batch_size": 8, "activation_checkpointing": True, "max_steps": 3, "max_grad_norm": 0.05,
         "include_num_input_tokens_seen": True}
SEQ = 32


def rng_states() -> tuple[Any, ...]:
    return (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())


def comparable_state(trainer: Trainer) -> dict[str, Any]:
    """``trainer.state`` without memory keys and wall-clock figures."""
    state = trainer.state
    history = [{k: v for k, v in entry.items()
                if not k.startswith("memory/") and not k.endswith(("_runtime", "_per_second"))}
               for entry in state.log_history]
    return {"log_history": history, "global_step": state.global_step, "epoch": state.epoch,
            "num_input_tokens_seen": state.num_input_tokens_seen, "max_steps": state.max_steps,
            "train_batch_size": state.train_batch_size}


def assert_same_training(auto: Trainer, hand: Trainer, steps: int) -> None:
    """The planned run is the hand-configured one: state, and per logged step loss and grad norm (rel 1e-6)."""
    assert comparable_state(auto) == comparable_state(hand)
    logged = [[(e["loss"], e["grad_norm"]) for e in t.state.log_history if "loss" in e] for t in (auto, hand)]
    assert len(logged[0]) == len(logged[1]) == steps
    for (loss_a, norm_a), (loss_h, norm_h) in zip(*logged, strict=True):
        assert loss_a == pytest.approx(loss_h, rel=1e-6) and norm_a == pytest.approx(norm_h, rel=1e-6)


def budget_for_accumulation(optim: str, accumulation: int) -> tuple[int, Plan]:
    """A budget whose plan (chosen by the planner API on the same model) has ``accumulation`` steps."""
    run = RunConfig(8, 1, activation_checkpointing=True, optim=optim, seq_len=SEQ, max_grad_norm=GIVEN["max_grad_norm"])
    model = gpt2_model(n_layer=2, n_embd=64)
    predictor = EstimatorPredictor(model, run)
    for candidate_optim in (optim, "adamw_bnb_8bit"):
        budget = predictor.peak(Plan(8 // accumulation, accumulation, True, candidate_optim))
        chosen = plan_for(model, run, budget).chosen
        if chosen is not None and chosen.gradient_accumulation_steps == accumulation:
            return budget, chosen
    raise AssertionError(f"no budget gives a plan with accumulation {accumulation}")


def cli_plan(tmp_path: Path, capsys: Any, optim: str, budget: int) -> Plan:
    """``hf-memwatch estimate ... --budget B --json``'s plan for the configuration as given."""
    import json

    from hf_memwatch.cli.main import main

    gpt2_model(n_layer=2, n_embd=64).config.save_pretrained(tmp_path / "model")
    status = main(["estimate", str(tmp_path / "model"), "--micro-batch-size", "8", "--seq-len", str(SEQ), "--activation-checkpointing",
                   "--optim", optim, "--budget", str(budget), "--json"])
    assert status == 0
    return Plan.from_dict(json.loads(capsys.readouterr().out)["plan"])


def train(out: Path, callbacks: list[Any], **overrides: Any) -> tuple[Trainer, tuple[Any, ...]]:
    model = gpt2_model(n_layer=2, n_embd=64)
    trainer = Trainer(model=model, args=training_args(out, **{**GIVEN, **overrides}),
                      train_dataset=token_dataset(64, SEQ, 1000), callbacks=callbacks)
    trainer.train()
    return trainer, rng_states()


# SGD (scale-sensitive: a gradient divided twice halves its step and its logged norm) at every
# accumulation; AdamW (the common optimizer, where 8-bit AdamW is a candidate) at one.
@pytest.mark.parametrize(("optim", "accumulation"), [("sgd", 1), ("sgd", 2), ("sgd", 4), ("adamw_torch", 2)])
def test_planned_run_is_the_hand_configured_run(tmp_path: Path, capsys: Any, optim: str, accumulation: int) -> None:
    budget, expected = budget_for_accumulation(optim, accumulation)
    if optim == "adamw_torch":  # the command line plans what the planner API (and the auto mode) plans
        expected = cli_plan(tmp_path, capsys, optim, budget)
    auto, auto_rng = train(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **LIGHT)], optim=optim)
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    # The CLI/planner API and the auto mode agree on the same configuration and budget.
    assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"], plan["activation_checkpointing"],
            plan["optim"]) == expected.key()
    assert plan["gradient_accumulation_steps"] == accumulation
    if optim == "sgd":
        assert plan["optim"] == "sgd"  # never replaced by 8-bit AdamW

    hand, hand_rng = train(tmp_path / "hand", [], **hand_configured(plan, leave=("activation_checkpointing",)))
    logged = [(e["loss"], e["grad_norm"]) for t in (auto, hand) for e in t.state.log_history if "loss" in e]
    half = len(logged) // 2
    assert half == 3
    for (loss_a, norm_a), (loss_h, norm_h) in zip(logged[:half], logged[half:]):
        assert loss_a == pytest.approx(loss_h, rel=1e-6) and norm_a == pytest.approx(norm_h, rel=1e-6)
    assert all(norm > GIVEN["max_grad_norm"] for _, norm in logged)  # clipping was active
    assert comparable_state(auto) == comparable_state(hand)
    for a, h in zip(auto_rng, hand_rng):
        assert (torch.equal(a, h) if isinstance(a, torch.Tensor) else a == h)
    assert auto.accelerator.gradient_accumulation_steps == 1  # the Trainer divides the loss itself


# -- TRL ----------------------------------------------------------------------------------------
def llama(seed: int = 0, layers: int = 2) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=1002, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=1000, eos_token_id=1001))


def sft_dataset(rows: int = 64, length: int = 40) -> Any:
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    return Dataset.from_list([{"input_ids": torch.randint(0, 1000, (length,), generator=generator).tolist()}
                              for _ in range(rows)])


def sft(out: Path, callbacks: list[Any], *, lora: bool = False, **overrides: Any) -> Any:
    from trl import SFTConfig, SFTTrainer

    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    values = dict(output_dir=str(out), per_device_train_batch_size=8, max_steps=2, logging_steps=1, report_to=[],
                  save_strategy="no", use_cpu=True, max_length=64, disable_tqdm=True, dataloader_num_workers=0,
                  seed=0)
    values.update(overrides)
    return SFTTrainer(model=llama(), args=SFTConfig(**values), train_dataset=sft_dataset(),
                      processing_class=word_tokenizer(), peft_config=peft_config, callbacks=callbacks)


def test_sft_planned_run_keeps_token_counts_and_metrics(tmp_path: Path) -> None:
    probe = sft(tmp_path / "probe", [])
    given_peak = EstimatorPredictor(probe, RunConfig.from_trainer(probe)).estimate(
        Plan(8, 1, False, "adamw_torch_fused")).peak_bytes
    auto = sft(tmp_path / "auto", [MemWatch(auto=True, budget=int(0.8 * given_peak), **LIGHT)])
    auto.train()
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] == 8 and plan["micro_batch_size"] < 8 \
        or plan["activation_checkpointing"] or plan["optim"] != "adamw_torch_fused"
    hand = sft(tmp_path / "hand", [], **hand_configured(plan))
    hand.train()
    assert comparable_state(auto) == comparable_state(hand)
    first = [next(e for e in t.state.log_history if "loss" in e) for t in (auto, hand)]
    for key in ("num_tokens", "entropy", "mean_token_accuracy", "loss", "grad_norm"):
        assert first[0][key] == pytest.approx(first[1][key], rel=1e-6), key

