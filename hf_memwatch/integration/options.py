"""What every ``MemWatch`` handler and constructor goes through: :func:`guarded` (no fault of ours
kills a run: an internal error is logged once and monitoring stops), :func:`check_options` (one
clear :class:`~hf_memwatch.core.errors.MemWatchConfigError` per bad argument), :func:`find_trainer`.

Example:
    >>> check_options("full", 3, None, True, 20, {"scalars": True})
    >>> check_options("some", 3, None, True, 20, {})
    Traceback (most recent call last):
    ...
    hf_memwatch.core.errors.MemWatchConfigError: MemWatch(detail=...) must be 'auto', 'full' or 'light'; got 'some'
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from ..compat.stack import check_stack
from ..core.errors import MemWatchConfigError

_F = TypeVar("_F", bound=Callable[..., Any])
Detail = Literal["auto", "full", "light"]  # MemWatch(detail=...)
# The constructor arguments saved with the callback state (a resumed run rebuilds MemWatch from them).
STATE_ARGS = ("detail", "full_steps", "output_dir", "auto", "budget", "scalars", "report", "summary", "oom_report",
              "record_history", "top_tensors")


def guarded(method: _F) -> _F:
    """Run a monitoring handler so that no fault of ours can kill the training run."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._failed:
            return None
        try:
            return method(self, *args, **kwargs)
        except MemWatchConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - monitoring must degrade, never kill training
            self._fail(exc, method.__name__)
            return None

    return wrapper  # type: ignore[return-value]


def find_trainer() -> Any:
    """The ``transformers.Trainer`` whose code is calling us, found on the call stack (or None)."""
    from transformers import Trainer

    frame = inspect.currentframe()
    frame = frame.f_back if frame is not None else None
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def check_options(detail: Any, full_steps: Any, output_dir: Any, report: Any, top_tensors: Any,
                   flags: dict[str, Any]) -> None:
    """:class:`MemWatchConfigError` with one message for the first invalid constructor argument
    (or for a required library older than its verified range: :mod:`hf_memwatch.compat.versions`)."""
    check_stack()
    if detail not in ("auto", "full", "light"):
        raise MemWatchConfigError(f"MemWatch(detail=...) must be 'auto', 'full' or 'light'; got {detail!r}")
    if isinstance(full_steps, bool) or not isinstance(full_steps, int) or full_steps < 1:
        raise MemWatchConfigError(
            f"MemWatch(full_steps=...) must be an int >= 1 (the auto mode plans from the first "
            f"tracked steps); got {full_steps!r}"
        )
    if output_dir is not None and not isinstance(output_dir, (str, Path)):
        raise MemWatchConfigError(f"MemWatch(output_dir=...) must be a path; got {output_dir!r}")
    if report not in (True, False, "sync"):
        raise MemWatchConfigError(f"MemWatch(report=...) must be True or False (or 'sync'); got {report!r}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise MemWatchConfigError(f"MemWatch({name}=...) must be True or False; got {value!r}")
    if isinstance(top_tensors, bool) or not isinstance(top_tensors, int) or top_tensors < 0:
        raise MemWatchConfigError(f"MemWatch(top_tensors=...) must be an int >= 0; got {top_tensors!r}")
