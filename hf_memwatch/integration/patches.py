"""Every per-instance patch of a ``transformers.Trainer`` (never its class): one installer, one remover.

Two tiers, installed in this order and removed in the reverse one:

* **Entry points** — ``train``, ``evaluate``, ``predict`` — installed when the Trainer is built
  (``MemWatch.on_init_end``) by :func:`install_entry_points`, kept while the callback watches the
  Trainer, removed by :func:`remove_patches` (``MemWatch.detach``). Each call of one opens a *run*;
  nested calls (``evaluate()`` inside ``train()``) join the run in progress.
* **Run patches** — installed when the outermost entry call begins, removed when it returns *or
  raises* (an exception, ``KeyboardInterrupt``, an out-of-memory error, ``max_steps``, a callback
  stopping training), in this order:

  1. ``log``: ``memory/*`` scalars join the training and eval logs (:mod:`hf_memwatch.reporting.sinks`);
  2. ``on_log`` of the TensorBoard and W&B callbacks present now: the scalars keep their exact names;
  3. ``evaluation_loop`` and ``prediction_step``: the eval loop's peak window
     (:mod:`hf_memwatch.integration.eval_watch`);
  4. ``get_batch_samples``: what it returns (the step's micro-batches and loss divisor
     ``num_items_in_batch``, made before ``on_step_begin``) is told to the watcher
     (:class:`hf_memwatch.measure.batches.FormedBatches` counts it);
  5. ``_inner_training_loop`` (auto mode only, when its plan is applied inside ``train``):
     :func:`keep_effective_batch`.

  Around the Trainer's own ``train``: the auto mode's planning and first-step safety net (outer),
  then the OOM guard (inner), which writes the post-mortem and re-raises the *same* exception with
  the frames of hf-memwatch it passed through (the CPU tracker's dispatch) spliced out.
  At the outermost exit the watcher's ``run_ended`` closes what the run opened (the CPU tracker's
  dispatch mode, the saved-tensor hooks, the module hooks, the timeline file), then the run patches
  go. A patch someone else wrapped over stays in their chain but turns inert (passes through).

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
import os
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

from ..core.errors import is_oom_error

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
    patches = _REGISTRY.get(trainer)
    if patches is not None and patches.depth:  # inside a run: removed when the run ends
        patches.run.append(_Patch(trainer, _PATCHED_LOOP, inner_training_loop))
    else:
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


# -- one installer, one remover ------------------------------------------------------------------
ENTRY_POINTS = ("train", "evaluate", "predict")
_MISSING = object()
_OWN = "_hf_memwatch_patch"  # set on every wrapper of ours: the _Patch that put it there


class Watcher(Protocol):
    """What the patches call (``MemWatch`` implements it); faults are the watcher's to contain."""

    scalars: bool
    oom_report: bool

    def run_begins(self, trainer: Any) -> None: ...
    def run_ended(self, trainer: Any, error: BaseException | None) -> None: ...
    def train_call(self, trainer: Any, call: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any: ...
    def on_oom(self, exc: BaseException) -> None: ...
    def memory_scalars(self, step: int) -> dict[str, int] | None: ...
    def eval_scalars(self) -> dict[str, int] | None: ...
    def eval_loop_begin(self, stage: str, containers: list[Any]) -> None: ...
    def eval_loop_end(self, output: Any, error: BaseException | None) -> None: ...
    def eval_forward_done(self) -> None: ...
    def batch_samples_fetched(self, fetched: Any) -> None: ...


class _Patch:
    """``owner.name`` replaced by ``wrapper`` (an instance attribute); :meth:`remove` puts back what was."""

    def __init__(self, owner: Any, name: str, wrapper: Any) -> None:
        self.owner, self.name, self.wrapper, self.active = owner, name, wrapper, True
        self.previous = owner.__dict__.get(name, _MISSING)
        setattr(wrapper, _OWN, self)
        owner.__dict__[name] = wrapper

    def remove(self) -> None:
        self.active = False  # a wrapper someone else wrapped over passes through from now on
        if self.owner.__dict__.get(self.name) is self.wrapper:
            if self.previous is _MISSING:
                del self.owner.__dict__[self.name]
            else:
                self.owner.__dict__[self.name] = self.previous


class TrainerPatches:
    """All patches of one Trainer instance for one watcher (see the module docstring for the order)."""

    def __init__(self, trainer: Any, watcher: Watcher) -> None:
        self._trainer = weakref.ref(trainer)
        self.watcher = watcher
        self.entry: list[_Patch] = []
        self.run: list[_Patch] = []
        self.depth = 0  # entry calls in progress (evaluate() inside train() joins the run)

    @property
    def trainer(self) -> Any:
        return self._trainer()

    def install_entry_points(self) -> None:
        trainer = self.trainer
        for name in ENTRY_POINTS:
            original = getattr(trainer, name)
            wrapper = self._train_entry(original) if name == "train" else self._entry(original)
            self.entry.append(_Patch(trainer, name, functools.wraps(original)(wrapper)))

    def _entry(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def entry(*args: Any, **kwargs: Any) -> Any:
            if not getattr(entry, _OWN).active:
                return original(*args, **kwargs)
            self.begin()
            error: BaseException | None = None
            try:
                return original(*args, **kwargs)
            except BaseException as exc:
                error = exc
                raise
            finally:
                self.end(error)

        return entry

    def _train_entry(self, original: Callable[..., Any]) -> Callable[..., Any]:
        guarded = self._oom_guarded(original)

        def train(*args: Any, **kwargs: Any) -> Any:
            if not getattr(train, _OWN).active:
                return original(*args, **kwargs)
            self.begin()
            error: BaseException | None = None
            try:
                return self.watcher.train_call(self.trainer, guarded, args, kwargs)
            except BaseException as exc:
                error = exc
                raise
            finally:
                self.end(error)

        return train

    def _oom_guarded(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def train(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except BaseException as exc:
                splice_own_frames(exc)
                if is_oom_error(exc) and self.watcher.oom_report:
                    try:
                        self.watcher.on_oom(exc)
                    except Exception as inner:  # noqa: BLE001 - the user's OOM matters, not ours
                        logger.warning("hf-memwatch: OOM report failed (%s: %s)", type(inner).__name__, inner)
                raise

        return train

    # -- a run -----------------------------------------------------------------------------------
    def begin(self) -> None:
        """An entry call starts: the outermost one installs the run patches."""
        self.depth += 1
        if self.depth > 1:
            return
        try:
            self.watcher.run_begins(self.trainer)
            self._install_run_patches()
        except Exception as exc:  # noqa: BLE001 - a fault of ours must never stop the user's call
            logger.warning("hf-memwatch: patching the Trainer failed (%s: %s); the run goes on unwatched",
                           type(exc).__name__, exc)
            self._remove_run_patches()

    def end(self, error: BaseException | None) -> None:
        """An entry call returns or raises: the outermost one closes the run and removes its patches."""
        self.depth -= 1
        if self.depth > 0:
            return
        try:
            self.watcher.run_ended(self.trainer, error)
        except Exception as exc:  # noqa: BLE001 - closing must not replace the user's result or error
            logger.warning("hf-memwatch: closing the run failed (%s: %s)", type(exc).__name__, exc)
        finally:
            self._remove_run_patches()

    def _install_run_patches(self) -> None:
        from ..reporting.sinks import exact_name_routes, routed_on_log, scalar_logging
        from .eval_watch import wrap_evaluation_loop, wrap_prediction_step

        trainer, watcher = self.trainer, self.watcher
        if watcher.scalars:
            log = scalar_logging(trainer, trainer.log, watcher.memory_scalars, watcher.eval_scalars)
            self.run.append(_Patch(trainer, "log", log))
            for callback, before, after in exact_name_routes(trainer.callback_handler.callbacks):
                self.run.append(_Patch(callback, "on_log", routed_on_log(callback, callback.on_log, before, after)))
        self.run.append(_Patch(trainer, "evaluation_loop", wrap_evaluation_loop(trainer.evaluation_loop, watcher)))
        self.run.append(_Patch(trainer, "prediction_step", wrap_prediction_step(trainer.prediction_step, watcher)))
        if callable(getattr(trainer, "get_batch_samples", None)):
            self.run.append(_Patch(trainer, "get_batch_samples", _told_fetch(trainer.get_batch_samples, watcher)))

    def _remove_run_patches(self) -> None:
        while self.run:
            self.run.pop().remove()

    def remove(self) -> None:
        """Remove every patch: the run's, then the entry points."""
        self._remove_run_patches()
        while self.entry:
            self.entry.pop().remove()


_REGISTRY: weakref.WeakKeyDictionary[Any, TrainerPatches] = weakref.WeakKeyDictionary()


def _told_fetch(original: Callable[..., Any], watcher: Watcher) -> Callable[..., Any]:
    """``trainer.get_batch_samples`` telling ``watcher`` what it returned."""

    @functools.wraps(original)
    def get_batch_samples(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        watcher.batch_samples_fetched(result)
        return result

    return get_batch_samples


def install_entry_points(trainer: Any, watcher: Watcher) -> TrainerPatches:
    """Install the entry points on ``trainer`` for ``watcher`` (once per Trainer: a later call — a
    callback rebuilt from checkpoint state — takes the patches over)."""
    patches = _REGISTRY.get(trainer)
    if patches is not None and patches.entry:
        patches.watcher = watcher
        return patches
    patches = TrainerPatches(trainer, watcher)
    patches.install_entry_points()
    _REGISTRY[trainer] = patches
    return patches


def patches_of(trainer: Any) -> TrainerPatches | None:
    """The patches installed on ``trainer`` (None: none)."""
    return _REGISTRY.get(trainer)


def remove_patches(trainer: Any) -> None:
    """Every patch of ours on ``trainer`` removed; its methods are the class's (or the user's) again."""
    patches = _REGISTRY.pop(trainer, None)
    if patches is not None:
        patches.remove()


def patched_names(trainer: Any) -> list[str]:
    """Names of ``trainer``'s attributes, and ``<Callback>.on_log``, that are wrappers of ours now."""
    names = [name for name, value in vars(trainer).items() if getattr(value, _OWN, None) is not None]
    handler = getattr(trainer, "callback_handler", None)
    for callback in getattr(handler, "callbacks", []):
        if getattr(vars(callback).get("on_log"), _OWN, None) is not None:
            names.append(f"{type(callback).__name__}.on_log")
    return names


def splice_own_frames(exc: BaseException) -> None:
    """Drop the traceback entries of hf-memwatch's modules that lie *between* other frames (the
    CPU tracker's ``__torch_dispatch__`` around the failing operator), so the error reads as the
    user's code raised it. Frames of ours at either end (our wrappers; a fault of ours) are kept."""
    entries: list[TracebackType] = []
    tb = exc.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    foreign = [not _ours(entry) for entry in entries]
    keep = [entry for i, entry in enumerate(entries)
            if foreign[i] or not (any(foreign[:i]) and any(foreign[i + 1:]))]
    if len(keep) == len(entries):
        return
    for outer, inner in zip(keep, keep[1:]):
        outer.tb_next = inner


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _ours(tb: TracebackType) -> bool:
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE_DIR)
