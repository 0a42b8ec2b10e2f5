"""``RunConfig``: what a training run is configured with, as far as memory planning is concerned.

This is the only place that reads ``TrainingArguments`` and the live model's state for planning:
the auto mode, ``hf-memwatch estimate --budget``, the planner API and the OOM post-mortem all build a
:class:`RunConfig` (from a Trainer with :meth:`RunConfig.from_trainer`, or from plain values) and
hand it to the one planning core (:mod:`hf_memwatch.planning.chooser`).

Example:
    >>> run = RunConfig(micro_batch_size=16, gradient_accumulation_steps=2, seq_len=512)
    >>> run.effective_batch
    32
    >>> run.estimate_kwargs()["precision"]
    'fp32'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..engines.engine import Engine, engine_of, own_checkpointing
from .errors import MemWatchConfigError
from .renamed import accepts_renamed, renamed_keywords


@accepts_renamed({"checkpointing": "activation_checkpointing"})
@dataclass(frozen=True)
class RunConfig:
    """One run's memory-relevant configuration (per device).

    ``activation_checkpointing`` is whether the run trains with activation checkpointing, from the arguments
    *or* the model (a model whose checkpointing was switched on directly counts). ``device`` is a
    device type (``cpu``, ``cuda``, ...). ``custom_optimizer`` marks an optimizer handed to the
    Trainer (no optimizer remedy may replace it); ``checkpointing_unavailable`` says why the model
    cannot checkpoint (None when it can).
    """

    micro_batch_size: int
    gradient_accumulation_steps: int = 1
    activation_checkpointing: bool = False
    optim: str = "adamw_torch"
    precision: str = "fp32"
    device: str = "cpu"
    world_size: int = 1
    shard: str = "none"
    max_grad_norm: float = 1.0
    seq_len: int | None = None
    task: str | None = None
    seq2seq_target_len: int | None = None
    custom_optimizer: bool = False
    checkpointing_unavailable: str | None = None
    eval_batch_size: int | None = None
    eval_accumulation_steps: int | None = None
    prediction_loss_only: bool = False
    auto_find_batch_size: bool = False
    max_length: int | None = None  # samples truncated to it (TRL's max_length), None: not truncated by the run
    group_by_length: bool = False
    padding_free: bool | None = None  # None: as the collator says
    packing: bool = False
    # Seq2SeqTrainingArguments' generation-based prediction (plain TrainingArguments: off)
    predict_with_generate: bool = False
    generation_max_length: int | None = None
    generation_num_beams: int | None = None
    # TRL preference trainers (DPO): the config's precompute_ref_log_probs; None: no such option
    precompute_ref_log_probs: bool | None = None
    peft_model: bool = False  # the trained model is a PEFT model (adapters trained, base frozen)
    # why the trainer fixed something from the micro-batch at __init__ (None: nothing): no plan changes it
    micro_batch_fixed: str | None = None
    # share of the predicted peak the optimizer states take (None: not predicted yet)
    optimizer_state_share: float | None = None
    # the engine as accelerate builds it (engines/engine.py); None: given by plain values (world_size, shard)
    engine: Engine | None = None

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "gradient_accumulation_steps", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise MemWatchConfigError(f"{name} must be a positive integer; got {value!r}")
        if self.seq_len is not None and (isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int)
                                         or self.seq_len <= 0):
            raise MemWatchConfigError(f"seq_len must be a positive integer; got {self.seq_len!r}")

    @property
    def effective_batch(self) -> int:
        """Per-device samples per optimizer step (kept exactly by every plan)."""
        return self.micro_batch_size * self.gradient_accumulation_steps

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **renamed_keywords("RunConfig.replace", changes,
                                                            {"checkpointing": "activation_checkpointing"}))

    def estimate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`hf_memwatch.estimate` for this configuration (no ``seq_len``
        when unknown)."""
        kwargs: dict[str, Any] = dict(
            micro_batch_size=self.micro_batch_size, gradient_accumulation_steps=self.gradient_accumulation_steps,
            activation_checkpointing=self.activation_checkpointing, optim=self.optim, precision=self.precision,
            device="cuda" if self.device == "cuda" else "cpu", world_size=self.world_size, shard=self.shard,
            max_grad_norm=self.max_grad_norm, task=self.task, seq2seq_target_len=self.seq2seq_target_len,
        )
        if self.seq_len is not None:
            kwargs["seq_len"] = self.seq_len
        if self.engine is not None and self.engine.own_buffers:
            kwargs["engine"] = self.engine
        return kwargs

    # -- from a live Trainer ----------------------------------------------------------------
    @classmethod
    def from_args(cls, args: Any, model: Any = None, seq_len: int | None = None, accelerator: Any = None) -> RunConfig:
        """The configuration ``TrainingArguments`` ``args`` (and ``model``'s state, when given) describe;
        the engine is ``accelerator``'s when given (what ``prepare()`` will build), else the arguments'."""
        engine = engine_of(args, accelerator, model)
        return cls(
            micro_batch_size=int(args.per_device_train_batch_size),
            gradient_accumulation_steps=int(args.gradient_accumulation_steps),
            activation_checkpointing=checkpointing_requested(args) or model_is_checkpointing(model)
            or own_checkpointing(args, engine),
            optim=optim_name(args),
            precision=precision_of(args),
            device=torch.device(args.device).type,
            world_size=max(1, int(getattr(args, "world_size", 1) or 1)),
            shard=engine.shard,
            max_grad_norm=float(getattr(args, "max_grad_norm", 0.0) or 0.0),
            seq_len=seq_len,
            checkpointing_unavailable=None if model is None else checkpointing_unavailable_reason(model),
            eval_batch_size=int(args.per_device_eval_batch_size),
            eval_accumulation_steps=getattr(args, "eval_accumulation_steps", None),
            prediction_loss_only=bool(getattr(args, "prediction_loss_only", False)),
            auto_find_batch_size=bool(getattr(args, "auto_find_batch_size", False)),
            max_length=_positive_int(getattr(args, "max_length", None) or getattr(args, "max_seq_length", None)),
            group_by_length=bool(getattr(args, "group_by_length", False))  # transformers 4.x; 5.x: the strategy
            or str(getattr(getattr(args, "train_sampling_strategy", None), "value",
                           getattr(args, "train_sampling_strategy", None))) == "group_by_length",
            padding_free=getattr(args, "padding_free", None),
            packing=bool(getattr(args, "packing", False)),
            predict_with_generate=bool(getattr(args, "predict_with_generate", False)),
            generation_max_length=_positive_int(getattr(args, "generation_max_length", None)),
            generation_num_beams=_positive_int(getattr(args, "generation_num_beams", None)),
            precompute_ref_log_probs=_optional_bool(getattr(args, "precompute_ref_log_probs", None)),
            peft_model=is_peft_model(model),
            engine=engine,
        )

    @classmethod
    def from_trainer(cls, trainer: Any, seq_len: int | None = None) -> RunConfig:
        """The configuration ``trainer`` will train with (arguments + the live model's state)."""
        run = cls.from_args(trainer.args, trainer.model, seq_len, getattr(trainer, "accelerator", None))
        custom = getattr(trainer, "optimizer", None) is not None or getattr(trainer, "optimizer_cls_and_kwargs", None)
        return run.replace(custom_optimizer=bool(custom), micro_batch_fixed=micro_batch_fixed_reason(trainer))


def micro_batch_fixed_reason(trainer: Any) -> str | None:
    """Why ``trainer`` fixed part of its training from ``per_device_train_batch_size`` at ``__init__``
    (None: it reads the micro-batch only when ``train()`` builds the loop), so that another micro-batch
    would train something else than the run as configured.

    TRL's KTOTrainer with a KL term pairs each prompt with the completion of its neighbour within
    dataset batches of ``per_device_train_batch_size`` (``KL_completion_ids``, mapped at ``__init__``):
    with micro-batch 2 instead of 4 the KL estimate is made from other pairs (measured on a tiny Llama,
    tests/test_kto_auto.py: step-1 grad norm 1.1859783 at 2 x 2 against 1.1860000 at 4 x 1).
    """
    if getattr(trainer, "calculate_KL", False) and any(c.__name__ == "KTOTrainer" for c in type(trainer).__mro__):
        return (f"{type(trainer).__name__} paired its KL completions within batches of per_device_train_batch_size="
                f"{trainer.args.per_device_train_batch_size} when it was built: another micro-batch would change the "
                "KL term it trains on")
    return None


# -- readers (one definition each) -----------------------------------------------------------
def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _optional_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` (or the model inside a DDP wrapper) is a PEFT model (its ``peft_config`` dict)."""
    target = getattr(model, "module", model)
    return isinstance(getattr(target, "peft_config", None), dict)


def optim_name(args: Any) -> str:
    """``args.optim`` as its string name (``TrainingArguments`` turns it into an enum)."""
    value = args.optim
    return str(getattr(value, "value", value))


def precision_of(args: Any) -> str:
    """``bf16``, ``fp16`` or ``fp32``: the mixed precision the Trainer trains in."""
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"


def checkpointing_requested(args: Any) -> bool:
    """Whether the arguments ask for activation checkpointing (5.x name, then the 4.x alias)."""
    return bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))


def model_is_checkpointing(model: Any) -> bool:
    """Whether ``model`` (or the model inside a DDP/PEFT wrapper) has activation checkpointing on.

    Reads the layers' own ``gradient_checkpointing`` flags, as transformers' property does, without
    the deprecated ``is_gradient_checkpointing`` (which warns).
    """
    target = getattr(model, "module", model)
    if not isinstance(target, torch.nn.Module):
        return False
    return any(getattr(module, "gradient_checkpointing", False) is True for module in target.modules())


def checkpointing_unavailable_reason(model: Any) -> str | None:
    """Why activation checkpointing cannot be enabled on ``model``, or None when it can."""
    target = getattr(model, "module", model)
    if not (hasattr(target, "activation_checkpointing_enable") or hasattr(target, "gradient_checkpointing_enable")):
        return f"{type(target).__name__} has no activation_checkpointing_enable()"
    if hasattr(target, "supports_gradient_checkpointing") and not target.supports_gradient_checkpointing:
        return f"{type(target).__name__} does not support activation checkpointing"
    return None


def shard_of(args: Any) -> str:
    """``zero1``/``zero2``/``zero3`` under DeepSpeed, ``fsdp`` under FSDP, else ``none``: the engine
    the arguments select by accelerate's rules (``fsdp=`` on CPU ranks is DDP; see ``engines/engine.py``)."""
    return engine_of(args).shard
