"""The worst batch of the whole train dataset: the longest batch the sampler can form, found cheaply.

Runs die at step N when the one long sample arrives, so a plan made from the first batches is not
enough. :func:`worst_batch` looks at every sample's length without training on it:

A sample's length is :func:`~hf_memwatch.core.sequence_length.sequence_length`'s (the one rule: its
longest token field, labels included):

* ``datasets.Dataset``: the lengths of the token columns straight from Arrow
  (``pyarrow.compute.list_value_length``), no Python rows are built: ~1M rows in milliseconds
  (``benchmarks/results/lengths.md``);
* a map-style dataset (``__len__`` + ``__getitem__``): every item is read and measured, until a
  time budget runs out (then the record says how far it got);
* an iterable dataset: never read (consuming the user's iterator would change training);
  the truncation length (``max_length``, else ``model_max_length``) is taken instead, and said.

Then the collator's padding is applied: the batch is padded to its longest sample, rounded up to
``pad_to_multiple_of``; with truncation a sample never exceeds ``max_length``. Padding-free /
flattening collators put the micro-batch's samples in one row: the worst batch is then the sum of
the ``micro_batch_size`` longest samples. Settings come in as plain values (the caller reads the
Trainer's configuration); where one is ``None`` the collator's own attribute of that name is used.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..compat.datasets import reads_row_mapping, row_mapping
from ..core.sequence_length import IMAGE_KEYS, has_image_inputs, sequence_length

TOKEN_COLUMN = "input_ids"
DEFAULT_SCAN_SECONDS = 5.0


@dataclass(frozen=True)
class WorstBatch:
    """The longest batch the sampler can form over the whole dataset.

    ``index``/``length``: the longest sample (dataset index, its length in tokens before any
    truncation). ``batch_length``: the sequence length of the worst padded batch (for padding-free
    collators the length of its single row). ``batch_tokens``: tokens in that batch, padding
    included. ``source``: ``"arrow"``, ``"scan"``, ``"scan-partial"``, ``"max_length"`` or ``"unknown"``.
    ``None`` where not known.
    """

    index: int | None
    length: int | None
    batch_length: int | None
    batch_tokens: int | None
    source: str
    notes: tuple[str, ...] = ()
    pixel_values: bool = False  # the items carry image inputs (pixel_values): no sequence length there
    scanned: int | None = None  # samples whose length was read
    size: int | None = None  # samples in the dataset, when it has a length

    def as_record(self) -> dict[str, Any]:
        return {
            "index": self.index, "length": self.length, "batch_length": self.batch_length,
            "batch_tokens": self.batch_tokens, "source": self.source, "notes": list(self.notes),
            "pixel_values": self.pixel_values, "scanned": self.scanned, "size": self.size,
        }


@dataclass
class _Lengths:
    """What a length reader found: the longest sample and the k longest lengths."""

    index: int | None = None
    length: int | None = None
    top: list[int] = field(default_factory=list)  # the k longest lengths, any order
    scanned: int = 0
    pixel_values: bool = False
    notes: list[str] = field(default_factory=list)
    complete: bool = True


# -- readers -------------------------------------------------------------------------------------
def is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


def is_iterable_only(dataset: Any) -> bool:
    """An iterable dataset (torch or ``datasets``): reading it would consume the user's iterator."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    try:
        import datasets

        if isinstance(dataset, datasets.IterableDataset):
            return True
    except ImportError:
        pass
    return not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))


def arrow_lengths(dataset: Any, k: int) -> _Lengths | None:
    """Lengths of a ``datasets.Dataset``'s rows from Arrow: per row the longest token column (lists of
    numbers, ``input_ids`` and ``labels`` among them; image columns skipped), as the one rule measures a sample.

    ``None`` when the items must be read one by one instead: no ``input_ids`` column but other
    list columns, a transform that builds the items on access, or a ``datasets`` whose row mapping is
    not as verified (:mod:`hf_memwatch.compat.datasets`). A dataset of plain columns only (text not
    yet tokenized) gives no length, with a note.
    """
    if not reads_row_mapping():
        return None
    import pyarrow.compute as pc

    found = _Lengths()
    columns = dataset.column_names
    found.pixel_values = any(name in IMAGE_KEYS for name in columns)
    table = dataset.data.table if hasattr(dataset.data, "table") else dataset.data
    transformed = (dataset.format or {}).get("type") == "custom"
    column = TOKEN_COLUMN if TOKEN_COLUMN in columns else None
    if column is None:
        if transformed:
            return None  # set_transform/with_transform: the items are made on access
        lists = [name for name in columns if name not in IMAGE_KEYS and _is_list_type(table.column(name).type)]
        if lists:
            return None
        found.notes.append(f"no '{TOKEN_COLUMN}' column (columns: {', '.join(columns)}): lengths unknown "
                           "before the collator tokenizes")
        return found
    chunked = table.column(column)
    if not _is_list_type(chunked.type):
        found.notes.append(f"column '{column}' is {chunked.type}, not token lists")
        return None
    # The one sequence-length rule (core.sequence_length): the longest token column of each row, labels included.
    token_columns = [name for name in columns if name not in IMAGE_KEYS and _is_token_list(table.column(name).type)]
    per_column = [_column_lengths(table.column(name), table.num_rows) for name in token_columns or [column]]
    if any(part is None for part in per_column):
        return None
    lengths = per_column[0] if len(per_column) == 1 else pc.max_element_wise(*per_column)
    # A shuffled/selected/filtered dataset keeps its row order in an index mapping over the table
    # (compat.datasets: no public accessor).
    indices = row_mapping(dataset)
    if indices is not None:
        lengths = pc.take(lengths, indices.column(0))
    values = lengths.to_numpy(zero_copy_only=False) if hasattr(lengths, "to_numpy") else np.asarray(lengths)
    values = np.nan_to_num(values.astype(np.float64), nan=0).astype(np.int64)  # null rows: length 0
    found.scanned = int(values.size)
    if values.size:
        found.index = int(np.argmax(values))
        found.length = int(values[found.index])
        top = min(k, values.size)
        found.top = [int(v) for v in np.partition(values, values.size - top)[values.size - top:]]
    if transformed:
        found.notes.append("a transform is set on the dataset: lengths are those of the stored column, before it")
    return found


def _column_lengths(chunked: Any, rows: int) -> Any:
    """Each row's length of a list column (``[[ids]]`` rows, a tokenizer's batch of one: one level down);
    None where that does not give one length per row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_list(chunked.type.value_type) or pa.types.is_large_list(chunked.type.value_type):
        chunked = pc.list_flatten(chunked)
        if len(chunked) != rows:
            return None
    return pc.list_value_length(chunked)


def _is_token_list(arrow_type: Any) -> bool:
    """A list (or list of lists) of numbers: a token column; lists of strings have no sequence length."""
    import pyarrow as pa

    if not _is_list_type(arrow_type):
        return False
    inner = arrow_type.value_type
    if _is_list_type(inner):
        inner = inner.value_type
    return bool(pa.types.is_integer(inner) or pa.types.is_floating(inner) or pa.types.is_boolean(inner))


def _is_list_type(arrow_type: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)
                or pa.types.is_fixed_size_list(arrow_type))


def scan_lengths(dataset: Any, k: int, seconds: float) -> _Lengths:
    """Read every item of a map-style dataset and measure it, until ``seconds`` have passed."""
    found = _Lengths()
    size = len(dataset)
    top: list[int] = []
    start = time.perf_counter()
    for index in range(size):
        item = dataset[index]
        length = sequence_length(item)
        found.pixel_values = found.pixel_values or has_image_inputs(item)
        found.scanned = index + 1
        if length is not None:
            if found.length is None or length > found.length:
                found.index, found.length = index, length
            if len(top) < k:
                heapq.heappush(top, length)
            elif length > top[0]:
                heapq.heapreplace(top, length)
        if time.perf_counter() - start > seconds and index + 1 < size:
            found.complete = False
            found.notes.append(
                f"stopped after {seconds:g} s: {index + 1} of {size} samples read; "
                "the longest of the rest is not known"
            )
            break
    found.top = top
    return found


# -- the batch ----------------------------------------------------------------------------------
def round_up(length: int, multiple: int | None) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (as the tokenizer's ``pad`` does).

    Example:
        >>> round_up(500, 64), round_up(500, None)
        (512, 500)
    """
    if not multiple or multiple <= 1:
        return length
    return int(math.ceil(length / multiple) * multiple)


def _collator_value(collator: Any, name: str) -> Any:
    return getattr(collator, name, None) if collator is not None else None


def is_padding_free(collator: Any) -> bool:
    """A collator that puts the micro-batch in one row (``DataCollatorWithFlattening``, TRL ``padding_free``)."""
    if collator is None:
        return False
    return bool(_collator_value(collator, "padding_free")) or type(collator).__name__ == "DataCollatorWithFlattening"


def pads_to_max_length(collator: Any) -> bool:
    """A collator configured with ``padding="max_length"`` (every batch has the same length)."""
    padding = _collator_value(collator, "padding")
    return str(getattr(padding, "value", padding)) == "max_length"


def worst_batch(
    dataset: Any,
    collator: Any = None,
    *,
    micro_batch_size: int = 1,
    max_length: int | None = None,
    truncation: bool = True,
    pad_to_multiple_of: int | None = None,
    group_by_length: bool = False,
    padding_free: bool | None = None,
    packing: bool = False,
    model_max_length: int | None = None,
    scan_seconds: float = DEFAULT_SCAN_SECONDS,
) -> WorstBatch:
    """The longest batch the sampler can form over the whole ``dataset``.

    Args:
        dataset: the Trainer's train dataset (``datasets.Dataset``, map-style or iterable).
        collator: the Trainer's data collator; its ``pad_to_multiple_of``, ``max_length`` and
            ``padding_free`` attributes fill settings passed as ``None``.
        micro_batch_size: samples per micro-batch on this process.
        max_length, truncation: samples are cut to ``max_length`` when ``truncation``.
        pad_to_multiple_of: the padded length is rounded up to a multiple of it.
        group_by_length: the sampler batches samples of similar length (noted: it does not change
            the worst padded batch, it makes it certain).
        padding_free: the micro-batch is concatenated into one row (``None``: ask the collator).
        packing: samples were packed into rows of ``max_length`` (each row is a sample here).
        model_max_length: the tokenizer's limit, used when ``max_length`` is not given.
        scan_seconds: time budget for reading a map-style dataset item by item.

    Example:
        >>> wb = worst_batch([{"input_ids": [1] * n} for n in (5, 9, 3)], micro_batch_size=2, pad_to_multiple_of=8)
        >>> (wb.index, wb.length, wb.batch_length, wb.batch_tokens, wb.source)
        (1, 9, 16, 32, 'scan')
    """
    k = max(1, int(micro_batch_size))
    if pad_to_multiple_of is None:
        pad_to_multiple_of = _collator_value(collator, "pad_to_multiple_of")
    if max_length is None:
        collator_max = _collator_value(collator, "max_length")
        max_length = collator_max if isinstance(collator_max, int) else None
    if padding_free is None:
        padding_free = is_padding_free(collator)
    padding = _Padding(k, max_length, truncation, pad_to_multiple_of, bool(padding_free), model_max_length,
                       pads_to_max_length(collator))
    notes: list[str] = []
    size = len(dataset) if hasattr(dataset, "__len__") and not is_iterable_only(dataset) else None
    found, source = _read_lengths(dataset, k, scan_seconds, padding, notes)
    if found is None or found.length is None:
        return _without_lengths(found, padding, notes, size)
    batch_length, batch_tokens = _padded(found, padding, notes)
    if packing:
        notes.append("packing: each packed row counts as one sample")
    if group_by_length:
        notes.append("group_by_length: the longest samples are batched together")
    return WorstBatch(
        index=found.index, length=found.length, batch_length=batch_length, batch_tokens=batch_tokens,
        source=source, notes=tuple(notes), pixel_values=found.pixel_values, scanned=found.scanned, size=size,
    )


@dataclass(frozen=True)
class _Padding:
    """How the collator pads a micro-batch of ``k`` samples (settings resolved against the collator)."""

    k: int
    max_length: int | None
    truncation: bool
    pad_to_multiple_of: int | None
    padding_free: bool
    model_max_length: int | None
    pads_to_max_length: bool

    @property
    def cap(self) -> int | None:
        """The longest a sample can be: ``max_length``, else the tokenizer's ``model_max_length``."""
        return self.max_length if self.max_length is not None else self.model_max_length

    def effective(self, n: int) -> int:
        """A sample of ``n`` tokens as the batch holds it (truncated where the run truncates)."""
        return min(n, self.max_length) if self.truncation and self.max_length is not None else n


def _read_lengths(dataset: Any, k: int, seconds: float, padding: _Padding,
                  notes: list[str]) -> tuple[_Lengths | None, str]:
    """The sample lengths of ``dataset`` (None for an iterable dataset, never read) and their source."""
    if is_iterable_only(dataset):
        cap, max_length = padding.cap, padding.max_length
        notes.append("iterable dataset: not read (that would consume its iterator); planned for "
                     + ("max_length" if max_length is not None else "model_max_length" if cap else "nothing known"))
        return None, "unknown"
    if is_hf_dataset(dataset):
        found = arrow_lengths(dataset, k)
        if found is not None:
            return found, "arrow"
    found = scan_lengths(dataset, k, seconds)
    return found, "scan" if found.complete else "scan-partial"


def _without_lengths(found: _Lengths | None, padding: _Padding, notes: list[str], size: int | None) -> WorstBatch:
    """The worst batch when no sample length is known: the truncation length, where there is one."""
    if found is not None:
        notes.extend(found.notes)
        if found.length is None:
            notes.append("no sequence length in the items")
    if found is not None and found.pixel_values:
        notes.append("image inputs (pixel_values): sized by the image processor, no sequence length")
    cap = padding.cap
    batch_length = None if cap is None else round_up(cap, padding.pad_to_multiple_of)
    batch_tokens = None if batch_length is None else batch_length * padding.k
    return WorstBatch(
        index=None, length=None, batch_length=batch_length, batch_tokens=batch_tokens,
        source="max_length" if cap is not None else "unknown", notes=tuple(notes),
        pixel_values=bool(found and found.pixel_values), scanned=None if found is None else found.scanned,
        size=size,
    )


def _padded(found: _Lengths, padding: _Padding, notes: list[str]) -> tuple[int, int]:
    """(sequence length, tokens) of the worst batch the collator forms from ``found``'s longest samples."""
    assert found.length is not None
    k, max_length, multiple = padding.k, padding.max_length, padding.pad_to_multiple_of
    notes.extend(found.notes)
    if found.pixel_values:
        notes.append("image inputs (pixel_values): sized by the image processor, no sequence length; "
                     "the length is that of the token sequence")
    if padding.truncation and max_length is not None and found.length > max_length:
        notes.append(f"longest sample {found.length} truncated to max_length {max_length}")
    elif (padding.model_max_length is not None and found.length > padding.model_max_length
          and not (padding.truncation and max_length)):
        notes.append(f"longest sample {found.length} exceeds model_max_length {padding.model_max_length}")
    if padding.padding_free:
        # One row holding the micro-batch's samples: worst = the k longest together.
        batch_length = sum(padding.effective(n) for n in found.top)
        batch_tokens = batch_length
        notes.append(f"padding-free: the {len(found.top)} longest samples in one row")
    elif padding.pads_to_max_length and max_length is not None:
        batch_length = round_up(max_length, multiple)  # every batch padded to max_length
        batch_tokens = batch_length * k
        notes.append(f"the collator pads every batch to max_length {max_length}")
    else:
        batch_length = round_up(padding.effective(found.length), multiple)
        batch_tokens = batch_length * k
    cap = padding.cap
    if not found.complete and cap is not None and not padding.padding_free and round_up(cap, multiple) > batch_length:
        # The unread rest may hold a longer sample: plan for the truncation length instead.
        batch_length = round_up(cap, multiple)
        batch_tokens = batch_length * k
        notes.append(f"planned for {'max_length' if max_length is not None else 'model_max_length'} {cap}: "
                     "the unread samples may be longer")
    return batch_length, batch_tokens

