"""Errors of hf-memwatch, classified in one place.

``MemWatchConfigError`` is raised eagerly for bad arguments; ``is_oom_error`` recognises
out-of-memory failures of every allocator the Trainer may run on (same messages accelerate checks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class MemWatchError(Exception):
    """Base class of errors raised by hf-memwatch."""


class MemWatchConfigError(MemWatchError, ValueError):
    """A configuration value cannot work; the message says which and why."""


def unknown_keywords(owner: str, unknown: dict[str, Any], function: Callable[..., Any]) -> str:
    """One line naming the unknown keywords, the closest of ``function``'s keywords to each, and them all.

    Example:
        >>> def f(*, auto=False, budget=None, **unknown): ...
        >>> unknown_keywords("MemWatch", {"budjet": 1}, f)
        "MemWatch() got an unknown keyword 'budjet' (did you mean 'budget'?); it takes: auto, budget"
    """
    import difflib
    import inspect

    known = [name for name, parameter in inspect.signature(function).parameters.items()
             if name != "self" and parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)]
    names = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, known, n=1)
        names.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    plural = "s" if len(names) > 1 else ""
    return f"{owner}() got an unknown keyword{plural} {', '.join(names)}; it takes: {', '.join(known)}"


class PlanError(MemWatchError, RuntimeError):
    """No remedy can make the configured run fit the memory budget."""


_OOM_MESSAGES = (
    "CUDA out of memory.",  # CUDA
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # CUDNN
    "DefaultCPUAllocator: can't allocate memory",  # CPU
    "DefaultCPUAllocator: not enough memory",  # CPU, Windows
    "XPU out of memory.",  # XPU
    "MPS backend out of memory",  # MPS
    "out of memory",  # NPU, MLU, HPU and friends
)


def is_oom_error(exc: BaseException) -> bool:
    """True when ``exc`` is an out-of-memory failure of an allocator.

    Example:
        >>> is_oom_error(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ..."))
        True
    """
    import torch

    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    if isinstance(exc, RuntimeError) and exc.args:
        text = str(exc.args[0])
        return any(message in text for message in _OOM_MESSAGES)
    return False
