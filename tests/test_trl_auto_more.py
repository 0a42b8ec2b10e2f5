"""The TRL trainers whose estimate tests/test_trl_trainers.py checks, under the auto mode (issue 24, point 1).

RewardTrainer, CPO, ORPO, TPO, GMPO (generation with a reward model) and DistillationTrainer (a
teacher, on-policy generation), each built by that file's ``build`` on a tiny model. With a budget of
0.9 x the estimate of the run as configured (4 x 1, no checkpointing) the auto mode plans another
configuration; the run's profiler peak (the run with MemWatch, PyTorch's CPU memory events) is within
the budget, the plan keeps the effective batch (micro-batch x accumulation), the plan record says it
was predicted, and losses, grad norms and the state equal the run configured by hand with the plan's
figures (rel 1e-6).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import read_records
from test_equivalence import FULL
from test_trl_online import resident, same_training
from test_trl_trainers import build

from hf_memwatch import MemWatch, estimate
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak

GIVEN = 4  # per_device_train_batch_size as configured (test_trl_trainers.common), accumulation 1
KINDS = ("reward", "cpo", "orpo", "tpo", "gmpo", "distillation")


def planned_from(out: Path) -> dict[str, Any]:
    [plan] = [r for r in read_records(out) if r["event"] == "plan"]
    return plan


@pytest.mark.parametrize("kind", KINDS)
def test_auto_mode_plans_the_trainer_and_is_the_hand_configured_run(kind: str, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        budget = int(0.9 * estimate(build(kind, tmp_path / "probe")).peak_bytes)  # a number; truth measured below
        auto = build(kind, tmp_path / "auto", callbacks=[MemWatch(auto=True, budget=budget, **FULL)])
        with cpu_memory_profile() as prof:
            auto.train()
        peak = window_peak(prof, resident(auto))
        plan = planned_from(tmp_path / "auto")
        print(kind, budget, peak, {k: plan.get(k) for k in ("micro_batch_size", "gradient_accumulation_steps",
                                                              "activation_checkpointing", "optim", "source")})
        assert peak <= budget, (kind, peak, budget)
        assert plan.get("status") is None and plan["source"] == "predicted", plan
        assert (plan["micro_batch_size"], plan["activation_checkpointing"], plan["optim"]) != \
            (GIVEN, False, "adamw_torch"), plan  # a plan was needed
        assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] == GIVEN, plan  # effective batch kept
        hand = build(kind, tmp_path / "hand", per_device_train_batch_size=plan["micro_batch_size"],
                     gradient_accumulation_steps=plan["gradient_accumulation_steps"], optim=plan["optim"],
                     activation_checkpointing=plan["activation_checkpointing"])
        hand.train()
    assert same_training(auto) == same_training(hand)
    assert len([e for e in auto.state.log_history if "loss" in e]) == 2
