"""``integration/apply.py``: a plan written into a built Trainer is the hand-configured run of that plan.

Real ``Trainer.train()`` on a tiny GPT-2 with SGD and clipping (AdamW would hide a gradient scaled
twice): losses and grad norms of the planned run equal, bit for bit, those of the run configured by hand.
"""

from __future__ import annotations

from conftest import gpt2_model, loss_history, token_dataset, training_args
from transformers import Trainer

from hf_memwatch.core.records import PlanRecord
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.integration.apply import apply_eval_plan, apply_plan, enable_checkpointing_now
from hf_memwatch.planning.plan import Plan

RUN = dict(max_steps=2, learning_rate=0.1, max_grad_norm=0.5, logging_steps=1)


def _trainer(tmp_path, name: str, **overrides) -> Trainer:
    args = training_args(tmp_path / name, **{**RUN, **overrides})
    return Trainer(model=gpt2_model(n_layer=2, n_embd=32, vocab=1000), args=args,
                   train_dataset=token_dataset(16, 16, 1000), eval_dataset=token_dataset(8, 16, 1000, seed=1))


def _grad_norms(trainer: Trainer) -> list[float]:
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


def test_a_planned_run_is_the_hand_configured_run_of_its_plan(tmp_path) -> None:
    planned = _trainer(tmp_path, "planned", per_device_train_batch_size=4, optim="adamw_torch")
    changed = apply_plan(planned, Plan(2, 2, True, "sgd"))
    assert changed == ["micro-batch 4 -> 2 x accumulation 2", "activation checkpointing", "optim adamw_torch -> sgd"]
    assert planned._train_batch_size == 2  # the Trainer's cached copy follows the argument
    planned.train()
    hand = _trainer(tmp_path, "hand", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    gradient_checkpointing=True, optim="sgd")
    hand.train()
    assert loss_history(planned) == loss_history(hand) and len(loss_history(hand)) == 2
    assert _grad_norms(planned) == _grad_norms(hand)
    assert type(planned.optimizer.optimizer if hasattr(planned.optimizer, "optimizer") else planned.optimizer).__name__ == "SGD"
    assert planned.model.is_gradient_checkpointing
    # Never accelerate's accumulation: the Trainer divides the loss itself.
    assert planned.accelerator.gradient_accumulation_steps == hand.accelerator.gradient_accumulation_steps == 1


def test_the_run_as_configured_changes_nothing(tmp_path) -> None:
    trainer = _trainer(tmp_path, "same", per_device_train_batch_size=4)
    before = trainer.args.to_dict()
    assert apply_plan(trainer, Plan.of(RunConfig.from_trainer(trainer))) == []
    assert trainer.args.to_dict() == before


def test_a_plan_records_eval_fields_reach_the_arguments(tmp_path) -> None:
    trainer = _trainer(tmp_path, "eval", per_device_eval_batch_size=8)
    plain = PlanRecord(plan=Plan(4, 1, False, "adamw_torch", predicted_peak=1, reason="fits"), budget=2)
    apply_eval_plan(trainer, plain)  # no eval fields: the eval arguments stay the user's
    assert (trainer.args.per_device_eval_batch_size, trainer.args.eval_accumulation_steps) == (8, None)
    apply_eval_plan(trainer, plain.replace(eval_batch_size=2, eval_accumulation_steps=1))
    assert (trainer.args.per_device_eval_batch_size, trainer.args.eval_accumulation_steps) == (2, 1)
    assert len(next(iter(trainer.get_eval_dataloader()))["input_ids"]) == 2  # the batches evaluate() will form


def test_checkpointing_turned_on_between_steps_checkpoints_the_next_step(tmp_path) -> None:
    from transformers import TrainerCallback

    class OnAfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                enable_checkpointing_now(trainer)

    trainer = _trainer(tmp_path, "between", per_device_train_batch_size=4)
    trainer.add_callback(OnAfterFirstStep())
    assert not trainer.model.is_gradient_checkpointing
    trainer.train()
    assert trainer.model.is_gradient_checkpointing
    hand = _trainer(tmp_path, "hand", per_device_train_batch_size=4)
    hand.train()
    assert loss_history(trainer) == loss_history(hand)  # checkpointing recomputes, it changes no figure
