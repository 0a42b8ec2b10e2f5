"""Writing a plan into a live Trainer — the only place that changes a Trainer's configuration.

:func:`apply_plan` runs before ``train()`` builds its dataloader, optimizer and scheduler, and
writes exactly what a user configuring the plan by hand would have written: the training
arguments (``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``optim``,
``activation_checkpointing``) and the Trainer's cached batch size. Never accelerate's gradient
accumulation: the Trainer keeps accelerate at 1 and divides the loss itself, so setting it there
would divide the gradients twice.
"""

from __future__ import annotations

from typing import Any

from ..compat.trainer import set_cached_train_batch_size
from ..core.records import PlanRecord
from ..core.run_config import RunConfig, checkpointing_requested, model_is_checkpointing, optim_name
from ..engines.engine import own_checkpointing
from ..estimation.trl_replay import batches_generation, steps_per_generation
from ..planning.plan import Plan


def apply_plan(trainer: Any, plan: Plan) -> list[str]:
    """Write ``plan`` into a Trainer whose ``train()`` has not built its loop yet; what changed, in words."""
    from transformers.training_args import OptimizerNames

    args = trainer.args
    changed = plan.changes_from(RunConfig.from_trainer(trainer))
    args.per_device_train_batch_size = plan.micro_batch_size
    set_cached_train_batch_size(trainer, args.train_batch_size)  # the Trainer's cached copy (micro-batch x n_gpu)
    args.gradient_accumulation_steps = plan.gradient_accumulation_steps
    if batches_generation(trainer):
        # GRPO, RLOO: the generation batch is kept, so a smaller micro-batch generates once every more
        # micro-steps — as GRPOConfig/RLOOConfig derive it for a user who writes the plan by hand.
        args.steps_per_generation = steps_per_generation(trainer, plan.micro_batch_size)
    if plan.optim != optim_name(args):
        args.optim = OptimizerNames(plan.optim)
    if plan.activation_checkpointing and not (checkpointing_requested(args) or model_is_checkpointing(trainer.model)
                                              or own_checkpointing(args)):  # FSDP's own: not both (transformers refuses)
        # train() switches it on from the argument, as for a user who set it
        if hasattr(args, "activation_checkpointing"):
            args.activation_checkpointing = True
        else:  # transformers 4.x
            args.gradient_checkpointing = True
    return changed


def enable_checkpointing_now(trainer: Any) -> None:
    """Turn on activation checkpointing in a model that is already training (between two steps),
    with the run's own checkpointing arguments, as ``train()`` would have at its start."""
    args = trainer.args
    target = getattr(trainer.model, "module", trainer.model)  # DDP / accelerate wrappers
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None)
                  or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    layout = {}
    if (every := kwargs.pop("every_n_layers", 1)) != 1:
        layout["every_n_layers"] = every  # the layers the run checkpoints, as train() would
    if kwargs.pop("offload", False):
        layout["offload"] = True
    kwargs.setdefault("use_reentrant", False)  # works with frozen inputs (PEFT) too
    if hasattr(target, "activation_checkpointing_enable"):
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **layout)
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **layout)


def apply_eval_plan(trainer: Any, record: PlanRecord) -> None:
    """Write a plan record's evaluation fields (when it has them) into the arguments, as a user would."""
    if record.eval_batch_size is None:
        return
    args = trainer.args
    args.per_device_eval_batch_size = int(record.eval_batch_size)
    if record.eval_accumulation_steps is not None:
        args.eval_accumulation_steps = int(record.eval_accumulation_steps)
