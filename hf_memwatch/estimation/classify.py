"""The one classifier: a live-set snapshot split into classes, for the step replay and the eval replay.

Storage keys are addresses, reused once a storage dies, so a snapshot entry belongs to a class only when
it is the *same* storage: the tracker's reference object (one per storage lifetime) must match the one
recorded for the class. :class:`Phases` closes a step's phase intervals with it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from ..compat.torch_internals import in_backward, tensor_storage_key
from ..measure.peak_tensors import PeakTensors
from ..measure.tracker import StorageTracker
from .fake_dispatch import EstimateTracker
from .peak import PeakCensusWatch
from .request import CLASS_NAMES


# -- classification --------------------------------------------------------------------------
def classify(snapshot: tuple[dict[int, Any], set[int]], live_now: dict[int, Any], weights: dict[int, Any],
             gradients: set[int], states: set[int], other: dict[int, Any],
             named: dict[int, tuple[Any, str]] | None = None,
             details: dict[str, dict[str, int]] | None = None, outputs: dict[int, Any] | None = None,
             names: tuple[str, ...] = CLASS_NAMES, held: dict[int, Any] | None = None,
             held_weights: dict[int, Any] | None = None) -> dict[str, int]:
    """Split a live-set snapshot into classes (each storage once, first class wins): weights, gradients,
    optimizer states, activations (saved for backward), outputs (an eval loop's held predictions), other,
    else temporaries; the result has the keys ``names`` in that order (the step's six by default).

    Storage keys are addresses and get reused once a storage dies, so a snapshot entry belongs to
    a class only when it is the *same* storage: the tracker's reference object (one per storage
    lifetime) must match the one recorded for the class (``weights``/``other``: key -> ref) or
    the one live now (``gradients``/``states``: keys read now). Entries of ``named`` (id of the ref ->
    (ref, name)) are also added to ``details[class][name]`` when given. The eval replay gives ``outputs``
    (id of the ref -> ref: what it holds before and after an accumulation, where a storage the
    concatenation freed and the one it made may share a key) and no gradients, states or saved tensors. ``held`` (key -> ref): gradients an engine
    holds outside ``.grad`` (:mod:`~hf_memwatch.engines.zero.backward`), gradients while they live;
    ``held_weights``: parameters it gathers (:mod:`~hf_memwatch.engines.fsdp2.replay`), weights while they live.
    """
    live, saved = snapshot
    classes = dict.fromkeys(names, 0)
    for key, ref in live.items():
        if weights.get(key) is ref or (held_weights is not None and held_weights.get(key) is ref):
            name = "weights"
        elif (key in gradients and live_now.get(key) is ref) or (held is not None and held.get(key) is ref):
            name = "gradients"
        elif key in states and live_now.get(key) is ref:
            name = "optimizer_states"
        elif key in saved:
            name = "activations"
        elif outputs is not None and outputs.get(id(ref)) is ref:
            name = "outputs"
        elif other.get(key) is ref:
            name = "other"
        else:
            name = "temporaries"
        classes[name] += ref.nbytes
        if named is not None and details is not None:
            label = named.get(id(ref))
            if label is not None and label[0] is ref:
                inner = details.setdefault(name, {})
                inner[label[1]] = inner.get(label[1], 0) + ref.nbytes
    return classes


def storage_keys(tensors: Any) -> set[int]:
    keys: set[int] = set()
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            keys.add(tensor_storage_key(tensor))
    return keys


def refs(tracker: StorageTracker, tensors: Any) -> dict[int, Any]:
    """key -> the tracker's reference object of each tensor's storage (its identity for this lifetime)."""
    live = tracker.live_refs()
    return {key: live[key] for key in storage_keys(tensors) if key in live}


def state_tensors(optimizer: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for state in optimizer.state.values():
        values = state.values() if isinstance(state, dict) else [state]
        found.extend(v for v in values if isinstance(v, torch.Tensor))
    return found


class Phases:
    """Closes phase intervals: classify the interval's highest snapshot, keep the best per phase.

    A phase may be split into windows (:meth:`split`: a checkpointed layer's recomputation begins inside the
    backward, :func:`~hf_memwatch.estimation.layers.recompute_windows`; each module call of the forward,
    :func:`forward_windows`): each window's high is classified on its own, the phase's is the first of the
    highest, and every window's classes are kept in ``windows[phase]`` (one list a closed interval, in time
    order) for the depth extrapolation and the engines that hold something per module call.
    """

    def __init__(self, tracker: EstimateTracker, model: torch.nn.Module, optimizer: Any,
                 weights: dict[int, Any], other: dict[int, Any]) -> None:
        self.tracker, self.model, self.optimizer = tracker, model, optimizer
        self.weights, self.other = weights, other
        self.best: dict[str, dict[str, int]] = {}
        self.details: dict[str, dict[str, dict[str, int]]] = {}
        self.tensors: dict[str, PeakTensors] = {}
        self.census: PeakCensusWatch | None = None
        self.windows: dict[str, list[list[tuple[Any, dict[str, int]]]]] = {}
        self._split: list[tuple[Any, dict[str, int], dict[str, dict[str, int]]]] = []  # the running interval's
        self.window: Any = "head"  # the running window's label: "head" until the first split, then the split's
        # a high carried into the running interval from a replay this one reuses (:meth:`carry`)
        self._carried: tuple[dict[str, int], dict[str, dict[str, int]]] | None = None

    def _classified(self, snapshot: tuple[dict[int, Any], Any] | None = None
                    ) -> tuple[dict[str, int], dict[str, dict[str, int]], set[int], set[int]] | None:
        """The running interval's high (or ``snapshot``), classified (None before any tracking)."""
        tracker = self.tracker
        snapshot = tracker.snapshot if snapshot is None else snapshot
        if snapshot is None:
            return None
        grads = storage_keys(p.grad for p in self.model.parameters())
        states = storage_keys(state_tensors(self.optimizer))
        details: dict[str, dict[str, int]] = {}
        classes = classify(snapshot, tracker.live_refs(), self.weights, grads, states, self.other,
                           tracker.named, details, held=tracker.engine_gradients,
                           held_weights=tracker.engine_weights)
        return classes, details, grads, states

    def classified_high(self) -> tuple[dict[str, int], dict[str, dict[str, int]]] | None:
        """The running interval's high so far, classified, with its details (None before any tracking)."""
        found = self._classified()
        return None if found is None else (found[0], found[1])

    def live_classes(self) -> dict[str, int]:
        """The live set now, classified."""
        tracker = self.tracker
        return self._classified((dict(tracker.live_refs()), tracker.saved.keys()))[0]

    def carry(self, classes: dict[str, int], details: dict[str, dict[str, int]]) -> None:
        """A high of the running interval reached before it began here: the interval's, unless a later one
        passes it (:mod:`~hf_memwatch.estimation.optimizer_swap`: the micro-steps another replay ran)."""
        self._carried = (classes, details)

    def split(self, label: Any) -> None:
        """End the running window at its high; the next one is ``label``'s (not with a peak census)."""
        found = self._classified()
        if found is not None:
            self._split.append((self.window, found[0], found[1]))
        self.window = label
        self.tracker.reset_peak()

    def close(self, phase: str) -> None:
        tracker = self.tracker
        found = self._classified()
        if self._split:  # a split interval: its last window, then the first of the highest
            if found is not None:
                self._split.append((self.window, found[0], found[1]))
            self.windows.setdefault(phase, []).append([(label, classes) for label, classes, _ in self._split])
            top = max(sum(classes.values()) for _, classes, _ in self._split)
            _, classes, details = next(w for w in self._split if sum(w[1].values()) == top)
            found = (classes, details, set(), set())
            self._split, self.window = [], "head"
        if self._carried is not None:  # first of the highest: the carried high came first
            carried, self._carried = self._carried, None
            if found is None or sum(carried[0].values()) >= sum(found[0].values()):
                found = (carried[0], carried[1], set(), set())
        if found is not None:
            classes, details, grads, states = found
            if sum(classes.values()) > sum(self.best.get(phase, {}).values() or [-1]):
                self.best[phase] = classes
                self.details[phase] = details
                if self.census is not None:
                    self.tensors[phase] = self.census.summary(grads, states)
        if self.census is not None:
            self.census.after(phase)
        tracker.reset_peak()


# an engine's flow asks for the forward split at each module call (engines/zero/gather.py)
_FORWARD_WINDOWS: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_memwatch_forward_windows", default=False)
MODULE_WINDOW = "module"  # the label of a module call's window: (MODULE_WINDOW, the module's qualified name)


@contextlib.contextmanager
def forward_windows_wanted() -> Iterator[None]:
    """Replays inside split their forward at each module call (:func:`forward_windows`)."""
    token = _FORWARD_WINDOWS.set(True)
    try:
        yield
    finally:
        _FORWARD_WINDOWS.reset(token)


@contextlib.contextmanager
def forward_windows(model: torch.nn.Module, phases: Phases) -> Iterator[None]:
    """Where wanted (:func:`forward_windows_wanted`), split the forward at each of ``model``'s module calls
    (its pre-forward; not a recomputation inside the backward), labelled ``(MODULE_WINDOW, name)``: each
    call's window classified on its own (``phase_windows``). Not with a peak census (its high is the phase's)."""
    if not _FORWARD_WINDOWS.get() or phases.census is not None:
        yield
        return

    def begins(name: str, *_: Any) -> None:
        if not in_backward():
            phases.split((MODULE_WINDOW, name))

    hooks = [module.register_forward_pre_hook(lambda *args, name=name: begins(name, *args))
             for name, module in model.named_modules()]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
