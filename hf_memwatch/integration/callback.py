"""``MemWatch``: the Trainer callback. Thin: Trainer events → :class:`~hf_memwatch.measure.monitor.StepMonitor`.

Timeline records (``<output_dir>/memwatch/timeline.jsonl``) — see README "Timeline":

* ``snapshot`` at ``step_begin``, ``after_forward`` and ``after_backward`` (each micro-batch),
  ``after_optimizer``, ``step_end``: ``allocated``, ``reserved``, ``peak`` (since the previous
  snapshot), ``live`` (weights, gradients, optimizer_states, activations, other — summing to
  ``allocated``), ``spike``, ``allocator_overhead``, ``fragmentation``, ``num_alloc_retries``,
  ``num_ooms``, ``device_free``, ``device_total``, ``host_rss``, ``host_vms``, ``detail`` (full|light).
* ``step`` once per optimizer step: ``peak``, ``peak_phase``, ``dominant``.
* ``peak_tensors`` once per fully tracked CPU step: the largest storages alive at its peak, by module
  and operator (:mod:`hf_memwatch.measure.peak_watch`; ``top_tensors``).
* ``eval`` once per evaluation/prediction loop (snapshots of the loop carry ``stage``: ``eval`` or
  ``predict``; training snapshots have no ``stage``). See :mod:`hf_memwatch.integration.eval_watch`.
* ``leak`` once per class found growing step after step at ``step_end`` (``measure/leaks.py``).
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..core.errors import MemWatchConfigError, is_oom_error, unknown_keywords
from ..core.run_config import RunConfig
from ..core.timeline import TIMELINE_DIRNAME, TimelineWriter
from ..core.units import format_bytes
from ..measure.backends import backend_for
from ..measure.batches import FormedBatches
from ..measure.distributed import make_monitor
from ..measure.leaks import HOST_RSS, LeakWatch
from ..measure.monitor import StepMonitor
from ..measure.peak_tensors import DEFAULT_TOP
from ..planning.budget import remaining, validate_budget
from ..reporting.background import wait_for_report
from ..reporting.oom import (
    prepare_post_mortem,
    start_allocator_history,
    stop_allocator_history,
    write_oom_report,
)
from ..reporting.report import run_meta
from ..reporting.sinks import (
    eval_scalars,
    known_budget,
    known_prediction,
    plan_in_force,
    step_scalars,
    strip_memory_keys,
)
from ..reporting.summary import PICTURE_NAME, finish_reports
from .auto import AutoMode
from .compiled import hook_target, hooks_for, runs_compiled, tracing
from .eval_watch import container_tensors, decoding_step, held_tensors
from .patches import install_entry_points, patches_of, remove_patches
from .trials import TrialPeaks, trial_name

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


def _logging_interval(args: Any, state: Any) -> int:
    """The Trainer's logging interval in optimizer steps (0 when it does not log by steps)."""
    strategy = getattr(args, "logging_strategy", "steps")
    if getattr(strategy, "value", strategy) != "steps":
        return 0
    steps = float(args.logging_steps)
    if 0 < steps < 1:  # a fraction of max_steps
        return max(1, int(steps * max(int(state.max_steps or 0), 1)))
    return int(steps)


class MemWatch(TrainerCallback, ExportableState):
    """Watch where training memory goes, per phase of every optimizer step.

    Args:
        detail: ``"auto"`` (default) tracks in full the first ``full_steps`` optimizer steps and
            every logging step, light elsewhere; ``"full"`` every step; ``"light"`` never in full.
            On the CPU a full step observes every operator (slower); on CUDA it only adds the
            saved-tensor count, the allocator figures are exact either way.
        full_steps: optimizer steps tracked in full at the start of each ``train()`` call (>= 1).
        output_dir: where ``timeline.jsonl`` goes; default ``<args.output_dir>/memwatch``.
        scalars: log ``memory/*`` scalars to the integrations of ``args.report_to`` at logging steps.
        report: draw ``memory.png`` from the timeline at train end (rank 0): ``True`` in a detached
            background process (``train()`` does not wait; :meth:`wait_for_reports` does), ``"sync"``
            before ``train()`` returns, ``False`` not at all (``hf-memwatch report`` draws it later).
        summary: print a table of the peak step's memory classes at train end (rank 0).
        oom_report: write ``oom_report.md`` when training dies of out-of-memory.
        record_history: on CUDA, record the allocator's history (costs time) and dump a snapshot
            for pytorch.org/memory_viz at an OOM.
        auto: plan before training so the step fits ``budget`` (smaller micro-batch with more
            accumulation, activation checkpointing, 8-bit AdamW; effective batch kept), and turn
            checkpointing on between steps when peaks near the budget. See docs/auto.md.
        budget: bytes, a size such as ``"20GiB"``, or a fraction of device memory; default 90% of
            what this process may use.
        top_tensors: storages listed in each full step's ``peak_tensors`` record (the largest alive at
            the step's peak, with the bytes by module and operator; 0: none, no census kept).
        allow_over_budget: with ``auto``, a run that no plan is predicted or measured to fit (or that
            could be neither predicted nor measured) trains as configured with an ERROR line saying how
            far over it is, instead of stopping before training (:class:`PlanError`, the default).

    On CUDA the allocator's peak counters (``torch.cuda.reset_peak_memory_stats``) are reset when a
    run's first step begins and at every snapshot: read the run's peak from :attr:`max_allocated`,
    not ``torch.cuda.max_memory_allocated()``.

    Usage:
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[MemWatch()])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        detail: Detail = "auto",
        full_steps: int = 3,
        output_dir: str | None = None,
        scalars: bool = True,
        report: bool | Literal["sync"] = True,
        summary: bool = True,
        oom_report: bool = True,
        record_history: bool = False,
        auto: bool = False,
        budget: int | float | str | None = None,
        top_tensors: int = DEFAULT_TOP,
        allow_over_budget: bool = False,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise MemWatchConfigError(unknown_keywords("MemWatch", unknown, MemWatch.__init__))
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
        flags = {"scalars": scalars, "summary": summary, "oom_report": oom_report,
                 "record_history": record_history}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise MemWatchConfigError(f"MemWatch({name}=...) must be True or False; got {value!r}")
        if isinstance(top_tensors, bool) or not isinstance(top_tensors, int) or top_tensors < 0:
            raise MemWatchConfigError(f"MemWatch(top_tensors=...) must be an int >= 0; got {top_tensors!r}")
        self.top_tensors = top_tensors
        self.scalars, self.report, self.summary = scalars, report, summary
        self.oom_report, self.record_history = oom_report, record_history
        self.detail = detail
        self.full_steps = full_steps
        self.output_dir = None if output_dir is None else str(output_dir)
        self.monitor: StepMonitor | None = None
        self._trainer_ref: weakref.ReferenceType[Any] | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._report_process: subprocess.Popen | None = None
        self._failed = False
        self._first_step: int | None = None
        self._logging_steps = 0
        self.last_seq_len: int | None = None
        self._eval_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._eval_containers: list[Any] = []  # the running eval loop's EvalLoopContainers
        self._eval_only_timeline = False  # an eval before train() opened the timeline: train appends
        self._eval_logged: dict[str, Any] | None = None  # the eval record whose scalars went out
        self._eval_oom_reported: BaseException | None = None  # an OOM an eval loop already reported
        self._history_started = False  # we started CUDA allocator history (and stop only that)
        self._late_run = False  # added by add_callback mid-construction: the run ends at train end
        self._trial_name: str | None = None  # the hyperparameter_search trial of the run in progress
        self._run_peak: int | None = None  # the highest step peak of the train() call in progress
        self.trials = TrialPeaks()
        self.leaks = LeakWatch()
        if not isinstance(auto, bool):
            raise MemWatchConfigError(f"MemWatch(auto=...) must be True or False; got {auto!r}")
        validate_budget(budget)
        if not isinstance(allow_over_budget, bool):
            raise MemWatchConfigError(f"MemWatch(allow_over_budget=...) must be True or False; got {allow_over_budget!r}")
        self.auto, self.budget = auto, budget
        self._auto = AutoMode(budget, self._record_plan, allow_over_budget=allow_over_budget) if auto else None

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def trainer(self) -> Any:
        return None if self._trainer_ref is None else self._trainer_ref()

    # -- auto mode (logic in hf_memwatch.integration.auto) ----------------------------------------------------
    @property
    def auto_plan(self) -> dict[str, Any] | None:
        """The auto mode's ``plan`` record in force (saved with the callback state, kept on resume)."""
        return None if self._auto is None else self._auto.plan

    @auto_plan.setter
    def auto_plan(self, value: dict[str, Any] | None) -> None:  # the Trainer restoring callback state
        if self._auto is not None:
            self._auto.plan = value

    @property
    def plan(self) -> dict[str, Any] | None:
        return self.auto_plan

    @property
    def max_allocated(self) -> int | None:
        """The highest allocated bytes of the last run's snapshots (its peak), in place of
        ``torch.cuda.max_memory_allocated()``: on CUDA MemWatch resets the allocator's peak counters
        at the run's first step and at every snapshot (each phase's peak is measured that way), so
        the counters read by ``max_memory_allocated()`` hold the last phase's peak, not the run's."""
        return None if self.monitor is None else self.monitor.max_allocated

    @property
    def planning_seconds(self) -> float | None:
        """Seconds the auto mode spent planning before training (None without a plan)."""
        return None if self._auto is None else self._auto.planning_seconds

    @property
    def budget_bytes(self) -> int | None:
        budget = None if self._auto is None else self._auto.budget
        return None if budget is None else budget.total

    def _record_plan(self, record: dict[str, Any]) -> None:
        """Write a ``plan`` record to this rank's timeline (the monitor's writer once training runs)."""
        if self.monitor is not None and self.monitor.writer is not None and self.monitor.writer.is_open:
            self.monitor.writer.write(record)
            self.monitor.writer.flush()
            return
        trainer = self.trainer
        if trainer is None:
            return
        writer = TimelineWriter(self.memwatch_dir(trainer.args), rank=int(getattr(trainer.args, "process_index", 0)))
        writer.write(record)
        writer.close()

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
        """Folder of this run's timeline and reports (a folder per trial in a hyperparameter search)."""
        base = self._base_dir(args)
        return base / self._trial_name if self._trial_name else base

    def _base_dir(self, args: Any) -> Path:
        return Path(self.output_dir) if self.output_dir else Path(args.output_dir) / TIMELINE_DIRNAME

    def _remember_trainer(self, in_train: bool = False) -> None:
        """Bind to the Trainer calling us now and install its entry points (once per Trainer)."""
        trainer = find_trainer()
        if trainer is None:
            trainer = self.trainer
        if trainer is None:
            return
        self._bind(trainer)
        if self.oom_report:
            prepare_post_mortem()
        patches = install_entry_points(trainer, self)
        if self._auto is not None:
            self._auto.installed = True
        if in_train and patches.depth == 0:
            patches.begin()  # added by add_callback after the Trainer was built: this run from here on
            self._late_run = True

    def _bind(self, trainer: Any) -> None:
        """Serve ``trainer`` from now on; a Trainer other than the last one gets a run state of its own."""
        if self.trainer is trainer:
            return
        served_before = self._trainer_ref is not None
        self._trainer_ref = weakref.ref(trainer)
        if not served_before:  # the first Trainer (or a callback rebuilt from checkpoint state)
            return
        self._teardown()
        self.monitor, self._first_step, self._eval_only_timeline = None, None, False
        self.leaks = LeakWatch()
        if self.auto:
            self._auto = AutoMode(self.budget, self._record_plan)

    # -- the run (driven by hf_memwatch.integration.patches) ----------------------------------
    def run_begins(self, trainer: Any) -> None:
        """An entry call (``train``/``evaluate``/``predict``) of ``trainer`` starts."""
        self._bind(trainer)

    def train_call(self, trainer: Any, call: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """The Trainer's ``train`` (``call``), planned first in the auto mode."""
        self._trial_name = trial_name(trainer, kwargs.get("trial"))
        if self._auto is not None:
            return self._auto.train_call(trainer, call, args, kwargs)
        return call(*args, **kwargs)

    def run_ended(self, trainer: Any, error: BaseException | None) -> None:
        """The outermost entry call returned or raised: close all the run opened (dispatch mode,
        saved-tensor hooks, module hooks, the timeline file, the allocator history)."""
        self._teardown()
        for handle in self._eval_hooks:
            handle.remove()
        self._eval_hooks.clear()
        self._eval_containers = []
        if self._history_started:
            stop_allocator_history()
            self._history_started = False

    def detach(self, trainer: Any = None) -> None:
        """Stop watching ``trainer`` (default: the one served last): every patch of ours removed."""
        trainer = trainer if trainer is not None else self.trainer
        if trainer is not None:
            remove_patches(trainer)

    def memory_scalars(self, step: int) -> dict[str, int] | None:
        """``memory/*`` figures of optimizer step ``step`` when it was the last one measured."""
        monitor = self.monitor
        if self._failed or monitor is None or not monitor.last_step or monitor.last_step["step"] != step:
            return None
        return step_scalars(
            monitor.last_step,
            monitor.step_snapshots,
            budget=known_budget(self),
            predicted_peak=known_prediction(self),
            leak_bytes_per_step=self.leaks.rate,
        )

    def on_oom(self, exc: BaseException) -> None:
        """An out-of-memory error leaves ``train()``: the post-mortem, then nothing of ours stays on."""
        trainer = self.trainer
        eval_reported = self._eval_oom_reported is exc  # an eval loop's report stands
        if trainer is not None and self.monitor is not None and not eval_reported:
            write_oom_report(
                self.memwatch_dir(trainer.args), exc, self.monitor, trainer,
                seq_len=self.last_seq_len, plan=self.plan_in_force(),
            )
        self._teardown()
        if self._history_started:
            stop_allocator_history()
            self._history_started = False

    def plan_in_force(self) -> dict[str, Any] | None:
        """The auto mode's plan record when one is in force."""
        return plan_in_force(self)

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
            "args": {
                "detail": self.detail, "full_steps": self.full_steps, "output_dir": self.output_dir,
                "auto": self.auto, "budget": self.budget,
                **({"allow_over_budget": True} if self._auto is not None and self._auto.allow_over_budget else {}),
                "scalars": self.scalars, "report": self.report, "summary": self.summary,
                "oom_report": self.oom_report, "record_history": self.record_history,
                "top_tensors": self.top_tensors,
            },
            "attributes": {"auto_plan": self.auto_plan} if self.auto_plan else {},
        }

    # -- Trainer events ---------------------------------------------------------------------
    @_guarded
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remember_trainer()  # the train entry point plans inside train(), before the loop is built

    @_guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._remember_trainer(in_train=True)
        if self._auto is not None:
            self._auto.check_installed()
        self._teardown()
        self._failed = False
        self._first_step, self._run_peak = None, None
        self.leaks = LeakWatch()
        self._logging_steps = _logging_interval(args, state)
        rank = int(getattr(args, "process_index", 0))
        backend = backend_for(torch.device(args.device))
        # A run from step 0 starts its timeline anew (the auto mode's plan, decided inside train()
        # before this event, is written again); a resumed run appends to the one it continues.
        fresh = state.global_step == 0 and not self._eval_only_timeline
        self._eval_only_timeline = False
        writer = TimelineWriter(self.memwatch_dir(args), rank=rank, fresh=fresh)
        if fresh and self._auto is not None:
            for record in self._auto.timeline_records():
                writer.write(record)
        # Under DDP/DeepSpeed the monitor also counts the engine's buckets and partitions.
        self.monitor = make_monitor(backend, writer, rank, self.trainer)
        self.monitor.peaks.set_top(self.top_tensors)
        self.monitor.peaks.history = self.record_history
        self.monitor.attach(model, kwargs.get("optimizer"))
        if backend.observes_operators and kwargs.get("train_dataloader") is not None:
            # the look-ahead batch, the step's loss divisor and running loss
            self.monitor.add_contributor(FormedBatches(kwargs["train_dataloader"], self.trainer))
        writer.write(run_meta(model, RunConfig.from_args(args, model)))  # model and batch, for the picture's title and the summary
        if self.record_history:
            self._history_started = start_allocator_history(self.monitor)
        self.monitor.compiled = runs_compiled(self.trainer, model)
        if model is not None:
            # On the compiled wrapper when there is one: its hooks run outside the compiled code.
            target = hook_target(model, getattr(self.trainer, "model_wrapped", None))
            before, after = hooks_for(target, self._before_forward_hook, self._after_forward_hook)
            self._hooks.append(target.register_forward_pre_hook(before, with_kwargs=True))
            self._hooks.append(target.register_forward_hook(after))

    def _before_forward_hook(self, module: Any, args: Any, kwargs: Any) -> None:
        if not tracing():  # traced by Dynamo (a module compiled in place): add nothing to its graph
            self._before_forward(module, args, kwargs)

    def _after_forward_hook(self, module: Any, args: Any, output: Any) -> None:
        if not tracing():
            self._after_forward(module, args, output)

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
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2 and not decoding_step(kwargs):
            self.last_seq_len = int(ids.shape[-1])  # for the OOM post-mortem's estimates
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

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step_end()
        if self._auto is not None:
            # Not guarded by this rank's monitoring state: every rank of a distributed run joins the
            # between-step agreement of the first steps, whatever its own monitoring did.
            try:
                self._auto.agree_between_steps(self.trainer)
            except Exception as exc:  # noqa: BLE001 - the plan in force stays; training goes on
                logger.warning("hf-memwatch: the ranks did not agree between steps (%s: %s); the plan stays",
                               type(exc).__name__, exc)

    @_guarded
    def _step_end(self) -> None:
        if self.monitor is not None and self.monitor.in_step:
            record = self.monitor.end_step()
            if isinstance(record.get("peak"), int):
                self._run_peak = max(self._run_peak or 0, record["peak"])
            self._watch_leaks()
            if self._auto is not None:
                self._auto.after_step(self.trainer, self.monitor.last_step, self.monitor.step_snapshots)

    def _watch_leaks(self) -> None:
        """After each step end: a class growing step after step is written once and warned about once."""
        monitor = self.monitor
        if monitor is None or not monitor.step_snapshots:
            return
        for finding in self.leaks.observe(monitor.step, monitor.step_snapshots[-1], self._leak_headroom):
            if monitor.writer is not None:
                monitor.writer.write({**finding, "rank": monitor.rank})
                monitor.writer.flush()
            when = (f"; at this rate out of memory near step {finding['predicted_oom_step']}"
                    if finding["predicted_oom_step"] is not None else "")
            logger.warning(
                "hf-memwatch: %s grows %s per step at step end since step %d (a leak: tensors or objects kept "
                "across steps?)%s",
                finding["class"], format_bytes(finding["bytes_per_step"]), finding["since_step"], when,
            )

    def _leak_headroom(self, name: str) -> int | None:
        """Bytes left before the limit for ``name``: the budget above the last peak, else the real limit."""
        monitor = self.monitor
        if monitor is None:
            return None
        budget, peak = known_budget(self), (monitor.last_step or {}).get("peak")
        if name != HOST_RSS and budget is not None and peak is not None:
            return int(budget) - int(peak)
        try:  # a prediction only: an unreadable limit must not stop the monitoring
            return remaining(backend_for(torch.device("cpu")) if name == HOST_RSS else monitor.backend)
        except (OSError, RuntimeError, ValueError):
            return None

    @_guarded
    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        # The integrations have the memory keys by now; the progress printer (added last) runs next.
        strip_memory_keys(logs)

    # -- evaluation loops (driven by hf_memwatch.integration.eval_watch) -----------------------
    @_guarded
    def eval_loop_begin(self, stage: str, containers: list[Any]) -> None:
        """An ``evaluate()``/``predict()`` loop starts: open its peak window (and a monitor if none).

        ``containers`` fills with the loop's ``EvalLoopContainer``s as the Trainer creates them.
        """
        self._eval_containers = containers
        trainer = self.trainer
        if trainer is None:
            return
        monitor = self._monitor_for_eval(trainer)
        monitor.begin_eval(stage, int(trainer.state.global_step), written_batches=self.full_steps)
        model = trainer.model
        if isinstance(model, torch.nn.Module) and monitor.backend.tracking:
            self._eval_hooks.append(model.register_forward_pre_hook(self._eval_inputs, with_kwargs=True))

    def _monitor_for_eval(self, trainer: Any) -> StepMonitor:
        """The training monitor while it is open; else one for this loop, appending to the timeline."""
        monitor = self.monitor
        if monitor is not None and monitor.writer is not None and monitor.writer.is_open:
            return monitor
        args = trainer.args
        rank = int(getattr(args, "process_index", 0))
        fresh = monitor is None  # the first thing this callback writes: a new timeline
        writer = TimelineWriter(self.memwatch_dir(args), rank=rank, fresh=fresh)
        self._eval_only_timeline = self._eval_only_timeline or fresh
        self.monitor = make_monitor(backend_for(torch.device(args.device)), writer, rank, trainer)
        self.monitor.attach(trainer.model, trainer.optimizer)
        return self.monitor

    @_guarded
    def _eval_inputs(self, module: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2 and not decoding_step(kwargs):
            self.last_seq_len = int(ids.shape[-1])  # for the OOM post-mortem's estimates
        monitor = self.monitor
        if monitor is not None and monitor.eval is not None:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors.extend(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            monitor.register_inputs(tensors)

    @_guarded
    def eval_forward_done(self) -> None:
        """After each batch's no-grad forward (``prediction_step`` returned)."""
        monitor = self.monitor
        if monitor is not None and monitor.eval is not None:
            monitor.eval_snapshot("eval_forward", container_tensors(self._eval_containers))

    @_guarded
    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        monitor = self.monitor
        if monitor is not None and monitor.eval is not None:  # the containers hold the batch now
            monitor.eval_snapshot("eval_accumulated", container_tensors(self._eval_containers))
            monitor.eval.batch += 1

    @_guarded
    def eval_loop_end(self, output: Any, error: BaseException | None) -> None:
        """The loop returned ``output`` (an ``EvalLoopOutput``) or raised ``error``."""
        for handle in self._eval_hooks:
            handle.remove()
        self._eval_hooks.clear()
        monitor = self.monitor
        if monitor is None or monitor.eval is None:
            return
        loop = monitor.eval
        if output is not None:
            held = list(held_tensors((getattr(output, "predictions", None), getattr(output, "label_ids", None))))
        elif error is not None:
            held = container_tensors(self._eval_containers)
        else:
            held = []
        del self._eval_containers[:]  # the loop's own list: nothing of ours keeps its outputs
        record = monitor.end_eval(held, batches=loop.batch)
        del held  # the post-mortem's estimator may need the memory
        trainer = self.trainer
        if error is None or record is None or not self.oom_report or trainer is None or not is_oom_error(error):
            return
        from ..reporting.eval_oom import write_eval_oom_report

        self._eval_oom_reported = error
        write_eval_oom_report(self.memwatch_dir(trainer.args), error, record, loop.last, trainer,
                              seq_len=self.last_seq_len, writer=monitor.writer)

    def eval_scalars(self) -> dict[str, int] | None:
        """``memory/eval_*`` figures of the eval loop that just ended (once per loop)."""
        monitor = self.monitor
        record = None if self._failed or monitor is None else monitor.last_eval
        if record is None or record is self._eval_logged or record.get("stage") != "eval":
            return None
        self._eval_logged = record
        return eval_scalars(record)

    @_guarded
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._teardown()
        if self._history_started:
            stop_allocator_history()
            self._history_started = False
        if state.is_world_process_zero and self.monitor is not None:
            self._report_process = finish_reports(self, args, state)
        if self._trial_name is not None and state.is_world_process_zero:
            self.trials.record(self._trial_name, self._run_peak)
            self.trials.write(self._base_dir(args))
            logger.info(self.trials.summary_line())
            if self.summary:
                print(self.trials.summary_line())
        patches = None if self.trainer is None else patches_of(self.trainer)
        if self._late_run and patches is not None:
            self._late_run = False
            patches.end(None)

    def wait_for_reports(self, timeout: float | None = 120.0) -> Path | None:
        """Wait for the picture being drawn in the background; its path once written, else None.

        ``train()`` returns before ``memory.png`` exists (``report=True``); call this when the next
        thing needs the file (a test, a notebook cell showing it). Immediate with ``report="sync"``.
        """
        process = self._report_process
        if process is not None:
            if not wait_for_report(process, timeout):
                return None  # still drawing (kept: a later call waits again) or failed (memory.png.log)
            self._report_process = None
        trainer = self.trainer
        if trainer is None:
            return None
        path = self.memwatch_dir(trainer.args) / PICTURE_NAME
        return path if path.exists() else None
