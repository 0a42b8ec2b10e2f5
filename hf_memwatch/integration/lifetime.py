"""What a ``MemWatch`` keeps for the lifetime of the run it serves: the Trainer it is bound to, the run's
:class:`~hf_memwatch.integration.session.RunSession` (opened and closed here), the auto mode made for that
Trainer, the folder its files go to, the trial of a hyperparameter search, the post-mortem and the picture
drawn in the background. The base of :class:`~hf_memwatch.integration.callback.MemWatch`, which adapts the
Trainer's events to it; the entry points of :mod:`hf_memwatch.integration.patches` call it too
(``run_begins``, ``train_call``, ``run_ended``, ``on_oom``, ``memory_scalars``, ``is_full_step``).
"""

from __future__ import annotations

import logging
import subprocess
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.records import PlanRecord, Record
from ..core.timeline import TIMELINE_DIRNAME
from ..reporting.background import wait_for_report
from ..reporting.context import KnownPlan
from ..reporting.oom import prepare_post_mortem, write_oom_report
from ..reporting.sinks import eval_scalars
from ..reporting.summary import PICTURE_NAME, TABLE_NAME
from .auto import AutoMode
from .options import find_trainer
from .patches import install_entry_points, remove_patches
from .session import RunSession, open_timeline, rank_of
from .trials import TrialPeaks, trial_name

logger = logging.getLogger("hf_memwatch")


class WatchedRun:
    """The run a ``MemWatch`` serves, from the Trainer it binds to until the session closes.

    The options it reads (``detail``, ``full_steps``, ``output_dir``, ``oom_report``) are the callback's
    (:class:`~hf_memwatch.integration.callback.MemWatch` declares them); ``auto``, ``budget`` and
    ``allow_over_budget`` make a new :class:`AutoMode` for each Trainer served.
    """

    detail: str
    full_steps: int
    output_dir: str | None
    oom_report: bool

    def __init__(self, auto: bool, budget: Any, allow_over_budget: bool) -> None:
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

    def _session_for_eval(self, trainer: Any) -> RunSession:
        """The training session while it is open; else one for this loop, appending to the timeline."""
        if self.session is not None and self.session.is_open:
            return self.session
        fresh = self.session is None  # the first thing this callback writes: a new timeline
        self._eval_only_timeline = self._eval_only_timeline or fresh
        self.session = RunSession.for_eval(trainer, self.memwatch_dir(trainer.args), fresh=fresh)
        return self.session

    def eval_scalars(self) -> dict[str, int] | None:
        """``memory/eval_*`` figures of the eval loop that just ended (once per loop)."""
        session = self.session
        record = None if self._failed or session is None else session.monitor.last_eval
        if record is None or record is session.eval.logged or record.stage != "eval":
            return None
        session.eval.logged = record
        return eval_scalars(record)

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
