"""The one replay frame: a training step, an evaluation loop and generation are its modes.

Every estimate replays Trainer code on a fake model — :mod:`.step` the optimizer step,
:mod:`.eval_loop` the evaluation loop, whose prediction step is the model's forward or, in the
generation mode, ``generate`` (:mod:`.generation`). What the modes share lives here, once:

* :func:`new_tracker`: the fake-CPU tracker that counts the replay's storages (every target is
  replayed on fake CPU tensors; a CUDA target's storages rounded up to the caching allocator's
  512-byte blocks);
* :func:`model_in_mode`: the model as the mode's Trainer code runs it — ``train()`` or ``eval()``,
  ``config.use_cache`` as ``Trainer.__init__`` sets it (``args.use_cache``, default False), and
  under mixed precision accelerate's autocast wrapper around ``forward`` (CPU autocast, casting as
  CUDA autocast does for a CUDA target: :mod:`.cuda_autocast`) — put back on every exit path (the
  same fake model is replayed again at other depths);
* :func:`tracked`: warnings silenced, transformers' masks as the real batch takes them, the fake
  mode and the tracker entered, and for a CUDA target the CUDA kernel paths
  (:func:`~hf_memwatch.estimation.cuda_kernels.cuda_kernel_paths`: fused dropout, SDPA's CUDA
  backend from :mod:`~hf_memwatch.estimation.cuda_sdpa`).

Example:
    >>> from hf_memwatch.estimation.request import EstimateRequest
    >>> mode_of(EstimateRequest(predict_with_generate=True, generation_max_length=8)).name, TRAINING.training
    ('generation', True)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..compat.torch_dispatcher import overrides_autocast
from ..measure.saved_tensors import SavedTensorRegistry
from .cuda_autocast import cuda_autocast_policy
from .cuda_kernels import cuda_kernel_paths
from .fake_dispatch import CUDA_BLOCK, EstimateTracker
from .trainer_mirror import (
    MIXED_DTYPES,
    disable_kv_cache,
    real_batch_masks,
    restore_forward,
    restore_kv_cache,
    wrap_autocast,
)

REPLAY_DEVICE = "cpu"  # every target is replayed on fake CPU tensors (fake CUDA tensors need a CUDA build)


@dataclass(frozen=True)
class ReplayMode:
    """A mode of the replay: what it replays and the model state its Trainer code runs in."""

    name: str
    training: bool


TRAINING = ReplayMode("training", training=True)  # the optimizer step (:mod:`.step`)
EVALUATION = ReplayMode("evaluation", training=False)  # the eval loop, a forward per batch (:mod:`.eval_loop`)
GENERATION = ReplayMode("generation", training=False)  # the eval loop, ``generate`` per batch (:mod:`.generation`)


def mode_of(request: Any) -> ReplayMode:
    """The eval loop's mode for ``request``: generation with ``predict_with_generate`` (unless
    ``prediction_loss_only``, where the Trainer takes the plain prediction step), else evaluation."""
    return GENERATION if request.generation is not None and not request.prediction_loss_only else EVALUATION


def new_tracker(request: Any, saved: SavedTensorRegistry | None = None, *, bnb_cpu_kernels: bool = False
                ) -> EstimateTracker:
    """The tracker of one replay (``saved``: the registry of tensors saved for backward)."""
    tracker = EstimateTracker(REPLAY_DEVICE, saved if saved is not None else SavedTensorRegistry(),
                              round_to=CUDA_BLOCK if request.device == "cuda" else 1, bnb_cpu_kernels=bnb_cpu_kernels)
    tracker.gpu = getattr(request, "gpu", None) if request.device == "cuda" else None
    return tracker


@contextlib.contextmanager
def model_in_mode(model: torch.nn.Module, request: Any, mode: ReplayMode, use_cache: bool = False) -> Iterator[None]:
    """``model`` in ``mode``'s state (see the module doc) for the duration; everything put back after."""
    was_training = model.training
    model.train(mode.training)
    saved_forward = model.__dict__.get("forward")
    saved_use_cache = disable_kv_cache(model)
    if use_cache and hasattr(getattr(model, "config", None), "use_cache"):
        model.config.use_cache = True
    if request.precision in MIXED_DTYPES:  # a CUDA target is replayed on fake CPU tensors: CPU autocast
        wrap_autocast(model, REPLAY_DEVICE, request.precision)
    cuda_casts = request.device == "cuda" and request.precision in MIXED_DTYPES  # ... casting as CUDA's does
    cuda_casts = cuda_casts and overrides_autocast()  # compat.torch_dispatcher: else CPU autocast's, warned
    try:
        with cuda_autocast_policy() if cuda_casts else contextlib.nullcontext():
            yield
    finally:
        restore_forward(model, saved_forward)
        restore_kv_cache(model, saved_use_cache)
        model.train(was_training)


@contextlib.contextmanager
def tracked(fake_mode: Any, tracker: EstimateTracker, packed: bool = False, padded: bool = False) -> Iterator[None]:
    """The replay's dispatch: warnings silenced, the real batch's masks (``packed``/``padded``:
    :func:`~hf_memwatch.estimation.trainer_mirror.real_batch_masks`), the fake mode, the tracker."""
    paths = cuda_kernel_paths(tracker.gpu) if tracker.gpu is not None else contextlib.nullcontext()
    with warnings.catch_warnings(), real_batch_masks(packed, padded), fake_mode, tracker, paths:
        warnings.simplefilter("ignore")
        yield
