"""``MemWatch``: the Trainer callback. Thin: Trainer events → :class:`~hf_memwatch.monitor.StepMonitor`.

Timeline records (``<output_dir>/memwatch/timeline.jsonl``) — see README "Timeline":

* ``snapshot`` at ``step_begin``, ``after_forward`` and ``after_backward`` (each micro-batch),
  ``after_optimizer``, ``step_end``: ``allocated``, ``reserved``, ``peak`` (since the previous
  snapshot), ``live`` (weights, gradients, optimizer_states, activations, other — summing to
  ``allocated``), ``spike``, ``allocator_overhead``, ``fragmentation``, ``num_alloc_retries``,
  ``num_ooms``, ``device_free``, ``device_total``, ``detail`` (full|light).
* ``step`` once per optimizer step: ``peak``, ``peak_phase``, ``dominant``.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .backends import backend_for
from .errors import MemWatchConfigError
from .monitor import StepMonitor
from .timeline import TIMELINE_DIRNAME, TimelineWriter

logger = logging.getLogger("hf_memwatch")

Detail = Literal["auto", "full", "light"]
_F = TypeVar("_F", bound=Callable[..., Any])


def _guarded(method: _F) -> _F:
    """Run a monitoring handler so that no fault of ours can kill the training run."""

    @functools.wraps(method)
    def wrapper(self: MemWatch, *args: Any, **kwargs: Any) -> Any:
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

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


class MemWatch(TrainerCallback, ExportableState):
    """Watch where training memory goes, per phase of every optimizer step.

    Args:
        detail: ``"auto"`` (default) tracks in full the first ``full_steps`` optimizer steps and
            every logging step, light elsewhere; ``"full"`` every step; ``"light"`` never in full.
            On the CPU a full step observes every operator (slower); on CUDA it only adds the
            saved-tensor count, the allocator figures are exact either way.
        full_steps: optimizer steps tracked in full at the start of each ``train()`` call (>= 1).
        output_dir: where ``timeline.jsonl`` goes; default ``<args.output_dir>/memwatch``.

    Usage:
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[MemWatch()])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        detail: Detail = "auto",
        full_steps: int = 3,
        output_dir: str | None = None,
    ) -> None:
        if detail not in ("auto", "full", "light"):
            raise MemWatchConfigError(f"MemWatch(detail=...) must be 'auto', 'full' or 'light'; got {detail!r}")
        if isinstance(full_steps, bool) or not isinstance(full_steps, int) or full_steps < 1:
            raise MemWatchConfigError(
                f"MemWatch(full_steps=...) must be an int >= 1 (the auto mode plans from the first "
                f"tracked steps); got {full_steps!r}"
            )
        if output_dir is not None and not isinstance(output_dir, (str, Path)):
            raise MemWatchConfigError(f"MemWatch(output_dir=...) must be a path; got {output_dir!r}")
        self.detail = detail
        self.full_steps = full_steps
        self.output_dir = None if output_dir is None else str(output_dir)
        self.monitor: StepMonitor | None = None
        self._trainer_ref: weakref.ReferenceType[Any] | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._failed = False
        self._first_step: int | None = None
        self._logging_steps = 0

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def trainer(self) -> Any:
        return None if self._trainer_ref is None else self._trainer_ref()

    def _fail(self, exc: BaseException, where: str) -> None:
        self._failed = True
        logger.warning(
            "hf-memwatch: internal error in %s (%s: %s); memory monitoring is off for the rest of this run, "
            "training continues.",
            where,
            type(exc).__name__,
            exc,
        )
        self._teardown()

    def _teardown(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self.monitor is not None:
            try:
                self.monitor.close()
            except Exception:  # noqa: BLE001 - already failing; closing must not raise
                pass

    def memwatch_dir(self, args: Any) -> Path:
        """Folder of this run's timeline and reports."""
        return Path(self.output_dir) if self.output_dir else Path(args.output_dir) / TIMELINE_DIRNAME

    def _remember_trainer(self) -> None:
        if self.trainer is None:
            trainer = find_trainer()
            if trainer is not None:
                self._trainer_ref = weakref.ref(trainer)

    def is_full_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based, global) is tracked in full."""
        if self.detail == "full":
            return True
        if self.detail == "light":
            return False
        first = self._first_step if self._first_step is not None else step
        if step - first < self.full_steps:
            return True
        return bool(self._logging_steps) and step % self._logging_steps == 0

    # -- ExportableState --------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "args": {"detail": self.detail, "full_steps": self.full_steps, "output_dir": self.output_dir},
            "attributes": {},
        }

    # -- Trainer events ---------------------------------------------------------------------
    @_guarded
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remember_trainer()

    @_guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._remember_trainer()
        self._teardown()
        self._failed = False
        self._first_step = None
        self._logging_steps = (
            int(args.logging_steps) if str(getattr(args, "logging_strategy", "steps")).endswith("steps") else 0
        )
        if self._logging_steps and self._logging_steps < 1:  # a fraction of max_steps
            self._logging_steps = max(1, int(args.logging_steps * max(state.max_steps, 1)))
        rank = int(getattr(args, "process_index", 0))
        backend = backend_for(torch.device(args.device))
        writer = TimelineWriter(self.memwatch_dir(args), rank=rank)
        self.monitor = StepMonitor(backend, writer, rank=rank)
        self.monitor.attach(model, kwargs.get("optimizer"))
        if model is not None:
            self._hooks.append(model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
            self._hooks.append(model.register_forward_hook(self._after_forward))

    @_guarded
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        monitor = self.monitor
        if monitor is None:
            return
        step = state.global_step + 1
        if self._first_step is None:
            self._first_step = step
        if kwargs.get("optimizer") is not None and monitor.optimizer is None:
            monitor.attach(monitor.model, kwargs["optimizer"])
        monitor.begin_step(step, full=self.is_full_step(step))

    @_guarded
    def _before_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        monitor = self.monitor
        if monitor is not None and monitor.in_step and monitor.backend.tracking:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors.extend(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            monitor.register_inputs(tensors)

    @_guarded
    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        if self.monitor is not None and self.monitor.in_step and torch.is_grad_enabled():
            self.monitor.snapshot("after_forward")

    @_guarded
    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None and self.monitor.in_step:
            self.monitor.snapshot("after_backward")
            self.monitor.micro_step += 1

    @_guarded
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None and self.monitor.in_step:
            self.monitor.snapshot("after_backward")

    @_guarded
    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        monitor = self.monitor
        if monitor is not None and monitor.in_step:
            if kwargs.get("optimizer") is not None and monitor.optimizer is None:
                monitor.attach(monitor.model, kwargs["optimizer"])
            monitor.snapshot("after_optimizer")

    @_guarded
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None and self.monitor.in_step:
            self.monitor.end_step()

    @_guarded
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._teardown()
