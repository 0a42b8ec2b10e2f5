"""``MemWatch``: the Trainer callback. Thin: Trainer events → the run's
:class:`~hf_memwatch.integration.session.RunSession` (writer, monitor, leak watch, eval state).

Split by ownership: this module adapts the Trainer's events (``on_*``, the forward hooks, the eval loop's
calls) and saves the callback state; :mod:`hf_memwatch.integration.lifetime` (:class:`WatchedRun`, the base)
keeps what lives as long as the run served — the bound Trainer, the session, the auto mode, the reports;
:mod:`hf_memwatch.integration.options` checks the constructor's options and names those saved with the state.

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
from typing import Any, Literal

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..core.categories import AFTER_BACKWARD, AFTER_FORWARD, AFTER_OPTIMIZER
from ..core.errors import MemWatchConfigError, PlanError, is_oom_error, unknown_keywords
from ..measure.peak_tensors import DEFAULT_TOP
from ..planning.budget import validate_budget
from ..reporting.sinks import run_before_printer, strip_memory_keys
from ..reporting.summary import finish_reports
from .compiled import tracing
from .lifetime import WatchedRun
from .options import STATE_ARGS, Detail, check_options, find_trainer, guarded
from .patches import patches_of
from .session import RunSession

logger = logging.getLogger("hf_memwatch")

__all__ = ["Detail", "MemWatch", "find_trainer"]


class MemWatch(TrainerCallback, ExportableState, WatchedRun):
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
        WatchedRun.__init__(self, auto, budget, allow_over_budget)  # the Trainer served, its session, the auto mode

    # -- ExportableState --------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "args": {
                **{name: getattr(self, name) for name in STATE_ARGS},
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

    def batch_samples_fetched(self, fetched: Any) -> None:
        self._batch_samples_fetched(fetched)
        if self._auto is not None:
            # A stream read by dataloader workers: a longer micro-batch is predicted on before its step;
            # where no plan fits, the PlanError stops the run (the step not taken), a fault of ours does not.
            try:
                self._auto.longer_fetched(self.trainer, fetched)
            except PlanError:
                raise
            except Exception as exc:  # noqa: BLE001 - the plan in force stays; training goes on
                logger.warning("hf-memwatch: the fetched micro-batches were not predicted on (%s: %s); the plan stays",
                               type(exc).__name__, exc)

    @guarded
    def _batch_samples_fetched(self, fetched: Any) -> None:
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
            try:  # a stream read ahead on several ranks: the longest sample agreed (every few steps)
                self._auto.agree_longer_sample(self.trainer)
            except Exception as exc:  # noqa: BLE001 - the plan in force stays; training goes on
                logger.warning("hf-memwatch: the ranks' longest sample read ahead was not predicted on (%s: %s); "
                               "the plan stays, not known to fit that sample", type(exc).__name__, exc)

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
