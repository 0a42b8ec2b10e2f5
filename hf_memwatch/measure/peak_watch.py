"""The ``peak_tensors`` record of each fully tracked step: what the :class:`StepMonitor` asks of the census.

===================  =====================================================================================
record field          meaning
===================  =====================================================================================
``step``, ``rank``    the optimizer step and the rank
``phase``             the snapshot closing the window that holds the step's peak (``after_backward`` ...)
``micro_step``        its micro-batch
``peak``              bytes of every storage alive at that moment (the step record's ``peak`` on the CPU)
``count``             storages alive then
``tensors``           the ``top`` largest: ``bytes``, ``shape``, ``dtype``, ``class``, ``operator``,
                      ``module``, ``stage`` (forward | backward | optimizer | resident | outside)
``by_module``         every storage alive then, grouped by module path: ``name``, ``bytes``, ``count``
``by_operator``       the same by operator
``by_class``          the same by memory class (``temporaries``: freed before the window closed)
``source``            ``tracker`` (CPU: every operator observed), ``cuda_history`` (the allocator's
                      recorded history: sizes and frames, no shape), ``cuda_saved`` (CUDA without it:
                      the storages the classes know at the closing snapshot: weights, gradients,
                      states, saved tensors; no temporaries)
===================  =====================================================================================

CPU cost: one :class:`~hf_memwatch.measure.peak_tensors.TensorInfo` per allocation of a tracked step,
the module hooks during tracked steps only, and one summary per snapshot that raises the step's peak
(at most the five phases); light steps run none of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..compat.torch_cuda_memory import allocator_snapshot
from ..core.categories import STAGE_AFTER
from ..core.records import PeakTensorsRecord, Snapshot
from .module_scope import ModuleScope
from .peak_tensors import DEFAULT_TOP, PeakCensus, PeakTensors, TensorInfo, resident_namer, summarize


class PeakWatch:
    """Keeps the census of a tracked backend and writes one ``peak_tensors`` record per full step."""

    def __init__(self, backend: Any, saved: Any, top: int = DEFAULT_TOP) -> None:
        self.backend, self.saved, self.top = backend, saved, top
        tracker = getattr(backend, "tracker", None)
        self.census: PeakCensus | None = None
        if top > 0 and tracker is not None:
            self.census = tracker.census = PeakCensus()
        self.scope = ModuleScope(self.census) if self.census is not None else None
        self.model: torch.nn.Module | None = None
        self.optimizer: Any = None
        self.best: tuple[int, str, int, PeakTensors] | None = None  # peak, phase, micro_step, summary
        self.active = False
        self.last: PeakTensorsRecord | None = None  # the last peak_tensors record written
        self.history = False  # CUDA: the allocator's history is recorded (MemWatch(record_history=True))
        self.cuda = False  # this step is a full CUDA step (no census: the allocator or the classes tell)
        self.source = "tracker"

    def set_top(self, top: int) -> None:
        """List ``top`` storages per peak; 0 switches the census off (the tracker is told of nothing)."""
        self.top = top
        if top <= 0 and self.census is not None:
            self.stop()
            self.backend.tracker.census = None
            self.census = self.scope = None

    def attach(self, model: torch.nn.Module | None, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer
        if self.scope is not None:
            self.scope.attach(model)

    def begin_step(self, tracked: bool, full: bool = False) -> None:
        """A step starts; ``tracked``: its operators are observed (a full, uncompiled CPU step);
        ``full``: tracked in full (on CUDA the record comes from the allocator or the classes)."""
        self.best = None
        self.active = tracked and self.census is not None
        self.cuda = full and self.top > 0 and getattr(self.backend, "kind", None) == "cuda"
        if self.active:
            self.saved.observer = self.census.on_saved
            self.scope.start()

    def stop(self) -> None:
        if self.scope is not None:
            self.scope.stop()
        if self.census is not None and self.saved.observer == self.census.on_saved:
            self.saved.observer = None
        self.active = False

    def observe(self, record: Snapshot, classes: tuple[Mapping[int, int], ...] | None) -> None:
        """A full snapshot closed a window: summarize it when it holds the step's highest peak so far."""
        if self.cuda and classes is not None and record.peak is not None:
            if self.best is None or record.peak > self.best[0]:
                self.best = (record.peak, record.phase, record.micro_step, self._cuda_summary(classes))
            return
        if not self.active or record.peak is None or classes is None:
            return
        if self.best is None or record.peak > self.best[0]:
            summary = self.summarize(self.census.alive_at_peak(), classes)
            self.best = (record.peak, record.phase, record.micro_step, summary)
        if self.scope is not None:
            self.scope.set_stage(STAGE_AFTER.get(record.phase, "outside"))

    def summarize(self, alive: list[TensorInfo], classes: tuple[Mapping[int, int], ...]) -> PeakTensors:
        weights, grads, states, saved = classes

        def classify(info: TensorInfo) -> str:
            alive_now = not info.died
            if alive_now and info.key in weights:
                return "weights"
            if alive_now and info.key in grads:
                return "gradients"
            if alive_now and info.key in states:
                return "optimizer_states"
            if info.saved or (alive_now and info.key in saved):
                return "activations"
            return "other" if alive_now else "temporaries"

        return summarize(alive, classify, resident_namer(self.model, self.optimizer), self.top)

    def end_step(self, step: int, rank: int) -> PeakTensorsRecord | None:
        """The step's ``peak_tensors`` record (None on a light step)."""
        best, self.best = self.best, None
        self.stop()
        if best is None:
            return None
        peak, phase, micro_step, summary = best
        source = ("cuda_history" if self.history else "cuda_saved") if self.cuda else "tracker"
        self.last = PeakTensorsRecord(step=step, rank=rank, phase=phase, micro_step=micro_step, source=source,
                                      **summary.as_record())
        return self.last

    def _cuda_summary(self, classes: tuple[Mapping[int, int], ...]) -> PeakTensors:
        """CUDA, at the snapshot closing the window of the step's highest peak (not run on the CPU-only
        development machines): with recorded history, the allocator's live blocks and their frames;
        else the storages the classes know then (weights, gradients, states, saved tensors)."""
        if self.history:
            found = cuda_allocator_tensors(self.backend.device, self.top)
            if found is not None:
                return found
        weights, grads, states, saved = classes
        infos, seen = [], set()
        for storages in (weights, grads, states, saved):
            for key, nbytes in storages.items():
                if key not in seen:
                    seen.add(key)
                    infos.append(TensorInfo(key, nbytes, (), None, None, ("?", "saved"), 0))

        def classify(info: TensorInfo) -> str:
            for name, storages in (("weights", weights), ("gradients", grads), ("optimizer_states", states)):
                if info.key in storages:
                    return name
            return "activations"

        namer = resident_namer(self.model, self.optimizer)
        return summarize(infos, classify, lambda info: namer(info) or ("saved for backward", "?"), self.top)

    def at_failure(self, classes: tuple[Mapping[int, int], ...]) -> PeakTensors | None:
        """The storages alive now (an out-of-memory error inside a tracked step)."""
        if self.census is None or not self.census.live:
            return None
        return self.summarize(self.census.alive_now(), classes)


def cuda_allocator_tensors(device: Any, top: int = DEFAULT_TOP) -> PeakTensors | None:
    """CUDA: the ``top`` largest blocks allocated now, from the caching allocator's snapshot
    (``torch.cuda.memory._snapshot``): sizes, and with recorded history (``record_history=True``) the
    innermost Python frame that allocated each as its ``operator``; no shapes (the allocator has none).
    Written for the OOM post-mortem; not run on the CPU-only development machines."""
    try:
        snapshot = allocator_snapshot()
    except Exception:  # noqa: BLE001 - no CUDA, or an allocator without snapshots
        return None
    if snapshot is None:
        return None
    index = getattr(device, "index", None)
    blocks = []
    for segment in snapshot.get("segments", []):
        if index is not None and segment.get("device") not in (None, index):
            continue
        for block in segment.get("blocks", []):
            if block.get("state") == "active_allocated":
                frames = [f for f in block.get("frames") or [] if str(f.get("filename", "")).endswith(".py")]
                where = f"{frames[0].get('name')} ({frames[0].get('filename')}:{frames[0].get('line')})" if frames else "?"
                info = TensorInfo(len(blocks), int(block.get("requested_size") or block.get("size") or 0), (), None,
                                  None, ("?", "?"), 0)
                blocks.append((info, where))
    names = {id(info): where for info, where in blocks}
    return summarize([info for info, _ in blocks], lambda info: "allocated",
                     lambda info: ("block: " + names[id(info)], "?"), top)
