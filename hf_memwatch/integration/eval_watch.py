"""Watching the Trainer's evaluation and prediction loops (``evaluate()``, ``predict()``, eval during training).

The Trainer has callback events around an eval loop's batches (``on_prediction_step``) but none at
its start or end, and the outputs it accumulates (``EvalLoopContainer``s ``all_preds``,
``all_labels``, ``all_losses``, ``all_inputs``) are locals of ``Trainer.evaluation_loop``. So, per
Trainer *instance* (the class is untouched; installed by :mod:`hf_memwatch.integration.patches`):

* ``trainer.evaluation_loop`` is wrapped: the monitor opens a peak window of its own before the
  loop and closes it after, writing one ``eval`` record; a forward pre-hook on the model registers
  each batch's inputs with the CPU tracker for the loop's duration.
* ``trainer.prediction_step`` is wrapped: a snapshot ``eval_forward`` after each batch's no-grad
  forward; the callback's ``on_prediction_step`` takes ``eval_accumulated`` once the containers
  hold the batch.

Under ``Seq2SeqTrainer``'s ``predict_with_generate`` the model runs once per generated token: the
pre-hook registers each call's inputs, and the batch's sequence length is read from calls that are
not decoding steps (:func:`decoding_step`). The generated tokens are ``all_preds``' tensors.

The accumulated tensors are those of the loop's containers, registered as the Trainer creates them
(:func:`registering_containers`): their public ``tensors`` (on the device) and ``arrays`` (numpy,
which on the CPU may still be views of torch storages, counted through their ``base``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..compat.trainer import eval_container_module

CONTAINER_NAMES = ("all_losses", "all_preds", "all_labels", "all_inputs")


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


def decoding_step(kwargs: dict[str, Any]) -> bool:
    """Whether a model forward's keywords are a ``generate`` decoding step: a cache already holding tokens.

    Under ``predict_with_generate`` the model runs once per generated token with the new token(s) only;
    such a call's ``input_ids`` say nothing of the eval batch's sequence length.
    """
    seq_length = getattr(kwargs.get("past_key_values"), "get_seq_length", None)
    return callable(seq_length) and int(seq_length()) > 0


def container_tensors(containers: list[Any]) -> list[torch.Tensor]:
    """Tensors held by the eval loop's containers (device tensors and numpy views of torch storage)."""
    return [t for container in containers for t in held_tensors(container)]


@contextlib.contextmanager
def registering_containers(found: list[Any]) -> Iterator[None]:
    """While the loop runs, every ``EvalLoopContainer`` the Trainer creates is appended to ``found``.

    ``Trainer.evaluation_loop`` builds its four containers through the name ``EvalLoopContainer`` of
    the ``transformers.trainer`` module; for the loop's duration that name is a subclass whose only
    addition is to register each instance (the containers behave exactly as before). Reading them
    from the loop's frame instead would not do: on Python < 3.13, ``frame.f_locals`` caches a dict
    holding every local of the running frame — the previous batch's logits among them — until the
    next read, which would keep a batch of logits alive that the Trainer has already dropped.
    """
    trainer_module = eval_container_module()  # None: another layout (warned once), outputs counted as other
    if trainer_module is None:
        yield
        return
    base = trainer_module.EvalLoopContainer

    class RegisteredContainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            found.append(self)

    RegisteredContainer.__name__ = RegisteredContainer.__qualname__ = base.__name__
    trainer_module.EvalLoopContainer = RegisteredContainer
    try:
        yield
    finally:
        trainer_module.EvalLoopContainer = base


def wrap_evaluation_loop(original: Callable[..., Any], watcher: Any) -> Callable[..., Any]:
    """``trainer.evaluation_loop`` for ``watcher`` (the ``MemWatch`` callback), which provides
    ``eval_loop_begin(stage, containers)`` (the list the loop's containers are registered in while it
    runs), ``eval_loop_end(output, error)`` and ``eval_forward_done()``; its faults are its own to
    contain. Installed by :mod:`hf_memwatch.integration.patches`."""

    @functools.wraps(original)
    def evaluation_loop(dataloader: Any, description: str, *args: Any, **kwargs: Any) -> Any:
        containers: list[Any] = []
        watcher.eval_loop_begin(loop_stage(description), containers)
        try:
            with registering_containers(containers):
                output = original(dataloader, description, *args, **kwargs)
        except BaseException as exc:
            watcher.eval_loop_end(None, exc)
            raise
        finally:
            del containers[:]  # never keep the loop's outputs beyond it
        watcher.eval_loop_end(output, None)
        return output

    return evaluation_loop


def wrap_prediction_step(original: Callable[..., Any], watcher: Any) -> Callable[..., Any]:
    """``trainer.prediction_step`` for ``watcher``: ``eval_forward_done()`` after each batch's forward."""

    @functools.wraps(original)
    def prediction_step(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        watcher.eval_forward_done()
        return result

    return prediction_step
