"""A one-pass (iterable) dataset's worst micro-batch: the longest the run can feed, or its items' fixed shapes.

A streaming dataset cannot be scanned for its longest sample (reading it would consume the user's
iterator), so its worst case is bounded by what the run can feed:

* :func:`longest_fed_length`: the run's ``max_length`` (TRL's, ``max_seq_length``), else the collator's
  fixed length (``padding="max_length"`` with its ``max_length``: every batch has that length, a longer
  sample fails to collate), else the model's maximum positions (``max_position_embeddings``,
  ``n_positions``) — the step is then replayed on synthetic batches at that length;
* where nothing bounds the length, items without a sequence dimension (regression features, scalar
  labels, fixed-size images) need no bound — every micro-batch has the shapes of the first.
  :func:`first_items` reads the first micro-batch's items (only then: a bounded stream is never read)
  from a *shallow copy* of the dataset (a fresh iterator, as the Trainer's next epoch takes one), with
  every random number generator put back and the dataset's plain attributes restored in place; a
  dataset holding an iterator, a generator, an open file or a socket (whose reading would advance the
  user's) is not read.

transformers' own ``test_training_iterable_dataset`` (a 2-parameter regression model fed scalar
``input_x`` by an ``IterableDataset``) stopped under ``MemWatch(auto=True, budget="16GiB")`` with
``PlanError`` ("could neither predict this run ... nor measure its micro-steps"): the estimator asked
for a ``seq_len`` the run has no use for. It now plans from the first micro-batch's shapes and trains.

Example:
    >>> import torch
    >>> class Squares(torch.utils.data.IterableDataset):
    ...     def __iter__(self):
    ...         return iter([{"x": torch.tensor(float(i * i))} for i in range(10)])
    >>> [item["x"].item() for item in first_items(Squares(), 3)]
    [0.0, 1.0, 4.0]
"""

from __future__ import annotations

import copy
import io
import itertools
import socket
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..core.sequence_length import sequence_length
from .trainer_replay import RngStates, _is_plain, _restore_in_place, collate


def longest_fed_length(trainer: Any) -> tuple[int, str] | None:
    """(the longest sequence the run can feed, what bounds it) — None where nothing does."""
    args = trainer.args
    for name in ("max_length", "max_seq_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value, f"the run's {name}"
    collator = getattr(trainer, "data_collator", None)
    padding = getattr(collator, "padding", None)
    fixed = getattr(collator, "max_length", None)
    if str(getattr(padding, "value", padding)) == "max_length" and isinstance(fixed, int) and fixed > 0:
        return fixed, "the collator's max_length (padding='max_length')"
    config = getattr(trainer.model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value, f"the model's {name}"
    return None


def bounded_batch(trainer: Any, batch_size: int, length: int) -> tuple[dict[str, Any], str] | None:
    """(``batch_size`` items of ``length`` token ids as the run's collator forms them, a note) where the
    collator is TRL's — it forms the labels and the attention mask (or the padding-free positions) from
    the token ids alone, so the batch the run feeds at the bound is known without reading the stream;
    None for other collators (which fields a stream's items carry is unknown unread: the synthetic
    batch of the task is replayed). Without it, SFT over a stream was replayed on the task's synthetic
    batch, which has no ``attention_mask``, and TRL's ``compute_loss`` raised "Expected
    'attention_mask' or 'position_ids' in inputs" inside the replay (sweep draw ``sft-iterable``)."""
    collator = getattr(trainer, "data_collator", None)
    if not type(collator).__module__.startswith("trl."):
        return None
    try:
        batch = collate(trainer, [{"input_ids": [0] * length} for _ in range(batch_size)])
    except Exception:  # the collator wants fields a stream's items carry: the task's synthetic batch
        return None
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
        return None
    return dict(batch), f"{batch_size} x {length} token ids as TRL's collator forms them"


def first_items(dataset: Any, count: int) -> list[Any] | None:
    """The first ``count`` items of an iterable ``dataset``, read without consuming it (module doc);
    None where it cannot be read so."""
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    state = vars(dataset)
    if any(isinstance(value, (Iterator, io.IOBase, socket.socket)) for value in state.values()):
        return None  # its iteration would advance an iterator the user's run shares
    saved = {name: copy.deepcopy(value) for name, value in state.items() if _is_plain(value)}
    rng = RngStates.capture()
    iterator = None
    try:
        iterator = iter(copy.copy(dataset))
        return list(itertools.islice(iterator, count))
    except Exception:  # noqa: BLE001 - a dataset that cannot be read twice: not read
        return None
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
        for name, value in saved.items():
            state[name] = _restore_in_place(state.get(name), value)
        rng.restore()


def fixed_shape_batch(trainer: Any, dataset: Any, batch_size: int) -> tuple[Any, str] | None:
    """(the first micro-batch as collated, a note) where the dataset's items carry no sequence; None
    where they do (the length bound applies) or they cannot be read without consuming the dataset."""
    items = first_items(dataset, batch_size)
    if not items or any(sequence_length(item) for item in items):
        return None
    while len(items) < batch_size:  # a dataset shorter than one micro-batch: the copies' shapes
        items.append(copy.deepcopy(items[len(items) % len(items)]))
    batch = collate(trainer, items)
    return batch, (f"iterable dataset: its items carry no sequence (the first {batch_size} read from a copy, "
                   "not consumed): every micro-batch has their shapes")
