"""The micro-batch a built Trainer's step is replayed on: its training dataset's worst, as its collator forms it.

A map-style dataset is read by index (:mod:`hf_memwatch.estimation.trainer_replay`'s helpers: the longest
sample, the longest ``batch_size`` where the sampler groups them, a padded batch where it mixes lengths);
a one-pass dataset is never iterated (:mod:`hf_memwatch.estimation.streaming`: the longest length the run
can feed, or its items' fixed shapes). This module sits above both, so neither imports the other's caller.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from ..core.sequence_length import sequence_length
from .read_ahead import ReadAhead, read_ahead_batch, stream_sample, stream_sample_batch
from .streaming import bounded_batch, fixed_shape_batch, longest_fed_length
from .trainer_replay import (
    SCAN_ITEMS,
    collate,
    distinct_batch_reason,
    is_one_pass,
    longest_index,
    longest_indices,
    training_dataset,
)

__all__ = ["longest_allowed_length", "shortest_index", "worst_case_batch"]


def worst_case_batch(trainer: Any, batch_size: int, sample_index: int | None = None
                     ) -> tuple[dict[str, Any] | list[Any] | None, int | None, str]:
    """(batch of ``batch_size`` copies of the longest sample — or, where the batches the sampler and
    collator form say so (:func:`distinct_batch_reason`), the ``batch_size`` longest samples — its
    sequence length, note).

    The batch is a dict, or a list where the collator returns one (GRPO's and RLOO's hand the
    samples to the step, which tokenizes and generates). It is None for one-pass datasets (never
    read); the note says what was used instead.
    """
    dataset = training_dataset(trainer)
    if dataset is None:
        return None, None, "no training dataset: synthetic batches"
    if is_one_pass(dataset):
        if isinstance(dataset, ReadAhead) and dataset.longest_item is not None:  # its first samples, read ahead
            return read_ahead_batch(trainer, dataset, batch_size)
        sampled = stream_sample(trainer)  # read by dataloader workers: a copy's first samples, the batches fetched
        if sampled is not None:
            return stream_sample_batch(trainer, sampled, batch_size)
        bound = longest_fed_length(trainer)
        if bound is not None:
            formed = bounded_batch(trainer, batch_size, bound[0])
            if formed is not None:
                return formed[0], bound[0], f"one-pass (iterable) dataset, not read: {formed[1]} at {bound[1]}"
            return None, None, f"one-pass (iterable) dataset, not read: synthetic batches at {bound[1]}"
        fixed = fixed_shape_batch(trainer, dataset, batch_size)  # no bound: items without a sequence need none
        if fixed is not None:
            return fixed[0], None, fixed[1]
        return None, None, "one-pass (iterable) dataset, not read: synthetic batches at the longest length allowed"
    if len(dataset) == 0:
        return None, None, "empty training dataset: synthetic batches"
    why = distinct_batch_reason(trainer)
    if why is not None and batch_size > 1:
        indices = longest_indices(dataset, batch_size)
        batch = collate(trainer, [copy.deepcopy(dataset[index]) for index in indices])
        length = sequence_length(batch) or None
        tokens = sum(sequence_length(dataset[index]) or 0 for index in indices)
        return dict(batch), length, (f"worst case: the {len(indices)} longest samples {indices} ({tokens} tokens "
                                     f"before padding) as collated; {why}")
    if sample_index is None:
        sample_index, _ = longest_index(dataset)
    item = dataset[sample_index]
    batch = collate(trainer, [copy.deepcopy(item) for _ in range(batch_size)])
    if isinstance(batch, (list, tuple)):  # GRPO's, RLOO's collators: the samples as they are
        length = max((sequence_length(entry) or 0 for entry in batch), default=0) or None
        return list(batch), length, f"worst case: {batch_size} x sample {sample_index} as collated (a list)"
    length = sequence_length(batch) or None
    shorter = shortest_index(dataset) if batch_size > 1 else None
    if shorter is not None and shorter[1] < (sequence_length(item) or 0):
        padded = collate(trainer, [copy.deepcopy(item) for _ in range(batch_size - 1)]
                         + [copy.deepcopy(dataset[shorter[0]])])
        if isinstance(padded, Mapping) and all(_same_shape(batch.get(k), v) for k, v in padded.items()):
            return dict(padded), length, (f"worst case: {batch_size - 1} x sample {sample_index} and the shortest, "
                                          f"sample {shorter[0]}, padded to it as collated (the sampler mixes lengths: "
                                          "a padded batch, whose mask the model materialises)")
    return dict(batch), length, f"worst case: {batch_size} x sample {sample_index} as collated"


def _same_shape(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
    return True


def shortest_index(dataset: Any, limit: int | None = None) -> tuple[int, int] | None:
    """(index, length) of the shortest of the first ``limit`` (:data:`SCAN_ITEMS`) items (None: empty)."""
    limit = SCAN_ITEMS if limit is None else limit
    lengths = [(sequence_length(dataset[index]) or 0, index) for index in range(min(len(dataset), limit))]
    if not lengths:
        return None
    length, index = min(lengths)
    return index, length


def longest_allowed_length(trainer: Any) -> int | None:
    """The longest sequence the run allows: the trainer's ``max_length`` (TRL), the collator's fixed
    length or the model's positions (:func:`~hf_memwatch.estimation.streaming.longest_fed_length`)."""
    bound = longest_fed_length(trainer)
    return None if bound is None else bound[0]
