"""Per-instance patches of a ``transformers.Trainer`` (never its class), each undoable.

:func:`keep_effective_batch` makes the Trainer's own out-of-memory retry (``auto_find_batch_size``)
keep the effective batch. How transformers 5.x retries: ``Trainer.train`` wraps
``self._inner_training_loop`` in ``find_executable_batch_size`` (``transformers.trainer_utils``, which
defers to ``accelerate.utils.find_executable_batch_size``); on an exception that
``should_reduce_batch_size`` recognises (CUDA/XPU/NPU/MPS out of memory, cuDNN not supported), the
batch size is multiplied by 0.9 and ``_inner_training_loop(batch_size, ...)`` runs again from the
start, which calls ``_update_auto_batch_size`` (the dataloader's batch size) and rebuilds the loop.
Gradient accumulation is left as it was, so the effective batch — micro-batch × accumulation — shrinks
by 10% at every retry. The patch wraps the instance's ``_inner_training_loop``: at a retry it raises
``args.gradient_accumulation_steps`` so that micro-batch × accumulation equals the effective batch
again. Accumulation must be an integer, so the micro-batch becomes the largest divisor of the effective
batch at or below the retry's batch size (a WARNING says which).

Usage:
    >>> undo = keep_effective_batch(trainer)   # doctest: +SKIP
    >>> trainer.train()                        # doctest: +SKIP
    >>> undo()                                 # doctest: +SKIP

An OOM at micro-batch 16 × accumulation 2: accelerate offers 14, the run goes on at 8 × 4.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("hf_memwatch")

_PATCHED_LOOP = "_inner_training_loop"  # the Trainer method that find_executable_batch_size retries
_MARK = "_hf_memwatch_keeps_effective_batch"


def largest_divisor_at_most(number: int, limit: int) -> int:
    """The largest divisor of ``number`` that is ``<= limit`` (at least 1).

    Example:
        >>> largest_divisor_at_most(32, 14), largest_divisor_at_most(24, 21), largest_divisor_at_most(7, 6)
        (8, 12, 1)
    """
    for candidate in range(min(limit, number), 1, -1):
        if number % candidate == 0:
            return candidate
    return 1


def keep_effective_batch(trainer: Any, effective_batch: int | None = None) -> Callable[[], None]:
    """Make ``trainer``'s ``auto_find_batch_size`` retries keep the effective batch; returns ``undo``.

    ``effective_batch`` is per process (micro-batch × n_gpu × accumulation, the world size apart);
    default: what ``trainer.args`` asks for now. Patching twice replaces the first patch (the newest
    target wins); ``undo()`` restores the Trainer's own method and is safe to call twice.
    """
    args = trainer.args
    target = int(effective_batch or args.train_batch_size * args.gradient_accumulation_steps)
    if target < 1:
        raise ValueError(f"effective batch must be >= 1; got {target}")
    previous = trainer.__dict__.get(_PATCHED_LOOP)
    if previous is not None and getattr(previous, _MARK, False):
        previous.undo()
    original = getattr(trainer, _PATCHED_LOOP)
    last_run: list[int] = []  # the micro-batch of the previous attempt: a retry must go below it

    @functools.wraps(original)
    def inner_training_loop(batch_size: int | None = None, *rest: Any, **kwargs: Any) -> Any:
        if batch_size is not None and batch_size * trainer.args.gradient_accumulation_steps != target:
            limit = min(int(batch_size), last_run[-1] - 1) if last_run else int(batch_size)
            if limit < 1:  # what accelerate says when it runs out of batch sizes
                raise RuntimeError("No executable batch size found, reached zero.")
            batch_size = _rebalance(trainer.args, int(batch_size), limit, target)
        if batch_size is not None:
            last_run[:] = [int(batch_size)]
        return original(batch_size, *rest, **kwargs)

    def undo() -> None:
        if trainer.__dict__.get(_PATCHED_LOOP) is inner_training_loop:
            del trainer.__dict__[_PATCHED_LOOP]  # the class's method shows through again

    setattr(inner_training_loop, _MARK, True)
    inner_training_loop.undo = undo  # type: ignore[attr-defined]
    inner_training_loop.effective_batch = target  # type: ignore[attr-defined]
    trainer.__dict__[_PATCHED_LOOP] = inner_training_loop
    return undo


def _rebalance(args: Any, offered: int, limit: int, target: int) -> int:
    """Set the accumulation for the retry's micro-batch (at most ``limit``); returns the micro-batch."""
    micro = largest_divisor_at_most(target, limit)
    accumulation = target // micro
    if micro != offered:
        logger.warning(
            "hf-memwatch: auto_find_batch_size retries with micro-batch %d after an out-of-memory error; "
            "MemWatch runs micro-batch %d instead (the largest that divides the effective batch %d) with "
            "gradient accumulation %d, so the effective batch stays %d.",
            offered, micro, target, accumulation, target,
        )
    else:
        logger.warning(
            "hf-memwatch: auto_find_batch_size retries with micro-batch %d after an out-of-memory error; "
            "MemWatch raises gradient accumulation from %d to %d so the effective batch stays %d.",
            micro, args.gradient_accumulation_steps, accumulation, target,
        )
    args.gradient_accumulation_steps = accumulation
    return micro
