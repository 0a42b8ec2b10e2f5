"""The ``Trainer``'s private methods the estimator's replay calls, so that the replayed step takes
its batch as ``train()`` takes it, each with its probe. Verified on transformers 4.57.6 and 5.23.0.

====================================================  ========================================  ===============================
private thing (``guards``)                            what relies on it                         without it (``off``)
====================================================  ========================================  ===============================
``Trainer._get_num_items_in_batch(batch_samples,      the loss of ``estimate(trainer)`` given   the tokens the loss counts,
device)``                                             the Trainer's own ``num_items_in_batch``  as for a model or a config
``Trainer._prepare_input`` (called by                 the replay's fake batch left where it     the Trainer moves it (a device
``_prepare_inputs``, replaced on the instance)        is (the simulated device)                 it cannot reach may fail loudly)
``Trainer._remove_unused_columns(dataset,             the replay's samples with the columns     every column kept
description)``, ``_get_collator_with_removed_``       the Trainer's loader removes
``columns(data_collator, description)``
``Trainer._get_output_dir(trial)``                    a search trial's folder name              one folder for every trial
====================================================  ========================================  ===============================
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .probes import Probe, holds


def takes(method_name: str, *parameters: str, owner: str = "Trainer") -> Callable[[], bool]:
    """A probe's check: ``transformers.<owner>.<method_name>`` is a function taking ``parameters`` (after ``self``)."""

    def check() -> bool:
        import transformers

        method = getattr(getattr(transformers, owner), method_name, None)
        return callable(method) and list(inspect.signature(method).parameters)[1:len(parameters) + 1] == list(parameters)

    return check


NUM_ITEMS = Probe("transformers", "Trainer._get_num_items_in_batch(batch_samples, device)",
                  "the Trainer's own num_items_in_batch in estimate(trainer)'s loss (the loss's counted tokens used)",
                  takes("_get_num_items_in_batch", "batch_samples", "device"))
def _places_through_prepare_input() -> bool:
    from transformers import Trainer

    return "_prepare_input" in Trainer._prepare_inputs.__code__.co_names and takes("_prepare_input", "data")()


PREPARE_INPUT = Probe("transformers", "Trainer._prepare_input (called by _prepare_inputs)",
                      "keeping the replay's fake batch on the simulated device (the Trainer moves it)",
                      _places_through_prepare_input)
UNUSED_COLUMNS = Probe("transformers", "Trainer._remove_unused_columns, _get_collator_with_removed_columns",
                       "removing the columns the Trainer's loader removes from the replay's samples (all kept)",
                       lambda: takes("_remove_unused_columns", "dataset", "description")()
                       and takes("_get_collator_with_removed_columns", "data_collator", "description")())
OUTPUT_DIR = Probe("transformers", "Trainer._get_output_dir(trial)",
                   "naming a search trial's folder as the Trainer does (one folder for all trials)",
                   takes("_get_output_dir", "trial"))


def counts_items_in_batch() -> bool:
    """Whether :func:`num_items_in_batch` asks the Trainer itself (:data:`NUM_ITEMS`)."""
    return holds(NUM_ITEMS)


def num_items_in_batch(trainer: Any, batches: list[Any], device: Any) -> Any:
    """The Trainer's ``num_items_in_batch`` for ``batches`` (the accumulation window), as ``train()`` computes it."""
    return trainer._get_num_items_in_batch(batches, device)


def replace_prepare_input(trainer: Any, prepare: Callable[[Any], Any]) -> bool:
    """Make ``trainer`` place its inputs with ``prepare`` (on the instance; ``vars(trainer).pop
    ("_prepare_input")`` undoes it); False when this Trainer does not place them through it."""
    if not holds(PREPARE_INPUT):
        return False
    trainer._prepare_input = prepare
    return True


def without_unused_columns(trainer: Any, dataset: Any) -> Any:
    """``dataset`` with the columns the Trainer's training loader removes, removed (a ``datasets.Dataset``)."""
    if not (hasattr(trainer, "_remove_unused_columns") and holds(UNUSED_COLUMNS)):
        return dataset
    return trainer._remove_unused_columns(dataset, description="training")


def collator_without_unused_columns(trainer: Any, collator: Any) -> Any:
    """The collator the Trainer's training loader uses for a dataset without ``column_names``."""
    if not (hasattr(trainer, "_get_collator_with_removed_columns") and holds(UNUSED_COLUMNS)):
        return collator
    return trainer._get_collator_with_removed_columns(collator, description="training")


def trial_output_dir(trainer: Any, trial: Any) -> str | None:
    """The folder the Trainer writes ``trial``'s run to (None when this Trainer does not say)."""
    return trainer._get_output_dir(trial) if holds(OUTPUT_DIR) else None


def cached_train_batch_size(trainer: Any) -> int | None:
    """The Trainer's cached batch size (``_train_batch_size``; None when it has none)."""
    from .trainer import TRAIN_BATCH_SIZE

    return getattr(trainer, "_train_batch_size", None) if holds(TRAIN_BATCH_SIZE) else None
