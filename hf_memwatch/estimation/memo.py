"""Sub-results shared by the estimates of one planning question: the same figures, built once.

A plan weighs several estimates of the same model that differ only in the run's settings (micro-batch,
accumulation, checkpointing, optimizer). Each estimate used to build its own fake model (for a
Llama-3.1-70B-shaped config, 80 decoder layers instantiated under ``FakeTensorMode``: about 40% of a
warm estimate's CPU time). Inside :func:`sharing`, the estimates of a config, a config path or a built
module reuse one fake model and its ``FakeTensorMode`` (:func:`built_model`) — the replay leaves the
model as it found it (:func:`~hf_memwatch.estimation.replay.model_in_mode` and
:func:`~hf_memwatch.estimation.layers.truncated` put everything back; the gradients a forward/backward
only replay leaves are dropped here), so every figure is the one a fresh model gives, byte for byte
(tests/test_memo.py, benchmarks/planning_cost.py check it).

Not shared: a Trainer (its replay swaps its own models for fakes) and a run with an engine
(FSDP2's and ZeRO's flows wrap the model's modules).

:data:`SHORTCUTS` switches every planning shortcut off — here, and the chooser's floors
(:mod:`hf_memwatch.planning.chooser`), the short model (:mod:`hf_memwatch.estimation.short_model`) with the predictor's step floor (:mod:`hf_memwatch.planning.predict`)
— for the benchmark's side-by-side run of the old path (``benchmarks/planning_cost.py``) and the
byte-identity tests: ``with shortcuts(False): ...``.

Example:
    >>> with sharing() as cache:
    ...     active() is cache
    True
    >>> active() is None
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

SHORTCUTS = True  # False: every estimate built and replayed as without the planning shortcuts

_ACTIVE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hf_memwatch_memo", default=None)


def shortcuts_on() -> bool:
    """Whether the planning shortcuts are on (read at call time: :func:`shortcuts` switches them)."""
    return SHORTCUTS


@contextlib.contextmanager
def shortcuts(enabled: bool) -> Iterator[None]:
    """The planning shortcuts on or off for the duration (the old path, for side-by-side checks)."""
    global SHORTCUTS
    kept = SHORTCUTS
    SHORTCUTS = enabled
    try:
        yield
    finally:
        SHORTCUTS = kept


@contextlib.contextmanager
def sharing(cache: dict | None = None) -> Iterator[dict]:
    """Estimates made inside share their fake models (``cache``: one kept by the caller across calls)."""
    cache = {} if cache is None else cache
    token = _ACTIVE.set(cache)
    try:
        yield cache
    finally:
        _ACTIVE.reset(token)


def active() -> dict | None:
    """The cache of the :func:`sharing` block in force (None: outside one)."""
    return _ACTIVE.get()


def built_model(subject: Any, request: Any, build: Callable[[], tuple]) -> tuple:
    """``build()`` (a fresh ``(fake_mode, model, config, task)``), or the one an earlier estimate of the
    same subject, task and adapter built inside this :func:`sharing` block."""
    cache = _ACTIVE.get()
    if cache is None or not SHORTCUTS or not shareable(subject, request):
        return build()
    adapter = None if request.adapter is None else os.fspath(request.adapter)
    key = (id(subject), request.task, repr(request.lora), adapter, repr(request.quantization))
    if key not in cache:
        cache[key] = (subject, build(), {})  # the subject held: its id stays its own
    built = cache[key][1]
    for model in _models(built):
        _drop_gradients(model)
    return built


def kept_with(model: torch.nn.Module) -> dict | None:
    """What estimates of the shared fake ``model`` keep for each other inside this :func:`sharing` block
    (:mod:`~hf_memwatch.estimation.optimizer_swap`'s records); None where ``model`` is not one it shares."""
    cache = _ACTIVE.get()
    if cache is None or not SHORTCUTS:
        return None
    # a short model's full build keeps none: its records are of another depth (estimation/short_model.py)
    return next((kept for _, built, kept in cache.values() if built[1] is model), None)


def shareable(subject: Any, request: Any) -> bool:
    """A config, a path or a built module, without an engine (whose flows wrap the model)."""
    from .trainer_replay import is_trainer

    return not is_trainer(subject) and request.engine is None


def _models(built: tuple) -> list[torch.nn.Module]:
    """The fake models of a build: its model and, where that is a short model, its full build once made
    (:mod:`~hf_memwatch.estimation.short_model`)."""
    short = built[4]
    full = None if short is None else short.built_full
    return [built[1]] if full is None else [built[1], full]


def _drop_gradients(model: torch.nn.Module) -> None:
    """What a forward/backward-only replay left (every replay starts from ``zero_grad(set_to_none)``)."""
    for param in model.parameters():
        param.grad = None
