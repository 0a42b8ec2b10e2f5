"""A stream's first micro-batches read ahead, measured as they arrive, then trained on in the same order.

A one-pass (iterable) dataset is planned for the longest sequence the run can feed
(:mod:`hf_memwatch.estimation.streaming`). Where nothing bounds it, or the bound does not fit the budget
(GPT-2's 1,024 positions on a run whose stream carries 16 tokens), the auto mode plans on the stream's own
samples instead: :class:`ReadAhead` wraps the Trainer's ``train_dataset`` and, before training, reads its
first :data:`READ_AHEAD_BATCHES` micro-batches (or one optimizer step's samples and two micro-batches more,
whichever is more) from the very iterator the Trainer will then take — nothing is read twice, nothing
consumed: the Trainer receives the same samples in the same order, and every random number generator is
put back after the read (a stream drawing its own numbers with its own generator trains exactly as
without MemWatch; one drawing from the global generators gets its numbers at another time).

The estimate replays ``batch_size`` copies of the longest sample read (:func:`read_ahead_batch`, the hook
in :mod:`hf_memwatch.estimation.worst_batch`). While training, the wrapper keeps as many samples read ahead
of the Trainer, so a longer sample is known before the step that trains on it: ``longest`` passes
``planned`` and the auto mode predicts the plan in force again between steps
(:meth:`~hf_memwatch.integration.between_steps.BetweenSteps.longer_sample`).

On several ranks each rank reads its own copy's first samples, as many as the stream feeds every rank over
those micro-batches, and every few steps the ranks agree on the longest sample any of them read (under
accelerate's dispatcher, the Trainer's default for an iterable dataset, only rank 0 reads the stream while
training): every rank replays it and takes the same verdict
(:meth:`~hf_memwatch.integration.between_steps.BetweenSteps.agree_longer_sample`; one ``all_gather_object``
every few steps, as often as the samples read ahead require, only for such a run).

Read by dataloader workers, the stream cannot be read ahead here: each worker iterates its own copy. A copy
of the dataset is read in this process instead (:func:`sample_stream`: the same first samples where the
stream is not sharded by worker, nothing of the run's stream consumed) and planned on; the batches the
workers then fetch are measured as the Trainer takes them, before the step that trains on them
(:meth:`~hf_memwatch.integration.between_steps.BetweenSteps.longer_fetched`; on several ranks every rank reads
a copy, and the ranks agree on the longest micro-batch any of them fetched, at the fetch).

Example:
    >>> import torch
    >>> class Counting(torch.utils.data.IterableDataset):
    ...     def __iter__(self):
    ...         return iter([{"input_ids": torch.ones(n, dtype=torch.long)} for n in (3, 5, 4)])
    >>> ahead = ReadAhead(Counting(), ahead_items=2)
    >>> ahead.read(), ahead.longest
    (2, 5)
    >>> [len(item["input_ids"]) for item in ahead]
    [3, 5, 4]
"""

from __future__ import annotations

import copy
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from ..core.sequence_length import sequence_length
from .trainer_replay import RngStates, collate, is_one_pass

#: Micro-batches read before training: the stream's first samples the plan is made on.
READ_AHEAD_BATCHES = 8


class ReadAhead(torch.utils.data.IterableDataset):
    """``dataset`` iterated with ``ahead_items`` samples read ahead of its reader (module docstring).

    ``longest``: the longest sequence read so far (every pass), ``longest_item`` that sample; ``planned``:
    the length the plan in force was predicted for, ``first_longer`` the index (over every pass) of the first
    sample read longer. Other attributes (``set_epoch``, ...) are the dataset's.
    """

    def __init__(self, dataset: Any, ahead_items: int) -> None:
        self.dataset = dataset
        self.ahead = max(1, int(ahead_items))
        self.buffer: deque[Any] = deque()
        self.source: Iterator[Any] | None = None  # the first pass's iterator, opened by read()
        self.longest = 0
        self.longest_item: Any = None
        self.planned = 0
        self.items_read = 0
        self.pass_start = 0  # items of the passes before this one (their indices: the stream's over all passes)
        self.read_in_pass = 0
        self.first_longer: int | None = None  # index of the first sample read longer than ``planned``

    def read(self) -> int:
        """Read the first samples before training (random number generators put back); how many."""
        rng = RngStates.capture()
        try:
            if self.source is None:
                self.source = iter(self.dataset)
            self._fill(self.source, self.buffer)
        finally:
            rng.restore()
        return len(self.buffer)

    def _fill(self, source: Iterator[Any], buffer: deque[Any]) -> None:
        while len(buffer) < self.ahead:
            try:
                item = next(source)
            except StopIteration:
                return
            index = self.pass_start + self.read_in_pass
            self.items_read += 1
            self.read_in_pass += 1
            length = sequence_length(item) or 0  # a sample with no token field: 0 tokens
            if self.longest_item is not None and length > self.planned and self.first_longer is None:
                self.first_longer = index
            if self.longest_item is None or length > self.longest:
                self.longest, self.longest_item = length, item
            buffer.append(item)

    def __iter__(self) -> Iterator[Any]:
        """The first pass: the samples read ahead, then the rest of the same iterator; later passes (a new
        epoch, a step retried after an out-of-memory error) a fresh iterator, as the Trainer takes one."""
        if self.source is not None:
            source, buffer, self.source, self.buffer = self.source, self.buffer, None, deque()
        else:
            self.pass_start, self.read_in_pass = self.pass_start + self.read_in_pass, 0
            source, buffer = iter(self.dataset), deque()
        return self._pass(source, buffer)

    def planned_for(self, length: int) -> None:
        """The plan in force is predicted for samples of ``length`` tokens (later longer ones are tracked)."""
        self.planned, self.first_longer = length, None

    def adopt(self, length: int, item: Any) -> None:
        """Another rank read ``item``, of ``length`` tokens, longer than any read here: this rank's estimates
        replay it too (the ranks' agreement between steps)."""
        if item is not None and length > self.longest:
            self.longest, self.longest_item = length, item

    def _pass(self, source: Iterator[Any], buffer: deque[Any]) -> Iterator[Any]:
        while True:
            self._fill(source, buffer)
            if not buffer:
                return
            yield buffer.popleft()

    def __getattr__(self, name: str) -> Any:  # set_epoch, column_names, ...: the wrapped dataset's
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def read_ahead_batch(trainer: Any, dataset: ReadAhead, batch_size: int) -> tuple[Any, int | None, str]:
    """(``batch_size`` copies of the longest sample read so far as collated, its length, a note)."""
    return (*_collated_copies(trainer, dataset.longest_item, dataset.longest, batch_size), _note(dataset, batch_size))


def _collated_copies(trainer: Any, item: Any, longest: int, batch_size: int) -> tuple[Any, int | None]:
    """(``batch_size`` copies of ``item`` as the Trainer's collator forms them, their sequence length)."""
    batch = collate(trainer, [copy.deepcopy(item) for _ in range(batch_size)])
    if isinstance(batch, (list, tuple)):
        return list(batch), longest or None
    return dict(batch), sequence_length(dict(batch)) or None


def _note(dataset: ReadAhead, batch_size: int) -> str:
    return (f"iterable dataset read ahead: {batch_size} x its longest sample of the {dataset.items_read} read "
            f"before they are trained on ({dataset.longest} tokens), the samples then trained on in the same order")


def start_read_ahead(trainer: Any, micro_batch_size: int, accumulation: int) -> ReadAhead | None:
    """The Trainer's one-pass ``train_dataset`` wrapped in a :class:`ReadAhead` whose first samples are read
    (None: not a one-pass dataset, wrapped already, nothing read, or dataloader workers, each iterating its
    own copy of the dataset: :func:`sample_stream`).

    On several ranks every rank reads its own copy's first samples, as many as the stream feeds all ranks
    over the same steps (:func:`samples_per_micro_step`): accelerate's dispatcher (the Trainer's default for an
    iterable dataset) has rank 0 read every rank's micro-batches from its copy, ``dispatch_batches=False``
    every rank read them all and keep its slice; either way each rank's copy is read from its start.
    Between steps the ranks agree on the longest sample read
    (:meth:`~hf_memwatch.integration.between_steps.BetweenSteps.agree_longer_sample`)."""
    dataset = getattr(trainer, "train_dataset", None)
    if dataset is None or isinstance(dataset, ReadAhead) or not is_one_pass(dataset):
        return None
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    if int(getattr(trainer.args, "dataloader_num_workers", 0) or 0) > 0:
        return None  # each worker iterates its own copy (sharded by get_worker_info): not read in this process
    ahead = ReadAhead(dataset, _samples_to_read(trainer, micro_batch_size, accumulation))
    if ahead.read() == 0:
        trainer.train_dataset = ahead  # the iterator is opened: the Trainer takes it from the wrapper
        return None
    trainer.train_dataset = ahead
    ahead.planned_for(ahead.longest)
    return ahead


def samples_per_micro_step(trainer: Any, micro_batch_size: int) -> int:
    """Samples a rank's copy of the stream gives up per micro-step: every rank's micro-batch
    (``micro_batch_size`` x world size, :func:`start_read_ahead`)."""
    return int(micro_batch_size) * max(1, int(getattr(trainer.args, "world_size", 1) or 1))


def _samples_to_read(trainer: Any, micro_batch_size: int, accumulation: int) -> int:
    """Samples read before training: :data:`READ_AHEAD_BATCHES` micro-steps, or one optimizer step's and two
    micro-steps more, whichever is more (every rank's micro-batches)."""
    return samples_per_micro_step(trainer, micro_batch_size) * max(READ_AHEAD_BATCHES, accumulation + 2)


class StreamSample:
    """The first samples of a copy of a stream read by dataloader workers (:func:`sample_stream`), then each
    micro-batch the workers deliver (:meth:`fetched`): what the plan in force was predicted for, and the
    longest seen. ``longest_item`` is a sample (as read) or, once a fetched micro-batch was longer, that
    micro-batch as collated (``longest_batch``)."""

    def __init__(self, items: list[Any]) -> None:
        self.items_read = len(items)
        self.longest, self.longest_item, self.longest_batch = 0, None, None
        for item in items:
            length = sequence_length(item) or 0
            if self.longest_item is None or length > self.longest:
                self.longest, self.longest_item = length, item
        self.planned = self.longest
        self.fetched_batches = 0

    def fetched(self, batches: list[Any]) -> bool:
        """The micro-batches of a step as the Trainer took them; whether one is longer than planned."""
        for batch in batches:
            self.fetched_batches += 1
            length = sequence_length(dict(batch)) if isinstance(batch, dict) else None
            if length is not None and length > self.longest:
                self.longest, self.longest_batch = length, batch
        return self.longest > self.planned

    def planned_for(self, length: int) -> None:
        self.planned = length

    def adopt(self, length: int, batch: Any) -> None:
        """Another rank fetched ``batch``, a micro-batch of ``length`` tokens, longer than any fetched here: this
        rank's estimates replay it too (the ranks' agreement at the fetch)."""
        if batch is not None and length > self.longest:
            self.longest, self.longest_batch = length, batch


_SAMPLED: weakref.WeakKeyDictionary[Any, StreamSample] = weakref.WeakKeyDictionary()


def stream_sample(trainer: Any) -> StreamSample | None:
    """The :class:`StreamSample` the Trainer's stream was planned on (None: none)."""
    return _SAMPLED.get(trainer)


def sample_stream(trainer: Any, micro_batch_size: int, accumulation: int) -> StreamSample | None:
    """For a one-pass ``train_dataset`` read by dataloader workers: its first samples, read from a deep copy of
    the dataset (the run's dataset and its workers' copies untouched, random number generators put back), as
    many as :func:`start_read_ahead` would read (on several ranks, every rank's). None: not such a run, a
    dataset that cannot be copied, or nothing read."""
    dataset = getattr(trainer, "train_dataset", None)
    if (dataset is None or isinstance(dataset, ReadAhead) or not is_one_pass(dataset)
            or not isinstance(dataset, torch.utils.data.IterableDataset)
            or int(getattr(trainer.args, "dataloader_num_workers", 0) or 0) <= 0):
        return None
    wanted = _samples_to_read(trainer, micro_batch_size, accumulation)
    rng = RngStates.capture()
    try:
        copied = copy.deepcopy(dataset)
        items = []
        for item in copied:
            items.append(item)
            if len(items) >= wanted:
                break
    except Exception:  # noqa: BLE001 - a stream that cannot be copied or read here: not sampled
        return None
    finally:
        rng.restore()
    if not items:
        return None
    sample = _SAMPLED[trainer] = StreamSample(items)
    return sample


def stream_sample_batch(trainer: Any, sample: StreamSample, batch_size: int) -> tuple[Any, int | None, str]:
    """(the micro-batch the plan is predicted on, its length, a note): the longest fetched micro-batch as the
    workers formed it, else ``batch_size`` copies of the longest sample read from the copy, collated."""
    if sample.longest_batch is not None:
        return (dict(sample.longest_batch), sample.longest,
                f"the longest micro-batch the dataloader workers fetched ({sample.longest} tokens, "
                f"{sample.fetched_batches} fetched)")
    note = (f"iterable dataset read by dataloader workers: {batch_size} x the longest of the first "
            f"{sample.items_read} samples of a copy of it ({sample.longest} tokens), the workers' micro-batches "
            "measured as they arrive")
    return (*_collated_copies(trainer, sample.longest_item, sample.longest, batch_size), note)
