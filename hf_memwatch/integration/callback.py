"""``MemWatch``: the Trainer callback. Thin: Trainer events → the run's
:class:`~hf_memwatch.integration.session.RunSession` (writer, monitor, leak watch, eval state).

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

import logging
import subprocess
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..core.categories import AFTER_BACKWARD, AFTER_FORWARD, AFTER_OPTIMIZER
from ..core.errors import MemWatchConfigError, is_oom_error, unknown_keywords
from ..core.records import PlanRecord, Record
from ..core.timeline import TIMELINE_DIRNAME
from ..measure.peak_tensors import DEFAULT_TOP
from ..planning.budget import validate_budget
from ..reporting.background import wait_for_report
from ..reporting.context import KnownPlan
from ..reporting.oom import prepare_post_mortem, write_oom_report
from ..reporting.sinks import eval_scalars, run_before_printer, strip_memory_keys
from ..reporting.summary import PICTURE_NAME, TABLE_NAME, finish_reports
from .auto import AutoMode
from .compiled import tracing
from .options import check_options, find_trainer, guarded
from .patches import install_entry_points, patches_of, remove_patches
from .session import RunSession, open_timeline, rank_of
from .trials import TrialPeaks, trial_name

logger = logging.getLogger("hf_memwatch")

Detail = Literal["auto", "full", "light"]
__all__ = ["Detail", "MemWatch", "find_trainer"]
# The constructor arguments saved with the callback state (a resumed run rebuilds MemWatch from them).
_STATE_ARGS = ("detail", "full_steps", "output_dir", "auto", "budget", "scalars", "report", "summary", "oom_report",
               "record_history", "top_tensors")


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
        check_options(detail, full_steps, output_dir, report, top_tensors,
                       {"scalars": scalars, "summary": summary, "oom_report": oom_report,
                        "record_history": record_history, "auto": auto, "allow_over_budget": allow_over_budget})
        validate_budget(budget)
        self.top_tensors = top_tensors
        self.scalars, self.report, self.summary = scalars, report, summary
        self.oom_report, self.record_history = oom_report, record_history
        self.detail = detail
        self.full_steps = full_steps
        self.output_dir = None if output_dir is None else str(output_dir)
        self.session: RunSession | None = None  # the run being watched (kept, closed, after it ends)
        self._trainer_ref: weakref.ReferenceType[Any] | None = None
        self._report_process: subprocess.Popen | None = None
        self._failed = False
        self._eval_only_timeline = False  # an eval before train() opened the timeline: train appends
        self._late_run = False  # added by add_callback mid-construction: the run ends at train end
        self._trial_name: str | None = None  # the hyperparameter_search trial of the run in progress
        self.trials = TrialPeaks()
        self.auto, self.budget, self.allow_over_budget = auto, budget, allow_over_budget
        self._auto = self._new_auto_mode()

    def _new_auto_mode(self) -> AutoMode | None:
        if not self.auto:
            return None
        return AutoMode(self.budget, self._record_plan, allow_over_budget=self.allow_over_budget)

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def trainer(self) -> Any:
        return None if self._trainer_ref is None else self._trainer_ref()

    @property
    def monitor(self) -> Any:
        """The step monitor of the run watched last (None before any)."""
        return None if self.session is None else self.session.monitor

    @property
    def last_seq_len(self) -> int | None:
        """The sequence length of the last forward watched (for the OOM post-mortem's estimates)."""
        return None if self.session is None else self.session.last_seq_len

    # -- auto mode (logic in hf_memwatch.integration.auto) ----------------------------------------------------
    @property
    def auto_plan(self) -> dict[str, Any] | None:
        """The auto mode's ``plan`` record in force, as the timeline writes it (saved with the callback
        state, kept on resume)."""
        plan = None if self._auto is None else self._auto.plan
        return None if plan is None else plan.to_dict()

    @auto_plan.setter
    def auto_plan(self, value: dict[str, Any] | None) -> None:  # the Trainer restoring callback state
        if self._auto is not None:
            self._auto.plan = None if value is None else PlanRecord.from_dict(value)

    @property
    def plan(self) -> dict[str, Any] | None:
        return self.auto_plan

    @property
    def max_allocated(self) -> int | None:
        """The highest allocated bytes of the last run's snapshots (its peak), in place of
        ``torch.cuda.max_memory_allocated()``: on CUDA MemWatch resets the allocator's peak counters
        at the run's first step and at every snapshot (each phase's peak is measured that way), so
        the counters read by ``max_memory_allocated()`` hold the last phase's peak, not the run's."""
        return None if self.session is None else self.session.monitor.max_allocated

    @property
    def planning_seconds(self) -> float | None:
        """Seconds the auto mode spent planning before training (None without a plan)."""
        return None if self._auto is None else self._auto.planning_seconds

    @property
    def budget_bytes(self) -> int | None:
        budget = None if self._auto is None else self._auto.budget
        return None if budget is None else budget.total

    def known_plan(self) -> KnownPlan:
        """What reporting reads of the plan: the auto mode's budget and plan record."""
        return KnownPlan(budget=self.budget_bytes, plan=None if self._auto is None else self._auto.plan)

    def plan_in_force(self) -> dict[str, Any] | None:
        """The auto mode's plan record when one is in force."""
        return self.known_plan().plan_dict()

    def _record_plan(self, record: Record) -> None:
        """Write a record of the auto mode to this rank's timeline (the session's writer once training runs)."""
        session = self.session
        if session is not None and session.is_open:
            session.monitor.writer.write(record)
            session.monitor.writer.flush()
            return
        trainer = self.trainer
        if trainer is not None:
            open_timeline(self.memwatch_dir(trainer.args), rank_of(trainer.args), fresh=False,
                          records=[record]).close()

    def _fail(self, exc: BaseException, where: str) -> None:
        self._failed = True
        logger.warning("hf-memwatch: internal error in %s (%s: %s); memory monitoring is off for the rest of this "
                       "run, training continues.", where, type(exc).__name__, exc)
        self._close_session()

    def _close_session(self) -> None:
        if self.session is not None:
            self.session.close()

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
        if in_train and patches.depth == 0:  # added by add_callback after the Trainer was built
            if self._auto is not None:
                self._auto.check_planned()  # raises before anything of this run is installed
            patches.begin()  # this run from here on
            self._late_run = True

    def _bind(self, trainer: Any) -> None:
        """Serve ``trainer`` from now on; a Trainer other than the last one gets a run state of its own."""
        if self.trainer is trainer:
            return
        served_before = self._trainer_ref is not None
        self._trainer_ref = weakref.ref(trainer)
        if not served_before:  # the first Trainer (or a callback rebuilt from checkpoint state)
            return
        self._close_session()
        self.session, self._eval_only_timeline = None, False
        self._auto = self._new_auto_mode()

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
        self._close_session()

    def detach(self, trainer: Any = None) -> None:
        """Stop watching ``trainer`` (default: the one served last): every patch of ours removed."""
        trainer = trainer if trainer is not None else self.trainer
        if trainer is not None:
            remove_patches(trainer)

    def memory_scalars(self, step: int) -> dict[str, int] | None:
        """``memory/*`` figures of optimizer step ``step`` when it was the last one measured."""
        if self._failed or self.session is None:
            return None
        return self.session.memory_scalars(step, self.known_plan())

    def on_oom(self, exc: BaseException) -> None:
        """An out-of-memory error leaves ``train()``: the post-mortem, then nothing of ours stays on."""
        trainer, session = self.trainer, self.session
        if trainer is not None and session is not None and session.eval.oom_reported is not exc:  # an eval loop's report stands
            write_oom_report(self.memwatch_dir(trainer.args), exc, session.monitor, trainer,
                             seq_len=session.last_seq_len, plan=self.known_plan().plan)
        self._close_session()

    def is_full_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based, global) is tracked in full."""
        session = self.session
        if session is None:
            return self.detail != "light"
        return session.is_full_step(step, self.detail, self.full_steps)

    # -- ExportableState --------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "args": {
                **{name: getattr(self, name) for name in _STATE_ARGS},
                **({"allow_over_budget": True} if self._auto is not None and self._auto.allow_over_budget else {}),
            },
            "attributes": {"auto_plan": self.auto_plan} if self.auto_plan else {},
        }

    # -- Trainer events ---------------------------------------------------------------------
    @guarded
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remember_trainer()  # the train entry point plans inside train(), before the loop is built

    @guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._remember_trainer(in_train=True)
        run_before_printer(getattr(self.trainer, "callback_handler", None), self)  # add_callback: after it
        self._close_session()
        self._failed = False
        # A run from step 0 starts its timeline anew (the auto mode's plan, decided inside train()
        # before this event, is written again); a resumed run appends to the one it continues.
        fresh = state.global_step == 0 and not self._eval_only_timeline
        self._eval_only_timeline = False
        self.session = RunSession.for_training(
            self.trainer, self.memwatch_dir(args), args, state, {**kwargs, "model": model}, fresh=fresh,
            records=self._auto.timeline_records() if self._auto is not None else (),
            top_tensors=self.top_tensors, record_history=self.record_history)
        if model is not None:
            self.session.hook_forward(self.trainer, model, self._before_forward_hook, self._after_forward_hook)

    def _before_forward_hook(self, module: Any, args: Any, kwargs: Any) -> None:
        if not tracing():  # traced by Dynamo (a module compiled in place): add nothing to its graph
            self._before_forward(module, args, kwargs)

    def _after_forward_hook(self, module: Any, args: Any, output: Any) -> None:
        if not tracing():
            self._after_forward(module, args, output)

    @guarded
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None:
            self.session.begin_step(state.global_step + 1, kwargs.get("optimizer"), self.detail, self.full_steps)

    @guarded
    def batch_samples_fetched(self, fetched: Any) -> None:
        if self.session is not None:
            self.session.batch_samples_fetched(fetched)

    @guarded
    def _before_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        if (session := self.session) is not None:
            session.register_inputs(args, kwargs, active=session.monitor.in_step and session.monitor.backend.tracking)

    @guarded
    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        if self.session is not None:
            self.session.snapshot(AFTER_FORWARD, grad_only=True)

    @guarded
    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None:
            self.session.snapshot(AFTER_BACKWARD, next_micro_step=True)

    @guarded
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None:
            self.session.snapshot(AFTER_BACKWARD)

    @guarded
    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self.session
        if session is not None and session.monitor.in_step:
            session.attach_optimizer(kwargs.get("optimizer"))
            session.monitor.snapshot(AFTER_OPTIMIZER)

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

    @guarded
    def _step_end(self) -> None:
        session = self.session
        if session is None:
            return
        record = session.end_step(self.known_plan().budget_bytes)
        if record is not None and self._auto is not None:
            self._auto.after_step(self.trainer, session.monitor.last_step, session.monitor.step_snapshots)

    @guarded
    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        # The integrations have the memory keys by now; the progress printer (added last) runs next.
        strip_memory_keys(logs)

    # -- evaluation loops (driven by hf_memwatch.integration.eval_watch) -----------------------
    @guarded
    def eval_loop_begin(self, stage: str, containers: list[Any]) -> None:
        """An ``evaluate()``/``predict()`` loop starts: open its peak window (and a session if none is open).

        ``containers`` fills with the loop's ``EvalLoopContainer``s as the Trainer creates them.
        """
        trainer = self.trainer
        if trainer is None:
            return
        self._session_for_eval(trainer).begin_eval(trainer, stage, containers, self.full_steps, self._eval_inputs)

    def _session_for_eval(self, trainer: Any) -> RunSession:
        """The training session while it is open; else one for this loop, appending to the timeline."""
        if self.session is not None and self.session.is_open:
            return self.session
        fresh = self.session is None  # the first thing this callback writes: a new timeline
        self._eval_only_timeline = self._eval_only_timeline or fresh
        self.session = RunSession.for_eval(trainer, self.memwatch_dir(trainer.args), fresh=fresh)
        return self.session

    @guarded
    def _eval_inputs(self, module: Any, args: Any, kwargs: Any) -> None:
        session = self.session
        if session is not None:
            session.register_inputs(args, kwargs, active=session.monitor.eval is not None)

    @guarded
    def eval_forward_done(self) -> None:
        """After each batch's no-grad forward (``prediction_step`` returned)."""
        if self.session is not None:
            self.session.eval_snapshot("eval_forward")

    @guarded
    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is not None:  # the containers hold the batch now
            self.session.eval_snapshot("eval_accumulated", batch_done=True)

    @guarded
    def eval_loop_end(self, output: Any, error: BaseException | None) -> None:
        """The loop returned ``output`` (an ``EvalLoopOutput``) or raised ``error``."""
        session = self.session
        if session is None:
            return
        record, last = session.end_eval(output, error)
        trainer = self.trainer
        if error is None or record is None or not self.oom_report or trainer is None or not is_oom_error(error):
            return
        from ..reporting.eval_oom import write_eval_oom_report

        session.eval.oom_reported = error
        write_eval_oom_report(self.memwatch_dir(trainer.args), error, record, last, trainer,
                              seq_len=session.last_seq_len, writer=session.monitor.writer)

    def eval_scalars(self) -> dict[str, int] | None:
        """``memory/eval_*`` figures of the eval loop that just ended (once per loop)."""
        session = self.session
        record = None if self._failed or session is None else session.monitor.last_eval
        if record is None or record is session.eval.logged or record.stage != "eval":
            return None
        session.eval.logged = record
        return eval_scalars(record)

    @guarded
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close_session()
        if state.is_world_process_zero and self.session is not None:
            self._report_process = finish_reports(self.memwatch_dir(args), self.report, self.summary,
                                                  self.known_plan().plan)
        if self._trial_name is not None and state.is_world_process_zero:
            self.trials.record(self._trial_name, None if self.session is None else self.session.run_peak)
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
        if (trainer := self.trainer) is None:
            return None
        folder = self.memwatch_dir(trainer.args)  # memory.png, or the steps table without matplotlib
        return next((p for p in (folder / PICTURE_NAME, folder / TABLE_NAME) if p.exists()), None)
