"""TRL's RLOOTrainer under the auto mode (issue 24): the plan fits and is the hand-configured run of its plan.

RLOO generates ``num_generations`` completions per prompt inside its step, scores them with a reward
callable and, with its default ``beta > 0``, a reference model loaded from the policy's folder. With a
budget of 0.9 x the estimate of the run as configured the auto mode plans a smaller micro-batch with
more accumulation (the generation batch kept: ``steps_per_generation`` rises), the run's profiler peak
is within the budget and within 1% of the plan's prediction (less the planner's margin), and losses,
grad norms and the state equal the run configured by hand with the plan's figures (rel 1e-6), RNG
included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import hand_configured, read_records
from test_equivalence import FULL, llama
from test_trl_online import prompts, resident, reward_length, same_training

from hf_memwatch import MemWatch, estimate
from hf_memwatch.planning.predict import ESTIMATE_MARGIN
from hf_memwatch.testing.tokenizers import word_tokenizer
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak

GIVEN = 4  # per_device_train_batch_size as configured, accumulation 1


def rloo(out: Path, callbacks: list[Any], **overrides: Any) -> Any:
    from trl import RLOOConfig, RLOOTrainer

    policy = out / "policy"
    llama().save_pretrained(policy)  # beta > 0: RLOO loads its reference model from the policy's folder
    values = dict(output_dir=str(out), per_device_train_batch_size=GIVEN, num_generations=2, max_completion_length=4,
                  max_steps=2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                  seed=0, dataloader_num_workers=0)
    values.update(overrides)
    return RLOOTrainer(model=str(policy), reward_funcs=[reward_length], args=RLOOConfig(**values),
                       train_dataset=prompts(), processing_class=word_tokenizer(), callbacks=callbacks)


def test_auto_mode_plans_rloo_and_is_the_hand_configured_run(tmp_path: Path) -> None:
    probe = rloo(tmp_path / "probe", [])
    assert probe.ref_model is not None  # the default beta: a reference model the plan must count
    given = estimate(probe).peak_bytes
    budget = int(0.9 * given)  # a number; the truth is the auto run's profiler peak below
    del probe

    auto = rloo(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **FULL)])
    with cpu_memory_profile() as prof:
        auto.train()
    peak = window_peak(prof, resident(auto))
    assert peak <= budget, (peak, budget)
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert plan.get("status") is None and plan["source"] == "predicted", plan
    planned = plan["predicted_peak"] / (1 + ESTIMATE_MARGIN)  # the estimate of the run the plan configures
    assert abs(planned - peak) <= 0.01 * peak, (planned, peak)
    assert (plan["micro_batch_size"], plan["activation_checkpointing"]) != (GIVEN, False)  # a plan was needed
    assert plan["micro_batch_size"] < GIVEN  # a smaller micro-batch: steps_per_generation rises
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] == GIVEN  # effective batch kept
    hand = rloo(tmp_path / "hand", [], **hand_configured(plan))
    assert auto.args.steps_per_generation == hand.args.steps_per_generation
    hand.train()
    assert same_training(auto) == same_training(hand)
    assert len([e for e in auto.state.log_history if "loss" in e]) == 2
