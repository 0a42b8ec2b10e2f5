"""Batches the dataloader has already formed: bytes a step holds that no operator of the step made.

The Trainer fetches every micro-batch of an optimizer step before ``on_step_begin``, and
accelerate's ``DataLoaderShard`` keeps one batch ahead (it fetches the next batch before yielding the
current one, to know the end of the epoch). Those tensors were built by the collator outside the
CPU tracker's window, so a tracked step would not count them until the model's forward receives
them — and the look-ahead batch never reaches this step's forward. Measured on a tiny ViT (batch 4 of
3 x 64 x 64 fp32 images): step 1's peak read 7.6% under the profiler's, 196,640 B = one batch of
``pixel_values`` + ``labels``.

:class:`FormedBatches` wraps the training dataloader's ``collate_fn`` for the run (restored at
``close``) and keeps a weak reference to every tensor a batch holds; as a
:class:`~hf_memwatch.measure.monitor.StorageContributor` it hands the ones still alive to the
monitor at each fully tracked step, which registers them (class ``other``). With worker processes
the batches arrive through shared memory, which the CPU allocator (and the profiler) does not
count either, so only in-process collation matters.

Given the Trainer, it also counts the two tensors the Trainer makes between tracked steps that no
batch holds: the loss divisor ``get_batch_samples`` returns with the step's micro-batches
(``num_items_in_batch``, made before ``on_step_begin``; the run patch of ``get_batch_samples`` in
:mod:`hf_memwatch.integration.patches` hands it to :meth:`FormedBatches.remember`) and the running loss (``_tr_loss``, transformers 5:
made before ``on_train_begin``, counted once an operator of a step writes it). Measured against the
profiler on the GPU check's dry run (tiny GPT-2, batch 2 x 32, accumulation 2): without them each
step-begin snapshot read 8 B (step 1) and 4 B (later steps) under PyTorch's CPU allocator.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ..core.records import Snapshot
from .storage import nested_tensors


class _CollateWrapper:
    """The collator as given, remembering what each batch it forms holds."""

    def __init__(self, collate_fn: Any, owner: FormedBatches) -> None:
        self.collate_fn = collate_fn
        self.owner = weakref.ref(owner)

    def __call__(self, samples: Any) -> Any:
        batch = self.collate_fn(samples)
        owner = self.owner()
        if owner is not None:
            owner.remember(batch)
        return batch


# Tensors the Trainer keeps as attributes across steps (transformers 5's running loss).
TRAINER_TENSORS = ("_tr_loss",)


class FormedBatches:
    """Tensors of the batches a dataloader formed (and, given the Trainer, what it fetched with them).

    Example:
        >>> loader = torch.utils.data.DataLoader([torch.zeros(4)] * 4, batch_size=2)
        >>> formed = FormedBatches(loader)
        >>> batch = next(iter(loader))
        >>> [t.shape for t in formed.known_tensors(None)]
        [torch.Size([2, 4])]
        >>> formed.close(); loader.collate_fn is formed.original
        True
    """

    def __init__(self, dataloader: Any, trainer: Any = None) -> None:
        self._refs: list[weakref.ref] = []
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        # accelerate's DataLoaderShard iterates the DataLoader it wraps (attributes read through)
        self.dataloader = getattr(dataloader, "base_dataloader", dataloader)
        dataloader = self.dataloader
        self.original = getattr(dataloader, "collate_fn", None)
        if self.original is not None:
            dataloader.collate_fn = _CollateWrapper(self.original, self)

    def remember(self, batch: Any) -> None:
        self._refs = [ref for ref in self._refs if ref() is not None]
        self._refs.extend(weakref.ref(t) for t in nested_tensors(batch) if isinstance(t, torch.Tensor))

    def known_tensors(self, monitor: Any) -> Iterable[torch.Tensor]:
        tensors = [t for t in (ref() for ref in self._refs) if t is not None]
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is not None:
            tensors.extend(t for t in (getattr(trainer, name, None) for name in TRAINER_TENSORS)
                           if isinstance(t, torch.Tensor))
        return tensors

    def class_storages(self, monitor: Any) -> dict[str, dict[int, int]]:
        return {}  # ``other``, as the inputs the forward registers

    def adjust(self, record: Snapshot, monitor: Any, phase: str, window_peak: int | None) -> None:
        return None

    def close(self) -> None:
        """Give the dataloader its own collator back."""
        if self.original is not None and isinstance(getattr(self.dataloader, "collate_fn", None), _CollateWrapper):
            self.dataloader.collate_fn = self.original
        self._refs = []
