"""Watching the Trainer's evaluation and prediction loops (``evaluate()``, ``predict()``, eval during training).

The Trainer has callback events around an eval loop's batches (``on_prediction_step``) but none at
its start or end, and the outputs it accumulates (``EvalLoopContainer``s ``all_preds``,
``all_labels``, ``all_losses``, ``all_inputs``) are locals of ``Trainer.evaluation_loop``. So, per
Trainer *instance* (the class is untouched):

* ``trainer.evaluation_loop`` is wrapped: the monitor opens a peak window of its own before the
  loop and closes it after, writing one ``eval`` record; a forward pre-hook on the model registers
  each batch's inputs with the CPU tracker for the loop's duration.
* ``trainer.prediction_step`` is wrapped: a snapshot ``eval_forward`` after each batch's no-grad
  forward; the callback's ``on_prediction_step`` takes ``eval_accumulated`` once the containers
  hold the batch.

The accumulated tensors are read from the ``evaluation_loop`` frame on the call stack (the same
introspection :func:`~hf_memwatch.integration.callback.find_trainer` uses; read-only): the
containers' public ``tensors`` (on the device) and ``arrays`` (numpy, which on the CPU may still be
views of torch storages, counted through their ``base``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

CONTAINER_NAMES = ("all_losses", "all_preds", "all_labels", "all_inputs")
_WRAPPED_MARK = "_hf_memwatch_eval"


def loop_stage(description: str) -> str:
    """``predict`` for ``Trainer.predict``'s loop (description ``"Prediction"``), else ``eval``.

    Example:
        >>> loop_stage("Prediction"), loop_stage("Evaluation")
        ('predict', 'eval')
    """
    return "predict" if description == "Prediction" else "eval"


def held_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Torch tensors behind ``value``: nested containers, eval-loop containers and numpy views.

    Example:
        >>> t = torch.zeros(3)
        >>> [x.shape for x in held_tensors([t.numpy(), {"b": t}])]
        [torch.Size([3]), torch.Size([3])]
    """
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        yield value
    elif hasattr(value, "tensors") and hasattr(value, "arrays"):  # transformers' EvalLoopContainer
        yield from held_tensors(value.tensors)
        yield from held_tensors(value.arrays)
    elif isinstance(value, dict):
        for item in value.values():
            yield from held_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from held_tensors(item)
    else:
        base = getattr(value, "base", None)  # a numpy array made by Tensor.numpy() keeps the tensor
        for _ in range(4):
            if base is None or isinstance(base, torch.Tensor):
                break
            base = getattr(base, "base", None)
        if isinstance(base, torch.Tensor):
            yield base


def accumulated_outputs(trainer: Any) -> list[torch.Tensor]:
    """Tensors held by the containers of ``trainer``'s ``evaluation_loop`` running on this thread's stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "evaluation_loop" and frame.f_locals.get("self") is trainer:
            local = frame.f_locals
            return [t for name in CONTAINER_NAMES for t in held_tensors(local.get(name))]
        frame = frame.f_back
    return []


def failed_loop_outputs(exc: BaseException, trainer: Any) -> list[torch.Tensor]:
    """Tensors held by the containers of ``trainer``'s ``evaluation_loop`` that ``exc`` came out of."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "evaluation_loop" and frame.f_locals.get("self") is trainer:
            return [t for name in CONTAINER_NAMES for t in held_tensors(frame.f_locals.get(name))]
        tb = tb.tb_next
    return []


def install_eval_watch(trainer: Any, watcher: Any) -> bool:
    """Wrap ``trainer.evaluation_loop`` and ``trainer.prediction_step`` (this instance) for ``watcher``.

    ``watcher`` (the ``MemWatch`` callback) provides ``eval_loop_begin(stage)``,
    ``eval_loop_end(output, error)`` and ``eval_forward_done()``; its faults are its own to
    contain (they must never stop the loop). Returns False when already installed.
    """
    if getattr(trainer.evaluation_loop, _WRAPPED_MARK, False):
        return False
    trainer.evaluation_loop = _wrap_loop(trainer.evaluation_loop, watcher)
    trainer.prediction_step = _wrap_prediction_step(trainer.prediction_step, watcher)
    return True


def _wrap_loop(original: Callable[..., Any], watcher: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def evaluation_loop(dataloader: Any, description: str, *args: Any, **kwargs: Any) -> Any:
        watcher.eval_loop_begin(loop_stage(description))
        try:
            output = original(dataloader, description, *args, **kwargs)
        except BaseException as exc:
            watcher.eval_loop_end(None, exc)
            raise
        watcher.eval_loop_end(output, None)
        return output

    setattr(evaluation_loop, _WRAPPED_MARK, True)
    return evaluation_loop


def _wrap_prediction_step(original: Callable[..., Any], watcher: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def prediction_step(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        watcher.eval_forward_done()
        return result

    setattr(prediction_step, _WRAPPED_MARK, True)
    return prediction_step
