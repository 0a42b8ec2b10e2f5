"""Replaying a built Trainer's own step on fake tensors, leaving no trace in the Trainer.

:func:`hf_memwatch.estimate` given a ``Trainer`` runs that Trainer's ``training_step`` —
``compute_loss`` with every subclass override (TRL's SFT and DPO losses, their metrics), the
Trainer's own ``num_items_in_batch`` count and loss scaling — on a fake copy of its model, with
batches its own collator forms from its own dataset. Three things make that safe:

* :class:`TrainerStateGuard` restores every plain-data attribute of the Trainer (counters such as
  TRL's ``_total_train_tokens``, metric lists) and its ``state`` afterwards, in place;
* values read back from fake tensors (``.item()``, ``if tensor:``) answer 1 — metrics code runs its
  operators (their memory counts) but nothing depends on the answer (see
  :class:`~hf_memwatch.estimation.fake_dispatch.EstimateTracker`);
* the dataset is read by index only (map-style); a one-pass iterable dataset is never iterated:
  the step is then replayed on synthetic batches at the longest length the run allows, and the
  estimate says so (:mod:`hf_memwatch.estimation.worst_batch` picks the batch).
"""

from __future__ import annotations

import copy
import random
import sys
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from ..compat.trainer_methods import (
    collator_without_unused_columns,
    replace_prepare_input,
    without_unused_columns,
)
from ..core.sequence_length import sequence_length
from ..core.units import format_bytes
from ..engines.engine import engine_backward_detached
from ..measure.attribution import weight_storages
from ..measure.held_models import held_models
from .fake_dispatch import CUDA_BLOCK

SCAN_ITEMS = 4096  # map-style datasets: items whose lengths are compared for the worst case


def is_trainer(value: Any) -> bool:
    """Whether ``value`` is a ``transformers.Trainer`` (subclasses included).

    Imports nothing: a Trainer instance exists only once ``transformers.trainer`` has been imported,
    and importing it for the check alone costs ~2.5 s of CPU (it pulls in peft, bitsandbytes and
    ``torch._inductor``) on a request that is a config or a model.
    """
    module = sys.modules.get("transformers.trainer")
    return module is not None and isinstance(value, module.Trainer)


# -- no trace ------------------------------------------------------------------------------------
_PLAIN_LEAVES = (int, float, str, bool, bytes, type(None))


def _is_plain(value: Any, depth: int = 0) -> bool:
    """Numbers, strings and containers of them (what counters and metric lists are made of)."""
    if isinstance(value, _PLAIN_LEAVES):
        return True
    if depth > 4:
        return False
    if isinstance(value, (list, tuple, set, deque)):
        return len(value) < 100_000 and all(_is_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return len(value) < 100_000 and all(_is_plain(k, depth + 1) and _is_plain(v, depth + 1)
                                            for k, v in value.items())
    return False


def _restore_in_place(current: Any, saved: Any) -> Any:
    """``saved`` put back into ``current`` where both are the same mutable container, else ``saved``."""
    if type(current) is type(saved) and isinstance(current, dict):
        current.clear()
        current.update(saved)
        return current
    if type(current) is type(saved) and isinstance(current, list):
        current[:] = saved
        return current
    if type(current) is type(saved) and isinstance(current, deque) and current.maxlen == saved.maxlen:
        current.clear()
        current.extend(saved)
        return current
    return saved


class RngStates:
    """Every random number generator a step may draw from — Python's ``random``, NumPy's global one,
    torch's CPU one and each CUDA device's — captured, and put back by :meth:`restore`.

    A replayed step draws from them (GKD's ``random.random() <= lmbda``, sampling in ``generate``,
    GRPO's shuffles): without the restore, the run after an estimate is not the run without one.
    """

    def __init__(self, states: dict[str, Any]) -> None:
        self.states = states

    @classmethod
    def capture(cls) -> RngStates:
        states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        try:
            import numpy

            states["numpy"] = numpy.random.get_state()
        except ImportError:  # pragma: no cover
            pass
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["cuda"] = torch.cuda.get_rng_state_all()
        return cls(states)

    def restore(self) -> None:
        random.setstate(self.states["python"])
        torch.set_rng_state(self.states["torch"])
        if "numpy" in self.states:
            import numpy

            numpy.random.set_state(self.states["numpy"])
        if "cuda" in self.states:
            torch.cuda.set_rng_state_all(self.states["cuda"])


def _already_placed(data: Any) -> Any:
    return data


def _autograd_backward(loss: Any, **kwargs: Any) -> None:
    """``accelerator.backward`` as plain autograd, for a replay under an engine that does not exist yet.

    Under DeepSpeed, accelerate's backward goes to ``deepspeed_engine_wrapped``, which ``train()``
    builds (None before it; the engine's own buffers are modelled by
    :mod:`hf_memwatch.engines.shard`). Its keywords (``scale_wrt_gas``, ``sync_gradients``) are
    the engine's; the loss is already scaled by the Trainer as DeepSpeed's engine would not rescale it.
    """
    kwargs.pop("scale_wrt_gas", None)
    kwargs.pop("sync_gradients", None)
    kwargs.pop("learning_rate", None)
    loss.backward(**kwargs)


class TrainerStateGuard:
    """Everything a replayed step may change in a Trainer, restored on exit.

    Plain-data attributes (numbers, strings, containers of them — TRL's token counters, metric
    lists and completion-log deques among them), ``trainer.state``, every random number generator
    (:class:`RngStates`), and ``current_gradient_accumulation_steps`` (set for the replay as the
    training loop sets it).
    """

    def __init__(self, trainer: Any, accumulation: int) -> None:
        self.trainer = trainer
        self.accumulation = accumulation

    def __enter__(self) -> TrainerStateGuard:
        self.rng = RngStates.capture()
        attributes = vars(self.trainer)
        self.names = set(attributes)
        self.saved = {name: copy.deepcopy(value) for name, value in attributes.items() if _is_plain(value)}
        state = getattr(self.trainer, "state", None)
        self.state = copy.deepcopy(vars(state)) if state is not None else None
        self.trainer.current_gradient_accumulation_steps = self.accumulation
        # The replay's batches are already fake tensors on the simulated device (the CPU, for every
        # target): the Trainer's move to ``args.device`` ("cpu:0" under DDP, "cuda:0") would mismatch.
        replace_prepare_input(self.trainer, _already_placed)
        # The engine (DeepSpeed's) is built by train(); the replay's backward is autograd's.
        self.accelerator = getattr(self.trainer, "accelerator", None)
        self.backward_patched = engine_backward_detached(self.accelerator)
        if self.backward_patched:
            self.accelerator.backward = _autograd_backward
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.backward_patched:
            del self.accelerator.backward  # the class's method again
        attributes = vars(self.trainer)
        for name in set(attributes) - self.names:
            delattr(self.trainer, name)
        for name, value in self.saved.items():
            setattr(self.trainer, name, _restore_in_place(attributes.get(name), value))
        if self.state is not None:
            state = self.trainer.state
            vars(state).clear()
            vars(state).update(self.state)
        self.rng.restore()


# -- the worst-case batch ------------------------------------------------------------------------
def training_dataset(trainer: Any) -> Any:
    """The dataset as the Trainer's dataloader sees it (unused columns removed, as it removes them)."""
    dataset = trainer.train_dataset
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset):
            dataset = without_unused_columns(trainer, dataset)
    except ImportError:
        pass
    return dataset


def is_one_pass(dataset: Any) -> bool:
    """Whether reading ``dataset`` would consume it (no random access by index)."""
    return isinstance(dataset, torch.utils.data.IterableDataset) or not (
        hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))


def longest_index(dataset: Any, limit: int | None = None) -> tuple[int, int]:
    """(index, length) of the longest of the first ``limit`` (:data:`SCAN_ITEMS`) items of a map-style dataset."""
    limit = SCAN_ITEMS if limit is None else limit
    best, best_len = 0, -1
    for index in range(min(len(dataset), limit)):
        length = sequence_length(dataset[index]) or 0
        if length > best_len:
            best, best_len = index, length
    return best, max(best_len, 0)


def collate(trainer: Any, items: list[Any]) -> dict[str, Any]:
    """``items`` collated as the Trainer's training dataloader collates them."""
    collator = trainer.data_collator
    dataset = trainer.train_dataset
    if not hasattr(dataset, "column_names"):
        collator = collator_without_unused_columns(trainer, collator)
    return collator(items)


def longest_indices(dataset: Any, k: int, limit: int | None = None) -> list[int]:
    """Indices of the ``k`` longest of the first ``limit`` (:data:`SCAN_ITEMS`) items, longest first."""
    limit = SCAN_ITEMS if limit is None else limit
    lengths = [(sequence_length(dataset[index]) or 0, -index) for index in range(min(len(dataset), limit))]
    return [-negative for _, negative in sorted(lengths, reverse=True)[:k]]


def distinct_batch_reason(trainer: Any) -> str | None:
    """Why the worst micro-batch is the ``k`` longest *distinct* samples, not ``k`` copies of the longest
    (None: copies). A padding-free collator (``DataCollatorWithFlattening``, TRL's ``padding_free``)
    puts the micro-batch in one row: copies would count ``k`` x the longest tokens, more than any batch
    it forms. The length-grouped sampler (``group_by_length``) batches the longest samples together: its
    longest batch is padded to the longest, with padding where lengths differ (a padding mask, which
    copies never have)."""
    collator = getattr(trainer, "data_collator", None)
    if getattr(collator, "padding_free", False) or type(collator).__name__ == "DataCollatorWithFlattening":
        return "padding-free collator: the micro-batch's samples in one row"
    args = getattr(trainer, "args", None)
    strategy = getattr(args, "train_sampling_strategy", None)
    if getattr(args, "group_by_length", False) or str(getattr(strategy, "value", strategy)) == "group_by_length":
        return "group_by_length: the length-grouped sampler batches the longest samples together"
    return None


def fake_batch(batch: Mapping[str, Any] | list[Any]) -> Any:
    """A copy of ``batch`` whose tensors are created under the active fake mode (counted, no memory).

    A list batch (samples as a list collator returns them) is copied sample by sample.
    """
    if isinstance(batch, (list, tuple)):
        return [fake_batch(entry) if isinstance(entry, Mapping) else copy.deepcopy(entry) for entry in batch]
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors of a batch: a dict's values, or those of a list of samples."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for value in batch.values() for t in batch_tensors(value)]
    if isinstance(batch, (list, tuple)):
        return [t for value in batch for t in batch_tensors(value)]
    return []


def plain_counters(trainer: Any) -> dict[str, Any]:
    """The Trainer's plain-data attributes (what :class:`TrainerStateGuard` restores), for tests."""
    return {name: copy.deepcopy(value) for name, value in vars(trainer).items() if _is_plain(value)}


def frozen_model_bytes(trainer: Any, replay: Any, device: str, phase_classes: dict[str, dict[str, int]],
                       notes: list[str]) -> dict[str, int]:
    """Frozen models the Trainer holds (TRL's reference model, a teacher): resident weights."""
    frozen_models: dict[str, int] = {}
    if trainer is None:
        return frozen_models
    trained = set(weight_storages(trainer.model, None))
    for name, module in held_models(trainer).items():
        held = {k: v for k, v in weight_storages(module, None).items() if k not in trained}
        frozen_models[name] = sum(on_target(nbytes, device) for nbytes in held.values())
    if replay is None or not replay.held_weights:  # else: in the replay's live set
        for classes in phase_classes.values():
            classes["weights"] += sum(frozen_models.values())
    if frozen_models:
        notes.append("weights include models the Trainer holds: " + ", ".join(
            f"{name} ({format_bytes(nbytes)})" for name, nbytes in frozen_models.items()))
    return frozen_models


def on_target(nbytes: int, device: str) -> int:
    """One storage's bytes as ``device``'s allocator holds them (CUDA rounds each block up to 512 B)."""
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK if device == "cuda" else nbytes


__all__ = [
    "RngStates", "TrainerStateGuard", "batch_tensors", "collate", "fake_batch", "frozen_model_bytes", "held_models",
    "is_one_pass", "is_trainer", "longest_index", "on_target", "plain_counters", "training_dataset",
]
