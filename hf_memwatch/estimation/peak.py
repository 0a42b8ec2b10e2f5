"""The tensors alive at the predicted peak: the live census (:mod:`hf_memwatch.measure.peak_tensors`)
run inside the estimator's fake step.

The estimator's tracker feeds a :class:`~hf_memwatch.measure.peak_tensors.PeakCensus` exactly as the
live CPU tracker does, and the same module hooks (:class:`~hf_memwatch.measure.module_scope.ModuleScope`)
stamp each allocation with the fake model's module path, so a prediction names the same storages, shapes
and modules as a measured step. Classes follow the estimator's own split (``classify`` in
:mod:`hf_memwatch.estimation.classify`): what is live at the high but none of weights, gradients, optimizer
states, saved activations or the batch is a temporary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..core.categories import STAGE_AFTER
from ..measure.module_scope import ModuleScope
from ..measure.peak_tensors import PeakCensus, PeakTensors, TensorInfo, resident_namer, summarize


class PeakCensusWatch:
    """Census and module hooks for one simulated step; :meth:`summary` at a phase's new high."""

    def __init__(self, tracker: Any, saved: Any, model: torch.nn.Module, optimizer: Any,
                 weights: Mapping[int, Any], other: Mapping[int, Any], top: int) -> None:
        self.tracker, self.saved, self.model, self.optimizer = tracker, saved, model, optimizer
        self.weights, self.other, self.top = weights, other, top
        self.census: PeakCensus = tracker.census
        saved.observer = self.census.on_saved
        self.scope = ModuleScope(self.census)
        self.scope.attach(model)
        self.scope.start()

    def after(self, phase: str) -> None:
        self.scope.set_stage(STAGE_AFTER.get(phase, "outside"))

    def close(self) -> None:
        self.scope.stop()
        self.tracker.census = None
        self.saved.observer = None

    def summary(self, grads: set[int], states: set[int]) -> PeakTensors:
        live_now = self.tracker.live_refs()
        weights, other = self.weights, self.other
        # what an engine holds outside the model's own (ZeRO's buckets and partitions, FSDP2's all-gathers),
        # classed as the phase's classes class them (classify.classify's ``held`` and ``held_weights``: the
        # storage alive at the high, which the engine may have let go since)
        held, held_weights = self.tracker.engine_gradients, self.tracker.engine_weights
        at_high = self.tracker.snapshot[0] if self.tracker.snapshot is not None else {}

        def engine_held(refs: Mapping[int, Any], key: int) -> bool:
            ref = at_high.get(key)
            return ref is not None and refs.get(key) is ref

        def classify(info: TensorInfo) -> str:
            ref = None if info.died else live_now.get(info.key)
            if (ref is not None and weights.get(info.key) is ref) or engine_held(held_weights, info.key):
                return "weights"
            if (ref is not None and info.key in grads) or engine_held(held, info.key):
                return "gradients"
            if ref is not None and info.key in states:
                return "optimizer_states"
            if info.saved:
                return "activations"
            if ref is not None and other.get(info.key) is ref:
                return "other"
            return "temporaries"

        return summarize(self.census.alive_at_peak(), classify, resident_namer(self.model, self.optimizer), self.top)
