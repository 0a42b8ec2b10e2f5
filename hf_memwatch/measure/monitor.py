"""Snapshots of one training process's memory at the phases of each optimizer step.

:class:`StepMonitor` is what the callback drives: ``begin_step`` → ``snapshot(phase)`` … →
``end_step``. It owns the allocator backend, the saved-tensor registry and the timeline writer, and
turns each reading into a timeline record with :func:`~hf_memwatch.measure.attribution.split_live`.
Records stay typed (:mod:`hf_memwatch.core.records`) from here to the writer, which alone serialises
them: a contributor corrects a :class:`Snapshot`'s fields, the session and the sinks read them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from ..core.categories import LIVE_CLASSES, STEP_BEGIN, STEP_END
from ..core.records import EvalRecord, Record, Snapshot, StepRecord
from ..core.timeline import TimelineWriter
from .attribution import (
    dominant_class,
    gradient_storages,
    optimizer_state_storages,
    spike_above,
    split_live,
    unwrap_optimizer,
    weight_storages,
    weight_tensors,
)
from .backends import AllocatorBackend
from .footprint import host_sizes
from .peak_watch import PeakWatch
from .saved_tensors import SavedTensorRegistry
from .storage import collect_storages, nested_tensors


class StorageContributor(Protocol):
    """What a distributed engine (DDP buckets, DeepSpeed partitions) holds on a rank, for the monitor."""

    def known_tensors(self, monitor: StepMonitor) -> Iterable[torch.Tensor | None]:
        """Tensors allocated before tracking started, registered at each fully tracked step."""
        ...

    def class_storages(self, monitor: StepMonitor) -> Mapping[str, Mapping[int, int]]:
        """Storage key -> bytes held per class (``weights``, ``gradients``, ``optimizer_states``)."""
        ...

    def adjust(self, record: Snapshot, monitor: StepMonitor, phase: str, window_peak: int | None) -> None:
        """Correct a full snapshot ``record`` for bytes the tracker could not see (may do nothing)."""
        ...


class StepMonitor:
    """Per-phase snapshots with attribution, written to a timeline.

    ``full`` steps track everything (on the CPU every operator is observed, on every device the
    saved-for-backward tensors are counted); other steps are ``light``: the allocator's own figures
    where it keeps them, and the class split of the last full step at the same phase.

    ``compiled`` (set by the callback when the model runs under ``torch.compile``): a backend that
    observes operators through a dispatch mode (the CPU) must not enter it, because Dynamo runs no
    compiled frame while a ``TorchDispatchMode`` is active — tracking would switch compilation off.
    Its full steps then count what is visible from outside the compiled code (weights, gradients,
    optimizer states, tensors saved for backward) and are marked ``detail: "compiled"``, with
    ``allocated``, ``peak`` and ``other`` unknown (null).
    """

    def __init__(
        self,
        backend: AllocatorBackend,
        writer: TimelineWriter | None,
        rank: int = 0,
        extra_gradients: Callable[[], Iterable[torch.Tensor]] | None = None,
    ) -> None:
        self.backend = backend
        self.writer = writer
        self.rank = rank
        self.device = backend.device
        self.saved = SavedTensorRegistry()
        self.extra_gradients = extra_gradients
        self.model: torch.nn.Module | None = None
        self.optimizer: Any = None
        self.attached_optimizer: Any = None
        self.step = 0
        self.micro_step = 0
        self.full = False
        self.in_step = False
        self.compiled = False
        self.step_snapshots: list[Snapshot] = []
        self.last_step: StepRecord | None = None
        self._previous_allocated: int | None = None
        self.contributors: list[StorageContributor] = []
        self._last_full: dict[tuple[str, int], Snapshot] = {}
        self.eval: EvalLoopState | None = None  # the evaluation loop in progress, if any
        self.last_eval: EvalRecord | None = None  # the last loop's ``eval`` record
        self._after_eval = False
        self.peaks = PeakWatch(backend, self.saved)  # the tensors at each full step's peak (peak_tensors)
        self._last_classes: tuple[dict[int, int], ...] | None = None
        self._window_open = False  # the peak counter was reset for this run (at its first step)
        self.max_allocated: int | None = None  # the highest peak of the run's snapshots

    # -- lifecycle --------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module | None, optimizer: Any) -> None:
        self.model = model
        self.attached_optimizer = optimizer  # as handed over (a ZeRO optimizer under DeepSpeed)
        self.optimizer = unwrap_optimizer(optimizer) if optimizer is not None else None
        self.peaks.attach(model, self.optimizer)

    def begin_step(self, step: int, full: bool) -> Snapshot:
        self.step, self.micro_step, self.full, self.in_step = step, 0, full, True
        self.step_snapshots = []
        if not self._window_open:  # the run's first step: not the peak of model loading or an earlier run
            self.backend.reset_peak()
            self._window_open = True
        if self._after_eval:  # what an eval loop left until evaluate() returned is not this step's
            self.backend.reset_peak()
            self._after_eval = False
        if full:
            self._register_known()
            if not self._untracked_compiled_step():
                self.backend.start_tracking()
            self.saved.start()
        self.peaks.begin_step(full and self.backend.tracking, full)
        return self.snapshot(STEP_BEGIN)

    def end_step(self) -> StepRecord:
        last = self.snapshot(STEP_END)
        self.stop_tracking()
        self.in_step = False
        peak_snapshot = max(self.step_snapshots, key=lambda s: s.peak if s.peak is not None else -1)
        record = StepRecord(
            step=self.step,
            rank=self.rank,
            peak=peak_snapshot.peak,
            peak_phase=peak_snapshot.phase,
            peak_micro_step=peak_snapshot.micro_step,
            dominant=dominant_class(peak_snapshot.live, peak_snapshot.spike),
            detail=self._detail(),
            live_at_peak=peak_snapshot.live,
            spike_at_peak=peak_snapshot.spike,
            reserved=last.reserved,
        )
        self.last_step = record
        self._write(record)
        peak_tensors = self.peaks.end_step(self.step, self.rank)
        if peak_tensors is not None:
            self._write(peak_tensors)
        if self.writer is not None:
            self.writer.flush()
        return record

    def stop_tracking(self) -> None:
        self.peaks.stop()
        self.saved.stop()
        self.backend.stop_tracking()

    def close(self) -> None:
        self.stop_tracking()
        for contributor in self.contributors:  # what a contributor installed (a collator wrapper) goes
            getattr(contributor, "close", lambda: None)()
        if self.writer is not None:
            self.writer.close()

    # -- snapshots --------------------------------------------------------------------------
    def register_inputs(self, tensors: Iterable[torch.Tensor]) -> None:
        """A batch built before tracking started (the Trainer prefetches) is counted from here on."""
        if self.backend.tracking:
            self.backend.register(tensors)

    def add_contributor(self, contributor: StorageContributor) -> None:
        """Count what ``contributor`` (a distributed engine) holds on this rank in every full snapshot."""
        self.contributors.append(contributor)

    @property
    def previous_allocated(self) -> int | None:
        """``allocated`` of the previous snapshot (None before the first)."""
        return self._previous_allocated

    def _untracked_compiled_step(self) -> bool:
        """A full step of a compiled model on a backend that would need its dispatch mode."""
        return self.full and self.compiled and self.backend.observes_operators

    def _detail(self) -> str:
        if self._untracked_compiled_step():
            return "compiled"
        return "full" if self.full else "light"

    def snapshot(self, phase: str) -> Snapshot:
        micro_step = self.micro_step
        if self._untracked_compiled_step():
            record = self._compiled_snapshot(phase, micro_step)
            self._last_full[(phase, micro_step)] = record
        elif self.full:
            record = self.measure(phase, micro_step)
            self._last_full[(phase, micro_step)] = record
            self.peaks.observe(record, self._last_classes)
        else:
            record = self._light_snapshot(phase, micro_step)
        self.backend.reset_peak()
        if isinstance(record.peak, int):
            self.max_allocated = max(self.max_allocated or 0, record.peak)
        self._previous_allocated = record.allocated
        self.step_snapshots.append(record)
        self._write(record)
        return record

    def _register_known(self) -> None:
        tensors: list[torch.Tensor | None] = []
        if self.model is not None:
            tensors.extend(weight_tensors(self.model))  # bitsandbytes quantization state included
            tensors.extend(p.grad for p in self.model.parameters())
        if self.optimizer is not None:
            tensors.extend(nested_tensors(list(getattr(self.optimizer, "state", {}).values())))
        for contributor in self.contributors:
            tensors.extend(contributor.known_tensors(self))
        self.backend.register(tensors)

    def _class_storages(self) -> tuple[dict[int, int], dict[int, int], dict[int, int], dict[int, int]]:
        device = self.device
        model = self.model
        weights = weight_storages(model, device) if model is not None else {}
        extra = list(self.extra_gradients()) if self.extra_gradients is not None else []
        grads = gradient_storages(model, device, extra) if model is not None else {}
        states = optimizer_state_storages(self.optimizer, device)
        saved = self.saved.storages(device)
        for contributor in self.contributors:
            held = contributor.class_storages(self)
            weights.update(held.get("weights", {}))
            grads.update(held.get("gradients", {}))
            states.update(held.get("optimizer_states", {}))
        return weights, grads, states, saved

    def measure(self, phase: str, micro_step: int) -> Snapshot:
        """A full snapshot record now (classes from every known storage), without writing it."""
        reading = self.backend.read()  # one allocator read per snapshot
        record = self._measure(phase, micro_step, reading)
        for contributor in self.contributors:
            contributor.adjust(record, self, phase, reading.peak)
        return record

    def _measure(self, phase: str, micro_step: int, reading: Any) -> Snapshot:
        weights, grads, states, saved = self._class_storages()
        self._last_classes = (weights, grads, states, saved)
        allocated, peak = reading.allocated, reading.peak
        live_storages = self.backend.live_storages()
        if live_storages is not None:
            # Tracked device: allocated is the union of every storage we know to be alive.
            union = dict(live_storages)
            for storages in (weights, grads, states, saved):
                union.update(storages)
            allocated = sum(union.values())
            peak = max(peak or 0, allocated)
        live = split_live(allocated, weights, grads, states, saved)
        return self._record(phase, micro_step, reading, allocated, peak, live, "full")

    def _compiled_snapshot(self, phase: str, micro_step: int) -> Snapshot:
        """What a compiled step shows from outside: the classes we can walk; totals unknown."""
        weights, grads, states, saved = self._class_storages()
        live = split_live(None, weights, grads, states, saved)
        return self._record(phase, micro_step, self.backend.read(), None, None, live, "compiled")

    def _light_snapshot(self, phase: str, micro_step: int) -> Snapshot:
        reading = self.backend.read()
        template = self._last_full.get((phase, micro_step))
        known = dict(template.live) if template else dict.fromkeys(LIVE_CLASSES, 0)
        if self.backend.exact and reading.allocated is not None:
            allocated, peak = reading.allocated, reading.peak
            known["other"] = allocated - sum(known[k] or 0 for k in LIVE_CLASSES if k != "other")
        elif template is not None:
            allocated, peak = template.allocated, template.peak
        else:
            allocated = peak = None if reading.allocated is None else sum(v or 0 for v in known.values())
        return self._record(phase, micro_step, reading, allocated, peak, known, "light")

    def _record(
        self,
        phase: str,
        micro_step: int,
        reading: Any,
        allocated: int | None,
        peak: int | None,
        live: dict[str, int | None],
        detail: str,
    ) -> Snapshot:
        spike = None
        if allocated is not None and peak is not None:
            spike = spike_above(peak, allocated, self._previous_allocated)
            peak = max(peak, allocated)
        overhead = None
        if reading.reserved is not None and allocated is not None:
            overhead = reading.reserved - allocated
        vms, rss = host_sizes()  # what host limits count: the auto mode measures its margin from them
        return Snapshot(
            step=self.step,
            micro_step=micro_step,
            phase=phase,
            rank=self.rank,
            device=str(self.device),
            time=time.time(),
            allocated=allocated,
            reserved=reading.reserved,
            peak=peak,
            live=live,  # type: ignore[arg-type]
            spike=spike,
            allocator_overhead=overhead,
            fragmentation=reading.inactive_split,
            num_alloc_retries=reading.num_alloc_retries,
            num_ooms=reading.num_ooms,
            device_free=reading.device_free,
            device_total=reading.device_total,
            host_rss=rss,  # the process's resident bytes: host-side growth shows too
            host_vms=vms,  # its virtual size (RLIMIT_AS counts it)
            detail=detail,
        )

    def _write(self, record: Record) -> None:
        if self.writer is not None:
            self.writer.write(record)

    # -- evaluation loops (Trainer.evaluate / predict) --------------------------------------
    # An eval loop is a peak window of its own: the peak counter is reset when it starts and when
    # it ends, so its peak never shows in a training step's figures. On the CPU it is always
    # tracked in full (the tracker runs only for the loop's forward passes).
    def begin_eval(self, stage: str, step: int, written_batches: int = 3) -> Snapshot:
        """Start measuring an evaluation loop of ``stage`` (``eval``/``predict``) at global ``step``."""
        started = not self.backend.tracking
        if started:
            self._register_known()
            self.backend.start_tracking()
        self.eval = EvalLoopState(stage, step, started, written_batches, self._previous_allocated)
        self.backend.reset_peak()
        self._previous_allocated = None
        return self.eval_snapshot("eval_begin", ())

    def eval_snapshot(self, phase: str, outputs: Iterable[torch.Tensor]) -> Snapshot:
        """A snapshot inside the eval loop; ``outputs`` are the tensors the loop has accumulated."""
        loop = self.eval
        assert loop is not None, "eval_snapshot outside begin_eval/end_eval"
        weights, grads, states, saved = self._class_storages()
        held = collect_storages(list(outputs), self.device)
        reading = self.backend.read()
        allocated, peak = reading.allocated, reading.peak
        live_storages = self.backend.live_storages()
        if live_storages is not None:  # tracked device: allocated = union of the live storages
            union = dict(live_storages)
            for storages in (weights, grads, states, saved, held):
                union.update(storages)
            allocated = sum(union.values())
            peak = max(peak or 0, allocated)
        live = split_live(allocated, weights, grads, states, saved, held)
        record = self._record(phase, loop.batch, reading, allocated, peak, live, "full")
        record.step, record.stage, record.batch, record.outputs = loop.step, loop.stage, loop.batch, live["outputs"]
        self.backend.reset_peak()
        self._previous_allocated = record.allocated
        loop.observe(record, self._write)
        return record

    def end_eval(self, outputs: Iterable[torch.Tensor], batches: int) -> EvalRecord | None:
        """Close the loop: its ``eval`` record (written), the peak window reset for training."""
        loop = self.eval
        if loop is None:
            return None
        self.eval_snapshot("eval_end", outputs)
        self.eval = None
        if loop.started_tracking:
            self.backend.stop_tracking()
        self.backend.reset_peak()
        self._after_eval = True
        self._previous_allocated = loop.previous_allocated
        record = loop.record(self.rank, batches)
        self._write(record)
        if self.writer is not None:
            self.writer.flush()
        self.last_eval = record
        return record


class EvalLoopState:
    """Bookkeeping of one evaluation loop: the batch counter, written snapshots and the peak."""

    def __init__(self, stage: str, step: int, started_tracking: bool, written_batches: int,
                 previous_allocated: int | None) -> None:
        self.stage, self.step = stage, step
        self.started_tracking = started_tracking
        self.written_batches = written_batches  # snapshots of the first batches go to the timeline
        self.previous_allocated = previous_allocated
        self.batch = 0
        self.peak: Snapshot | None = None  # the snapshot closing the highest interval
        self.peak_live: Snapshot | None = None  # the snapshot whose classes were live at that peak (the higher end)
        self.last: Snapshot | None = None

    def observe(self, record: Snapshot, write: Callable[[Record], None]) -> None:
        """Keep the highest interval's figures; write the first batches' snapshots and the ends."""
        if record.phase in ("eval_begin", "eval_end") or (record.batch or 0) < self.written_batches:
            write(record)
        higher = record
        if self.last is not None and (self.last.allocated or 0) > (record.allocated or 0):
            higher = self.last
        if record.peak is not None and (self.peak is None or record.peak > (self.peak.peak or 0)):
            self.peak, self.peak_live = record, higher
        self.last = record

    def record(self, rank: int, batches: int) -> EvalRecord:
        """The ``eval`` timeline record of the loop."""
        peak, live = self.peak, None if self.peak_live is None else self.peak_live.live
        return EvalRecord(
            stage=self.stage, step=self.step, rank=rank,
            peak=None if peak is None else peak.peak, peak_batch=None if peak is None else peak.batch,
            peak_phase=None if peak is None else peak.phase,
            live=live, spike=None if peak is None else peak.spike,
            outputs=None if self.last is None else self.last.outputs, outputs_at_peak=(live or {}).get("outputs"),
            batches=batches, time=time.time(),
        )
