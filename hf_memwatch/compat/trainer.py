"""The transformers internals hf-memwatch relies on (the ``Trainer``, its callbacks, model init),
each with its probe. Verified on transformers 4.57.6 and 5.23.0 (:mod:`hf_memwatch.compat.versions`).

===============================  ==================================  ===============================
private thing (``guards``)        what relies on it                   without it (``off``)
===============================  ==================================  ===============================
``Trainer._train_batch_size``     a plan written into a built         the plan's micro-batch goes to
(read by                          Trainer reaches its dataloader      the arguments only; the run is
``get_train_dataloader``)         (``integration/apply.py``)          told it may not reach the loader
``TensorBoardCallback.tb_writer``  ``memory/*`` scalars under their    the scalars go through the
(made and used by ``on_log``)     exact names (``reporting/sinks``)   callback's own ``on_log``
                                                                      (``train/memory/*``)
``trainer.EvalLoopContainer``     the eval loop's accumulated         outputs are counted as
(the name ``evaluation_loop``     outputs as the ``outputs`` class    ``other``
looks up, ``tensors``/``arrays``)  (``integration/eval_watch.py``)
``masking_utils.is_tracing``,     the estimate's masks taken as on    masks a real run skips may be
``fast_all``,                     the real batch (``estimation/       counted (an over-estimate);
``find_packed_sequence_indices``  trainer_mirror.py``)                off on transformers 4.x
===============================  ==================================  ===============================

``no_init_weights`` moved from ``transformers.modeling_utils`` (4.x) to ``transformers.initialization``
(5.x); :func:`no_init_weights` finds it in either.
"""

from __future__ import annotations

from typing import Any

from .deepspeed import zero_partitions_named
from .probes import Probe, holds


def _reads_train_batch_size() -> bool:
    from transformers import Trainer

    return "_train_batch_size" in Trainer.get_train_dataloader.__code__.co_names


TRAIN_BATCH_SIZE = Probe("transformers", "Trainer._train_batch_size (read by get_train_dataloader)",
                         "writing a plan's micro-batch size into a built Trainer's dataloader",
                         _reads_train_batch_size)


def set_cached_train_batch_size(trainer: Any, size: int) -> bool:
    """Write ``size`` into the Trainer's cached batch size (what ``get_train_dataloader`` and
    ``train()`` read, ``per_device_train_batch_size`` x ``n_gpu``); False when this transformers
    does not cache it as verified (warned once, in ``meta.degraded``)."""
    if not (hasattr(trainer, "_train_batch_size") and holds(TRAIN_BATCH_SIZE)):
        return False
    trainer._train_batch_size = size
    return True


def _tensorboard_writer_used() -> bool:
    from transformers.integrations import TensorBoardCallback

    return all("tb_writer" in f.__code__.co_names for f in (TensorBoardCallback.__init__, TensorBoardCallback.on_log))


TENSORBOARD_WRITER = Probe("transformers", "TensorBoardCallback.tb_writer",
                           "memory/* scalars under their exact names on TensorBoard (they go as train/memory/*)",
                           _tensorboard_writer_used)


def tensorboard_writer(callback: Any) -> Any:
    """The ``SummaryWriter`` a ``TensorBoardCallback`` writes with (made by its ``on_log``), or None."""
    return getattr(callback, "tb_writer", None) if holds(TENSORBOARD_WRITER) else None


def tensorboard_routable() -> bool:
    """Whether the memory scalars may bypass the TensorBoard callback's ``on_log`` (its writer is
    where verified); otherwise they are left to that ``on_log``, prefixed but not lost."""
    return holds(TENSORBOARD_WRITER)


def _wandb_module_kept() -> bool:
    from transformers.integrations import WandbCallback

    return all("_wandb" in f.__code__.co_names for f in (WandbCallback.__init__, WandbCallback.setup))


WANDB_MODULE = Probe("transformers", "WandbCallback._wandb (the wandb module it logs through)",
                     "memory/* in the W&B run's row of the step (they go through the callback's own on_log, "
                     "as train/memory/*)", _wandb_module_kept)


def wandb_run(callback: Any) -> Any:
    """The W&B run a ``WandbCallback`` logs to (``wandb.run`` of the module it holds), or None."""
    return getattr(getattr(callback, "_wandb", None), "run", None) if holds(WANDB_MODULE) else None


def _eval_container_swappable() -> bool:
    from transformers import Trainer
    from transformers import trainer as trainer_module

    base = getattr(trainer_module, "EvalLoopContainer", None)
    return (isinstance(base, type) and "EvalLoopContainer" in Trainer.evaluation_loop.__code__.co_names
            and {"tensors", "arrays"} <= set(base.__init__.__code__.co_names))


EVAL_CONTAINER = Probe("transformers", "transformers.trainer.EvalLoopContainer (tensors, arrays)",
                       "the eval loop's accumulated outputs as the outputs class (counted as other)",
                       _eval_container_swappable)


def eval_container_module() -> Any:
    """``transformers.trainer`` when its ``EvalLoopContainer`` is the name the eval loop builds its
    containers through (so a registering subclass can stand in for the loop), else None."""
    if not holds(EVAL_CONTAINER):
        return None
    from transformers import trainer as trainer_module

    return trainer_module


def _masks_patchable() -> bool:
    from transformers import masking_utils

    return all(callable(getattr(masking_utils, name, None)) for name in MASK_HELPERS)


MASK_HELPERS = ("is_tracing", "fast_all", "find_packed_sequence_indices")
MASKS = Probe("transformers", "masking_utils.is_tracing, fast_all, find_packed_sequence_indices",
              "the estimate's masks as the real batch takes them (masks a real run skips may be counted)",
              _masks_patchable)


def masks_patchable() -> bool:
    """Whether ``masking_utils`` has the helpers ``estimation.trainer_mirror.real_batch_masks``
    answers for fake tensors (transformers 5.x; 4.x has neither ``is_tracing`` nor ``fast_all``)."""
    return holds(MASKS)


def no_init_weights() -> Any:
    """transformers' context that skips weight initialisation (5.x ``initialization``, 4.x ``modeling_utils``)."""
    try:
        from transformers.initialization import no_init_weights as skip
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights as skip
    return skip()


def checkpointing_argument() -> str:
    """The ``TrainingArguments`` field that turns activation checkpointing on: ``activation_checkpointing``
    (5.x; ``gradient_checkpointing`` warns there, to be removed in v6), ``gradient_checkpointing`` (4.x)."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def probe_trainer(trainer: Any) -> list[str]:
    """Run the Trainer's probes (at ``train()``'s start, before the ``meta`` record); the failed
    probes of this process so far (``meta.degraded``)."""
    from .probes import degraded

    holds(TRAIN_BATCH_SIZE)
    holds(EVAL_CONTAINER)
    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", None) or []
    if any(type(c).__name__ == "TensorBoardCallback" for c in callbacks):
        holds(TENSORBOARD_WRITER)
    optimizer = getattr(trainer, "optimizer", None)
    for _ in range(8):  # DeepSpeed's ZeRO optimizer, inside accelerate's and DeepSpeed's wrappers
        if optimizer is None:
            break
        zero_partitions_named(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return degraded()
