"""``RunSession``: what one run of a Trainer holds while MemWatch watches it — the timeline writer,
the step monitor, the leak watch, the forward hooks, the eval loop's state and the CUDA allocator
history — with one lifetime: opened at train begin (or by an eval loop outside ``train()``),
closed by :meth:`RunSession.close` on every exit path (``train()`` returning or raising, an OOM, an
internal fault). A closed session keeps its figures (``max_allocated``, the last step) for reading.

:class:`~hf_memwatch.integration.callback.MemWatch` maps the Trainer's callback events onto it.

Timeline records it writes (``<output_dir>/memwatch/timeline.jsonl``): ``meta`` at train begin,
``snapshot``/``step``/``peak_tensors``/``eval`` through the monitor, ``leak`` once per class found
growing (:meth:`RunSession.watch_leaks`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..compat.trainer import probe_trainer
from ..core.records import EvalRecord, Record, Snapshot, StepRecord
from ..core.run_config import RunConfig
from ..core.timeline import TimelineWriter
from ..core.units import format_bytes
from ..engines.registry import make_monitor
from ..estimation.kernel_workspaces import run_cpu_kernel
from ..measure.backends import AllocatorBackend, CpuTrackedBackend, backend_for
from ..measure.batches import FormedBatches
from ..measure.leaks import HOST_RSS, LeakWatch
from ..measure.monitor import StepMonitor
from ..planning.budget import remaining
from ..reporting.allocator_history import start_allocator_history, stop_allocator_history
from ..reporting.context import PlanFacts
from ..reporting.report import run_meta
from ..reporting.sinks import step_scalars
from .compiled import hook_target, hooks_for, runs_compiled
from .eval_watch import container_tensors, decoding_step, held_tensors

logger = logging.getLogger("hf_memwatch")


def open_timeline(directory: str | Path, rank: int, *, fresh: bool,
                  records: Iterable[Record] = ()) -> TimelineWriter:
    """This rank's timeline writer (the one place one is opened), with ``records`` written first."""
    writer = TimelineWriter(directory, rank=rank, fresh=fresh)
    for record in records:
        writer.write(record)
    return writer


def live_backend(device: torch.device) -> AllocatorBackend:
    """The allocator backend a run is watched with; on the CPU its tracker also counts what built-in
    kernels allocate inside themselves (:func:`~hf_memwatch.estimation.kernel_workspaces.run_cpu_kernel`,
    the estimate's rules, a product measured on its own call): MemWatch's live peak of bf16 draws read
    up to 2.67% under the profiler without it (oneDNN's packed operand blocks), 0.894% with it (150
    draws) (``benchmarks/results/sweep.md``)."""
    backend = backend_for(device)
    if isinstance(backend, CpuTrackedBackend):
        backend.tracker.kernel_call = run_cpu_kernel
    return backend


def rank_of(args: Any) -> int:
    return int(getattr(args, "process_index", 0))


def logging_interval(args: Any, state: Any) -> int:
    """The Trainer's logging interval in optimizer steps (0 when it does not log by steps)."""
    strategy = getattr(args, "logging_strategy", "steps")
    if getattr(strategy, "value", strategy) != "steps":
        return 0
    steps = float(args.logging_steps)
    if 0 < steps < 1:  # a fraction of max_steps
        return max(1, int(steps * max(int(state.max_steps or 0), 1)))
    return int(steps)


@dataclass
class EvalState:
    """The eval loop in progress: its forward hook, the Trainer's output containers, what was reported."""

    hooks: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)
    containers: list[Any] = field(default_factory=list)  # the running loop's EvalLoopContainers
    logged: EvalRecord | None = None  # the eval record whose scalars went out
    oom_reported: BaseException | None = None  # an OOM an eval loop already reported

    def remove_hooks(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()


class RunSession:
    """One run's measuring state, from :meth:`for_training`/:meth:`for_eval` to :meth:`close`."""

    def __init__(self, monitor: StepMonitor, *, training: bool) -> None:
        self.monitor = monitor
        self.training = training  # opened at train begin (not by an eval loop outside train())
        self.leaks = LeakWatch(rank=monitor.rank)
        self.eval = EvalState()
        self.hooks: list[torch.utils.hooks.RemovableHandle] = []
        self.history_started = False  # we started CUDA allocator history (and stop only that)
        self.first_step: int | None = None
        self.run_peak: int | None = None  # the highest step peak of the train() call in progress
        self.logging_steps = 0
        self.last_seq_len: int | None = None  # for the OOM post-mortem's estimates
        self.formed: FormedBatches | None = None  # the batches formed before the step's operators

    # -- opening --------------------------------------------------------------------------------
    @classmethod
    def for_training(cls, trainer: Any, directory: Path, args: Any, state: Any, event: dict[str, Any], *,
                     fresh: bool, records: Iterable[Record], top_tensors: int,
                     record_history: bool) -> RunSession:
        """The session of a ``train()`` call, opened at ``on_train_begin`` (``event``: its keywords, the
        model, optimizer and train dataloader): ``records`` (the auto mode's plan) start a fresh
        timeline; a resumed run appends to the one it continues."""
        model, optimizer, dataloader = event.get("model"), event.get("optimizer"), event.get("train_dataloader")
        backend = live_backend(torch.device(args.device))
        writer = open_timeline(directory, rank_of(args), fresh=fresh, records=records if fresh else ())
        # Under DDP/DeepSpeed the monitor also counts the engine's buckets and partitions.
        session = cls(make_monitor(backend, writer, rank_of(args), trainer), training=True)
        monitor = session.monitor
        monitor.peaks.set_top(top_tensors)
        monitor.peaks.history = record_history
        monitor.attach(model, optimizer)
        if backend.observes_operators and dataloader is not None:
            # the look-ahead batch, the step's loss divisor and running loss
            session.formed = FormedBatches(dataloader, trainer)
            monitor.add_contributor(session.formed)
        writer.write(run_meta(model, RunConfig.from_args(args, model), probe_trainer(trainer)))  # title, summary, degraded
        session.logging_steps = logging_interval(args, state)
        if record_history:
            session.history_started = start_allocator_history(monitor)
        monitor.compiled = runs_compiled(trainer, model)
        return session

    @classmethod
    def for_eval(cls, trainer: Any, directory: Path, *, fresh: bool) -> RunSession:
        """The session of an eval loop outside ``train()``, appending to the timeline unless ``fresh``."""
        args = trainer.args
        writer = open_timeline(directory, rank_of(args), fresh=fresh)
        session = cls(make_monitor(live_backend(torch.device(args.device)), writer, rank_of(args), trainer),
                      training=False)
        session.monitor.attach(trainer.model, trainer.optimizer)
        return session

    @property
    def is_open(self) -> bool:
        writer = self.monitor.writer
        return writer is not None and writer.is_open

    def hook_forward(self, trainer: Any, model: Any, before: Any, after: Any) -> None:
        """``before``/``after`` around each forward of ``model`` (on its compiled wrapper when there is
        one: the hooks run outside the compiled code)."""
        target = hook_target(model, getattr(trainer, "model_wrapped", None))
        pre, post = hooks_for(target, before, after)
        self.hooks.append(target.register_forward_pre_hook(pre, with_kwargs=True))
        self.hooks.append(target.register_forward_hook(post))

    # -- during the run -------------------------------------------------------------------------
    def batch_samples_fetched(self, fetched: Any) -> None:
        """What the Trainer's ``get_batch_samples`` returned (the step's micro-batches, ``num_items_in_batch``)."""
        if self.formed is not None:
            self.formed.remember(fetched)

    def register_inputs(self, args: Any, kwargs: dict[str, Any], *, active: bool) -> None:
        """A forward's inputs: the sequence length kept; the tensors registered with the tracker when ``active``."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2 and not decoding_step(kwargs):
            self.last_seq_len = int(ids.shape[-1])
        if active:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors.extend(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            self.monitor.register_inputs(tensors)

    def begin_step(self, step: int, optimizer: Any, detail: str, full_steps: int) -> None:
        """Optimizer step ``step`` (1-based, global) begins: tracked in full or light (:meth:`is_full_step`)."""
        if self.first_step is None:
            self.first_step = step
        self.attach_optimizer(optimizer)
        self.monitor.begin_step(step, full=self.is_full_step(step, detail, full_steps))

    def attach_optimizer(self, optimizer: Any) -> None:
        if optimizer is not None and self.monitor.optimizer is None:
            self.monitor.attach(self.monitor.model, optimizer)

    def snapshot(self, phase: str, *, grad_only: bool = False, next_micro_step: bool = False) -> None:
        """A snapshot of the step in progress at ``phase`` (none outside a step; with ``grad_only``
        none in a no-grad forward); ``next_micro_step`` moves to the next micro-batch after it."""
        monitor = self.monitor
        if not monitor.in_step or (grad_only and not torch.is_grad_enabled()):
            return
        monitor.snapshot(phase)
        if next_micro_step:
            monitor.micro_step += 1

    # -- evaluation loops -----------------------------------------------------------------------
    def begin_eval(self, trainer: Any, stage: str, containers: list[Any], written_batches: int,
                   input_hook: Any) -> None:
        """An eval loop starts: its peak window; ``input_hook`` on the model while the tracker runs."""
        self.eval.containers = containers
        monitor = self.monitor
        monitor.begin_eval(stage, int(trainer.state.global_step), written_batches=written_batches)
        model = trainer.model
        if isinstance(model, torch.nn.Module) and monitor.backend.tracking:
            self.eval.hooks.append(model.register_forward_pre_hook(input_hook, with_kwargs=True))

    def eval_snapshot(self, phase: str, *, batch_done: bool = False) -> None:
        """A snapshot of the eval loop in progress (none outside one), with the outputs it holds."""
        loop = self.monitor.eval
        if loop is not None:
            self.monitor.eval_snapshot(phase, container_tensors(self.eval.containers))
            if batch_done:
                loop.batch += 1

    def end_eval(self, output: Any, error: BaseException | None) -> tuple[EvalRecord | None, Snapshot | None]:
        """The loop returned ``output`` or raised ``error``: (its ``eval`` record, its last snapshot),
        (None, None) outside a loop. Nothing of ours keeps the loop's outputs afterwards."""
        self.eval.remove_hooks()
        loop = self.monitor.eval
        if loop is None:
            return None, None
        if output is not None:
            held = list(held_tensors((getattr(output, "predictions", None), getattr(output, "label_ids", None))))
        elif error is not None:
            held = container_tensors(self.eval.containers)
        else:
            held = []
        del self.eval.containers[:]  # the loop's own list
        record = self.monitor.end_eval(held, batches=loop.batch)
        return record, loop.last

    def end_step(self, budget: int | None) -> StepRecord | None:
        """Close the step in progress (its ``step`` record), then look for leaks."""
        if not self.monitor.in_step:
            return None
        record = self.monitor.end_step()
        if isinstance(record.peak, int):
            self.run_peak = max(self.run_peak or 0, record.peak)
        self.watch_leaks(budget)
        return record

    def memory_scalars(self, step: int, known: PlanFacts) -> dict[str, int] | None:
        """``memory/*`` figures of optimizer step ``step`` when it was the last one measured."""
        last = self.monitor.last_step
        if last is None or last.step != step:
            return None
        return step_scalars(last, self.monitor.step_snapshots, budget=known.budget_bytes,
                            predicted_peak=known.predicted_peak, leak_bytes_per_step=self.leaks.rate)

    def watch_leaks(self, budget: int | None) -> None:
        """After each step end: a class growing step after step is written once and warned about once."""
        monitor = self.monitor
        if not monitor.step_snapshots:
            return
        for finding in self.leaks.observe(monitor.step, monitor.step_snapshots[-1],
                                          lambda name: self._leak_headroom(name, budget)):
            if monitor.writer is not None:
                monitor.writer.write(finding)
                monitor.writer.flush()
            when = (f"; at this rate out of memory near step {finding.predicted_oom_step}"
                    if finding.predicted_oom_step is not None else "")
            logger.warning(
                "hf-memwatch: %s grows %s per step at step end since step %d (a leak: tensors or objects kept "
                "across steps?)%s",
                finding.klass, format_bytes(finding.bytes_per_step), finding.since_step, when,
            )

    def _leak_headroom(self, name: str, budget: int | None) -> int | None:
        """Bytes left before the limit for ``name``: the budget above the last peak, else the real limit."""
        peak = None if self.monitor.last_step is None else self.monitor.last_step.peak
        if name != HOST_RSS and budget is not None and peak is not None:
            return int(budget) - int(peak)
        try:  # a prediction only: an unreadable limit must not stop the monitoring
            return remaining(backend_for(torch.device("cpu")) if name == HOST_RSS else self.monitor.backend)
        except (OSError, RuntimeError, ValueError):
            return None

    def is_full_step(self, step: int, detail: str, full_steps: int) -> bool:
        """Whether optimizer step ``step`` (1-based, global) is tracked in full."""
        if detail == "full":
            return True
        if detail == "light":
            return False
        first = self.first_step if self.first_step is not None else step
        if step - first < full_steps:
            return True
        return bool(self.logging_steps) and step % self.logging_steps == 0

    # -- closing --------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook, stop the dispatch mode and the history, close the timeline (idempotent)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        self.eval.remove_hooks()
        self.eval.containers = []
        try:
            self.monitor.close()
        except Exception:  # noqa: BLE001 - maybe already failing; closing must not raise
            pass
        self.stop_history()

    def stop_history(self) -> None:
        if self.history_started:
            stop_allocator_history()
            self.history_started = False
