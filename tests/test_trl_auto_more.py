"""The TRL trainers whose estimate tests/test_trl_trainers.py checks, under the auto mode (issue 24, point 1).

RewardTrainer, TPO, GMPO (generation with a reward model) and DistillationTrainer (a teacher,
on-policy generation), each built by that file's ``build`` on a tiny model (4 x 1 as configured).
CPO and ORPO are not run here: under the auto mode they take TPO's path (the Trainer's sampler, a
padding collator of preference pairs, a step the estimator replays; their estimates are checked in
test_trl_trainers.py), so they added ~30 CPU s and no code path. The auto run is watched in light
detail: what is guarded — fits, the effective batch, the hand-configured run — does not read the
full tracker, which only cost CPU time here. The budget lies between the estimates of micro-batch 4 and micro-batch 1 x accumulation 4
with checkpointing and 8-bit AdamW (x the planner's margin), so only a plan with a smaller micro-batch
and more accumulation fits: the path where a trainer that forms its batches its own way (GMPO's
generation batch, DistillationTrainer's micro x accumulation prompts) would train something else. The
auto run's profiler peak (PyTorch's CPU memory events) is within the budget, the plan keeps the
effective batch, the plan record says it was predicted, and losses, grad norms and the state equal the
run configured by hand with the plan's figures (rel 1e-6).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import hand_configured, read_records
from test_equivalence import LIGHT
from test_trl_online import resident, same_training
from test_trl_trainers import build

from hf_memwatch import MemWatch, estimate
from hf_memwatch.planning.predict import ESTIMATE_MARGIN
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak

GIVEN = 4  # per_device_train_batch_size as configured (test_trl_trainers.common), accumulation 1
KINDS = ("reward", "tpo", "gmpo", "distillation")
SHORT = {"gmpo": {"max_completion_length": 2}, "distillation": {"max_completion_length": 2}}  # CPU time of the file


def planned_from(out: Path) -> dict[str, Any]:
    [plan] = [r for r in read_records(out) if r["event"] == "plan"]
    return plan


@pytest.fixture
def one_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``build``'s Llamas (policy, teacher) with one decoder layer: the estimates (fake tensors, a cost per
    operator) are most of this file's CPU time, and what is guarded here — the plan, the batches the trainer
    forms, the hand-configured run — does not depend on the depth. RewardTrainer keeps its 2-layer
    classifier: with one layer, after the other auto test files in one process, its profiler peak was
    2,234,712 B over a budget of 2,229,184 B (alone it fitted)."""
    import test_trl_trainers
    from test_equivalence import llama

    monkeypatch.setattr(test_trl_trainers, "llama", lambda seed=0: llama(seed, layers=1))


@pytest.mark.parametrize("kind", KINDS)
def test_auto_mode_plans_the_trainer_and_is_the_hand_configured_run(kind: str, tmp_path: Path, one_layer: None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = build(kind, tmp_path / "probe", **SHORT.get(kind, {}))
        smallest = dict(activation_checkpointing=True, optim="adamw_bnb_8bit")  # every remedy but the micro-batch
        at_given = estimate(probe, **smallest).peak_bytes
        at_one = estimate(probe, micro_batch_size=1, gradient_accumulation_steps=GIVEN, **smallest).peak_bytes
        assert at_one < at_given
        # Between the two as the planner predicts them (x its margin): only a smaller micro-batch fits.
        budget = int((at_one + 0.4 * (at_given - at_one)) * (1 + ESTIMATE_MARGIN))  # the truth is measured below
        del probe
        auto = build(kind, tmp_path / "auto", callbacks=[MemWatch(auto=True, budget=budget, **LIGHT)],
                     **SHORT.get(kind, {}))
        with cpu_memory_profile() as prof:
            auto.train()
        peak = window_peak(prof, resident(auto))
        plan = planned_from(tmp_path / "auto")
        assert peak <= budget, (kind, peak, budget)
        assert plan.get("status") is None and plan["source"] == "predicted", plan
        assert plan["micro_batch_size"] < GIVEN, plan  # a plan was needed: a smaller micro-batch
        assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] == GIVEN, plan  # effective batch kept
        hand = build(kind, tmp_path / "hand", **hand_configured(plan), **SHORT.get(kind, {}))
        hand.train()
    assert same_training(auto) == same_training(hand)
    assert len([e for e in auto.state.log_history if "loss" in e]) == 2
