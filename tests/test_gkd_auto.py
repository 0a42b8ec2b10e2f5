"""TRL's GKDTrainer (a teacher model; on-policy generation drawn with ``random.random() <= lmbda`` each
step): estimated as it runs, and planned by the auto mode without moving Python's ``random``.

Planning replays the step, whose on-policy draw takes a number from Python's ``random``; were it not
put back, the planned run would draw other branches than the hand-configured run of its plan (the
issue's step-1 grad norm 0.0029494 against 0.0032047).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from conftest import hand_configured, read_records
from test_equivalence import LIGHT, llama
from test_trl_online import resident, same_training
from transformers import TrainerCallback

from hf_memwatch import MemWatch, estimate
from hf_memwatch.planning.predict import ESTIMATE_MARGIN
from hf_memwatch.testing.tokenizers import word_tokenizer
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak


class RandomAtTrainBegin(TrainerCallback):
    """Python's ``random`` state when the loop starts (after any planning) and each step's draw."""

    def __init__(self) -> None:
        self.state: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.state = random.getstate()


def gkd(out: Path, callbacks: list[Any], layers: int = 2, answer: int = 4, **overrides: Any) -> Any:
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    generator = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 1000, (n,), generator=generator))

    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    data = Dataset.from_list([{"messages": [{"role": "user", "content": words(12)},
                                            {"role": "assistant", "content": words(answer)}]} for _ in range(16)])
    values = dict(output_dir=str(out), per_device_train_batch_size=4, max_new_tokens=4, lmbda=0.5, max_length=64,
                  max_steps=2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                  dataloader_num_workers=0, activation_checkpointing=False)  # TRL's default is on
    values.update(overrides)
    return GKDTrainer(model=llama(layers=layers), teacher_model=llama(seed=1, layers=layers), args=GKDConfig(**values), train_dataset=data,
                      processing_class=tokenizer, callbacks=callbacks)


def test_gkd_estimate_predicts_teacher_and_on_policy_generation(tmp_path: Path) -> None:
    trainer = gkd(tmp_path, [], lmbda=1.0)  # every step generates: the replayed worst case is what runs
    state = random.getstate()
    predicted = estimate(trainer)
    assert random.getstate() == state  # the replay's own draw (random.random() <= lmbda) undone
    assert "teacher_model" in predicted.frozen_models and "generation" in predicted.phase_peaks
    # TRL's fused-LM-head forward patch kept the live model in its closure: the replay ran the live modules
    # and left fake gradients on the live parameters (two micro-steps replayed here, as a plan's are).
    estimate(trainer, micro_batch_size=2, gradient_accumulation_steps=2)
    assert all(p.grad is None for p in trainer.model.parameters())
    with cpu_memory_profile() as prof:
        trainer.train()
    truth = window_peak(prof, resident(trainer))
    assert abs(predicted.peak_bytes - truth) <= 0.005 * truth, (predicted.peak_bytes, truth)


def test_auto_mode_plans_gkd_and_is_the_hand_configured_run(tmp_path: Path) -> None:
    """One-layer student and teacher: the estimates (fake tensors, a cost per operator) are most of the CPU
    time; the plan, its prediction and the hand-configured run do not depend on the depth."""
    budget = int(0.9 * estimate(gkd(tmp_path / "probe", [], layers=1)).peak_bytes)  # a number; the truth is measured below

    seen_auto, seen_hand = RandomAtTrainBegin(), RandomAtTrainBegin()
    auto = gkd(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **LIGHT), seen_auto],
               layers=1)  # light: CPU time
    with cpu_memory_profile() as prof:
        auto.train()
    assert window_peak(prof, resident(auto)) <= budget
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert plan.get("status") != "failed", plan
    assert (plan["micro_batch_size"], plan["activation_checkpointing"]) != (4, False)  # a plan was needed
    hand = gkd(tmp_path / "hand", [seen_hand], layers=1, **hand_configured(plan))
    # The plan's prediction is the estimate of the run it configures (the issue: 10.70 MB planned for 4x2,
    # 16.29 MB estimated for 4x2 configured by hand) times the planner's ESTIMATE_MARGIN (1.5%, docs/auto.md):
    # that margin is the whole gap (measured with 8 new tokens
    # and 0.7 x: 6,171,777 B planned, 6,080,568 B estimated by hand, x1.0150001).
    hand_estimate = estimate(hand).peak_bytes
    assert abs(plan["predicted_peak"] - hand_estimate * (1 + ESTIMATE_MARGIN)) <= 2, (plan["predicted_peak"], hand_estimate)
    hand.train()
    assert seen_auto.state == seen_hand.state  # planning left Python's random as it was
    assert same_training(auto) == same_training(hand)
    assert len([e for e in auto.state.log_history if "loss" in e]) == 2
