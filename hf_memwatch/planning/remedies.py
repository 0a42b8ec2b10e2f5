"""Remedies the auto mode can apply to a live ``Trainer`` — and whether each is available.

Three remedies, alone or combined (see :class:`Plan`):

* gradient accumulation: a smaller micro-batch with proportionally more accumulation steps, the
  effective batch (micro-batch × accumulation × world size) preserved exactly;
* activation checkpointing (``activation_checkpointing_enable``; ``use_cache`` off);
* bitsandbytes 8-bit AdamW (``adamw_bnb_8bit``; ``paged_adamw_8bit`` on CUDA).

:func:`apply_plan` writes a plan into the Trainer *before* ``train()`` builds its dataloader,
optimizer and scheduler, so the run is the one a user would get by configuring the plan by hand.
:func:`enable_checkpointing_now` is the one remedy that can also be applied between two steps.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.units import format_bytes

logger = logging.getLogger("hf_memwatch")

# Optimizers that 8-bit AdamW replaces without changing the algorithm (same update rule, states
# quantised). Anything else (SGD, Adafactor, ...) is left alone: swapping it would change training.
ADAMW_NAMES = frozenset({"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused", "adamw_torch_xla"})
EIGHT_BIT_NAMES = frozenset({"adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit"})


@dataclass
class Plan:
    """One training configuration of the auto mode, with what it is predicted to need.

    ``relative_throughput`` is samples per second relative to the configuration as given (1.0).
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    activation_checkpointing: bool
    optim: str
    predicted_peak: int | None = None
    relative_throughput: float = 1.0
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def key(self) -> tuple[int, int, bool, str]:
        return (self.micro_batch_size, self.gradient_accumulation_steps, self.activation_checkpointing, self.optim)

    def record(self, budget: int) -> dict[str, Any]:
        """The ``plan`` event of the timeline contract."""
        return {
            "event": "plan",
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "activation_checkpointing": self.activation_checkpointing,
            "optim": self.optim,
            "predicted_peak": int(self.predicted_peak or 0),
            "budget": int(budget),
            "reason": self.reason,
        }

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("extra", None)
        return data

    def describe(self) -> str:
        parts = [f"micro-batch {self.micro_batch_size} x accumulation {self.gradient_accumulation_steps}"]
        parts.append("activation checkpointing" if self.activation_checkpointing else "no checkpointing")
        parts.append(f"optim {self.optim}")
        if self.predicted_peak is not None:
            parts.append(f"predicted peak {format_bytes(self.predicted_peak)}")
        return ", ".join(parts)


# -- what the live run is configured with --------------------------------------------------------
def optim_name(args: Any) -> str:
    """``args.optim`` as its string name (``TrainingArguments`` turns it into an enum)."""
    value = args.optim
    return str(getattr(value, "value", value))


def checkpointing_enabled(trainer: Any) -> bool:
    """Whether the Trainer will train with activation checkpointing (argument or model already set)."""
    args = trainer.args
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        return True
    model = trainer.model
    return bool(
        getattr(model, "is_activation_checkpointing", False) or getattr(model, "is_gradient_checkpointing", False)
    )


def current_plan(trainer: Any) -> Plan:
    """The configuration as the user gave it, as a :class:`Plan`."""
    args = trainer.args
    return Plan(
        micro_batch_size=int(args.per_device_train_batch_size),
        gradient_accumulation_steps=int(args.gradient_accumulation_steps),
        activation_checkpointing=checkpointing_enabled(trainer),
        optim=optim_name(args),
    )


# -- availability --------------------------------------------------------------------------------
def bitsandbytes_installed() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def eight_bit_optim_name(device_type: str) -> str:
    """``paged_adamw_8bit`` on CUDA (paging absorbs spikes), ``adamw_bnb_8bit`` elsewhere."""
    return "paged_adamw_8bit" if device_type == "cuda" else "adamw_bnb_8bit"


def eight_bit_unavailable_reason(trainer: Any) -> str | None:
    """Why 8-bit AdamW cannot replace this run's optimizer, or None when it can."""
    if getattr(trainer, "optimizer", None) is not None or getattr(trainer, "optimizer_cls_and_kwargs", None):
        return "a custom optimizer was handed to the Trainer"
    name = optim_name(trainer.args)
    if name in EIGHT_BIT_NAMES:
        return None
    if name not in ADAMW_NAMES:
        return f"optim={name!r} is not AdamW, and replacing it would change the training algorithm"
    if not bitsandbytes_installed():
        return "bitsandbytes is not installed (pip install bitsandbytes)"
    return None


def checkpointing_unavailable_reason(model: Any) -> str | None:
    """Why activation checkpointing cannot be enabled on ``model``, or None when it can."""
    if not (hasattr(model, "activation_checkpointing_enable") or hasattr(model, "gradient_checkpointing_enable")):
        return f"{type(model).__name__} has no activation_checkpointing_enable()"
    if hasattr(model, "supports_gradient_checkpointing") and not model.supports_gradient_checkpointing:
        return f"{type(model).__name__} does not support activation checkpointing"
    return None


# -- applying ------------------------------------------------------------------------------------
def apply_plan(trainer: Any, plan: Plan) -> None:
    """Write ``plan`` into a Trainer whose ``train()`` has not built its loop yet.

    Every cached copy is updated: ``args.per_device_train_batch_size`` and the Trainer's
    ``_train_batch_size`` (the dataloader's batch size), ``args.gradient_accumulation_steps`` and
    accelerate's copy in its gradient state, ``args.optim`` (read by ``create_optimizer``), and
    ``args.activation_checkpointing`` (read at the top of ``train()``).
    """
    from transformers.training_args import OptimizerNames

    args = trainer.args
    args.per_device_train_batch_size = plan.micro_batch_size
    trainer._train_batch_size = args.train_batch_size  # micro-batch × n_gpu (DataParallel)
    args.gradient_accumulation_steps = plan.gradient_accumulation_steps
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        accelerator.gradient_accumulation_steps = plan.gradient_accumulation_steps
    if plan.optim != optim_name(args):
        args.optim = OptimizerNames(plan.optim)
    if plan.activation_checkpointing and not checkpointing_enabled(trainer):
        if hasattr(args, "activation_checkpointing"):
            args.activation_checkpointing = True
        else:  # transformers 4.x
            args.gradient_checkpointing = True
        _disable_cache(trainer.model)


def enable_checkpointing_now(model: Any) -> None:
    """Turn on activation checkpointing on a model that is already training (between two steps)."""
    target = getattr(model, "module", model)  # DDP / accelerate wrappers
    if hasattr(target, "activation_checkpointing_enable"):
        target.activation_checkpointing_enable()
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _disable_cache(target)


def _disable_cache(model: Any) -> None:
    """A KV cache is useless in training and fights checkpointing's recompute."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", None):
        config.use_cache = False
