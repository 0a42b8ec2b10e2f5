"""The one sequence-length rule: how many tokens a sample (or a collated batch) is long.

Every reader of a sample's length uses :func:`sequence_length` — the planner's scan of a dataset
(:mod:`hf_memwatch.planning.lengths`), the replay's choice of the longest sample and of the padded
batch (:mod:`hf_memwatch.estimation.trainer_replay`, :mod:`hf_memwatch.estimation.worst_batch`),
the samples listed in a ``plan`` record — so a sample is never "longest" by one rule and "short" by another.

The rule: the longest token field of the sample, **labels included** (a seq2seq sample whose
``labels`` are longer than its ``input_ids`` is as long as its labels: the decoder runs over them).
A field is measured by its last dimension (a tensor or array; a 0-d one, such as a scalar label,
has none), a flat list of numbers by its length, a nested field (a list of lists, a dict of fields)
by its longest inner sequence. Image fields (:data:`IMAGE_KEYS`) have sizes, not sequence lengths:
they are skipped (:func:`has_image_inputs` says they are there). Text not yet tokenized, numbers and
``None`` have no length. ``None`` when nothing in the sample has one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

# Keys whose values are image tensors: they have sizes, not sequence lengths.
IMAGE_KEYS = frozenset({"pixel_values", "pixel_values_videos", "image", "images", "pixel_mask", "image_grid_thw"})
_NUMBERS = (int, float, bool, np.integer, np.floating)

__all__ = ["IMAGE_KEYS", "has_image_inputs", "sequence_length", "value_length"]


def value_length(value: Any) -> int | None:
    """Sequence length of one field value: the last dimension; ``None`` for scalars and text.

    Example:
        >>> value_length([1, 2, 3]), value_length(torch.tensor(1)), value_length(np.zeros((1, 7)))
        (3, None, 7)
        >>> value_length([[1, 2], [1, 2, 3, 4]]), value_length([]), value_length("text")
        (4, 0, None)
    """
    if isinstance(value, torch.Tensor):
        return int(value.shape[-1]) if value.dim() > 0 else None  # len() of a 0-d tensor raises
    if isinstance(value, np.ndarray):
        return int(value.shape[-1]) if value.ndim > 0 else None
    if isinstance(value, Mapping):
        return sequence_length(value)
    if isinstance(value, (list, tuple)):
        if not value:
            return 0
        if all(isinstance(v, _NUMBERS) for v in value[:8]):
            return len(value)
        return _longest(value_length(v) for v in value)
    return None  # str, bytes, int, float, None, ...


def sequence_length(item: Any) -> int | None:
    """Length of a sample's longest token field (labels included; image fields skipped); ``None``: none.

    A dict: the longest of its fields (a nested dict by its own longest). A tuple of fields: the
    longest field. A bare tensor, array or list: :func:`value_length`.

    Example:
        >>> sequence_length({"input_ids": [1, 2, 3], "labels": [1, 2, 3, 4, 5]})
        5
        >>> sequence_length({"pixel_values": torch.zeros(3, 224, 224), "text": {"input_ids": np.arange(9)}})
        9
        >>> sequence_length({"pixel_values": torch.zeros(3, 8, 8), "label": 1}) is None
        True
    """
    if isinstance(item, Mapping):
        return _longest(value_length(value) for key, value in item.items() if key not in IMAGE_KEYS)
    if isinstance(item, tuple) and item and not isinstance(item[0], _NUMBERS):
        return _longest(sequence_length(part) for part in item)
    return value_length(item)


def has_image_inputs(item: Any) -> bool:
    """Whether a sample carries image inputs (an :data:`IMAGE_KEYS` field, at any depth of dicts/tuples).

    Example:
        >>> has_image_inputs({"text": {"input_ids": [1]}, "pixel_values": None}), has_image_inputs([1, 2])
        (True, False)
    """
    if isinstance(item, Mapping):
        return any(key in IMAGE_KEYS or has_image_inputs(value) for key, value in item.items())
    if isinstance(item, tuple) and item and not isinstance(item[0], _NUMBERS):
        return any(has_image_inputs(part) for part in item)
    return False


def _longest(lengths: Any) -> int | None:
    known = [n for n in lengths if n is not None]
    return max(known) if known else None
