"""A plan's candidates that differ only in the optimizer: the micro-steps replayed once, the step for each.

A plan weighs candidates that differ in the optimizer alone (AdamW against paged 8-bit AdamW at the same
micro-batch, accumulation and checkpointing: 2 of the 6 estimates of a Llama-3.1-8B-shaped full plan,
each ~0.45-0.7 s of fake dispatch). Between the optimizer's priming and its step the Trainer's micro-steps
never read the optimizer: its states, and whatever else it made, only sit in memory, the same storages all
through. So after one candidate's replay, another's micro-steps are not replayed; the first's are carried
over, exactly:

- **the phases' highs** (``after_forward``, ``after_backward`` with its checkpointed windows, and the
  optimizer phase's high between the backward's end and the step): the first's, every class shifted by the
  difference between the two runs' live sets where the micro-steps begin, split alike. The two sets differ
  only by each optimizer's own storages, which stay the same until the step, so each high falls at the same
  moment and is the first's with one optimizer's storages swapped for the other's;
- **the allocation sequence** a CUDA target's caching allocator replays: the first's micro-step events
  spliced into the second's, each storage that existed before them keyed by what it is in both runs (a
  batch's tensor, a parameter's gradient, the loss accumulator) and the others given keys of their own;
- **the gradients** the backward leaves: made as zeros of their parameters' shape and dtype, after which the
  second candidate's clipping, step and ``zero_grad`` run as they always do.

Recorded only where that holds: on a fake model a plan's :func:`~hf_memwatch.estimation.memo.sharing`
block shares, with the shortcuts on (the records kept with it: :func:`~hf_memwatch.estimation.memo.kept_with`);
no Trainer (its ``training_step`` may read anything), no engine, no peak census; an optimizer this library
builds from its name (:data:`~hf_memwatch.estimation.optim.TORCH_NATIVE`, ``BNB_NATIVE``: never
one that hooks the backward); micro-steps that leave nothing but gradients behind and touch no earlier storage
but a named one. The reuse checks that its own window freed and left what the record says; where it did
not, :class:`SwapMismatch` and the step is replayed in full (:func:`~hf_memwatch.estimation.step.simulate_step`).
Byte for byte the full replay's figures: tests/test_optimizer_swap.py; cost: benchmarks/planning_cost.py.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..compat.torch_internals import tensor_storage_key
from ..core.categories import AFTER_BACKWARD, AFTER_FORWARD
from .memo import kept_with
from .optim import BNB_NATIVE, TORCH_NATIVE
from .trainer_replay import batch_tensors

_SLOT = "optimizer_swap"  # the fake model's entry in the memo cache: record key -> _Record
_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_memwatch_optimizer_swap_off", default=False)


class SwapMismatch(Exception):
    """A reused window did not free and leave what its record says: the step is replayed in full."""


@contextlib.contextmanager
def swap_off() -> Iterator[None]:
    """No reuse within (the full replay after a :class:`SwapMismatch`)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


@dataclass
class _Record:
    """One replay's micro-steps, as another candidate's replay splices them in."""

    segment: list[tuple[Any, int]]  # their events: ("name", n) | ("grad", i) | ("new", j), bytes (0: a free)
    needs: dict[Any, int]  # earlier storages they touch: name -> bytes
    freed: set[Any]  # the names of those they free
    survivors: dict[int, int]  # parameter index -> bytes of the gradient they leave
    start: dict[str, int]  # the live set's classes where they begin
    best: dict[str, dict[str, int]]  # the after_forward / after_backward highs
    details: dict[str, dict[str, dict[str, int]]]
    windows: list[list[tuple[Any, dict[str, int]]]] | None  # the backward's windows (checkpointing)
    tail: tuple[dict[str, int], dict[str, dict[str, int]]] | None  # the optimizer phase's high until their end


class OptimizerSwap:
    """One step replay's side of the reuse: :meth:`begin` where its micro-steps begin (True: skip them, a
    record is at hand), :meth:`end` where they ended (a record kept, or the record's effects applied)."""

    def __init__(self, run: Any, cache: dict, key: tuple) -> None:
        self.run, self.cache, self.key = run, cache, key
        self.record: _Record | None = None
        self.names: dict[Any, tuple[int, int]] = {}  # name -> (event key, bytes)
        self.own_events = False
        self.start_index = 0
        self.live_at_start: set[int] = set()
        self.start: dict[str, int] = {}

    @classmethod
    def of(cls, run: Any, steps: int, split: bool) -> OptimizerSwap | None:
        """The reuse for ``run`` (a ``step._StepRun`` of ``steps`` optimizer steps, its backward ``split`` into
        windows or not); None where it cannot be exact or no plan runs."""
        kept = kept_with(run.model)
        request, inputs = run.request, run.inputs
        if kept is None or _OFF.get():
            return None
        if inputs.trainer is not None or inputs.replay is not None or inputs.sample is not None:
            return None
        if request.engine is not None or request.top_tensors > 0 or not request.optimizer_step:
            return None
        if request.optim not in TORCH_NATIVE and request.optim not in BNB_NATIVE:
            return None
        key = (tuple(id(p) for p in run.model.parameters()), repr(request.replace(optim="")),
               run.tracker.events is None, steps, split)
        return cls(run, kept.setdefault(_SLOT, {}), key)

    # -- where the micro-steps begin ----------------------------------------------------------------
    def begin(self, named: dict[str, Any]) -> bool:
        """Note the live set (``named``: the step's storages by role, the parameters' gradients added);
        True: a record of the same step with another optimizer is at hand and the micro-steps are skipped."""
        tracker = self.run.tracker
        if tracker.events is None:  # no sequence recorded (a CPU target): the window's own, for the checks
            tracker.events, self.own_events = [], True
        self.start_index = len(tracker.events)
        live = tracker.live_refs()
        self.live_at_start = {id(ref) for ref in live.values()}
        self.names = self._names(named, live)
        self.start = self.run.phases.live_classes()
        record = self.cache.get(self.key)
        if record is None or any(self.names.get(name, (None, -1))[1] != nbytes
                                 for name, nbytes in record.needs.items()):
            return False
        self.record = record
        return True

    def _names(self, named: dict[str, Any], live: Any) -> dict[Any, tuple[int, int]]:
        names: dict[Any, tuple[int, int]] = {}
        groups = [(group, batch_tensors(value)) for group, value in named.items()]
        groups.append(("grad", [p.grad for p in self.run.model.parameters()]))
        for group, tensors in groups:
            for index, tensor in enumerate(tensors):
                if not isinstance(tensor, torch.Tensor):
                    continue
                ref = live.get(tensor_storage_key(tensor))
                if ref is not None:
                    names[(group, index)] = (id(ref), ref.nbytes)
        return names

    # -- where they ended ----------------------------------------------------------------------------
    def end(self) -> None:
        """Record this replay's micro-steps, or apply the record's in place of the skipped ones."""
        try:
            if self.record is None:
                self._keep()
            else:
                self._apply(self.record)
        finally:
            if self.own_events:
                self.run.tracker.events = None

    def _keep(self) -> None:
        tracker, phases = self.run.tracker, self.run.phases
        if self.key in self.cache or AFTER_FORWARD not in phases.best or AFTER_BACKWARD not in phases.best:
            return
        window = tracker.events[self.start_index:]
        live = tracker.live_refs()
        params = list(self.run.model.parameters())
        grads = {id(live[tensor_storage_key(p.grad)]): index for index, p in enumerate(params)
                 if p.grad is not None and tensor_storage_key(p.grad) in live}
        by_id = {}
        for name, (key, _) in self.names.items():
            by_id.setdefault(key, name)
        segment, needs, freed, born = [], {}, set(), {}
        earlier = set(self.live_at_start)
        for key, nbytes in window:
            if key in born:
                symbol = born.pop(key) if nbytes == 0 else None
            elif key in earlier:
                name = by_id.get(key)
                if name is None or nbytes:
                    return  # an unnamed earlier storage, or one grown: not recorded
                earlier.discard(key)
                freed.add(name)
                needs[name] = self.names[name][1]
                symbol = ("name", name)
            elif nbytes:
                symbol = born[key] = ("new", len(segment))
            else:
                return
            if symbol is None:
                return
            segment.append((symbol, nbytes))
        survivors = {}
        renamed = {}
        for key, symbol in born.items():
            index = grads.get(key)
            if index is None:
                return  # something but a gradient outlives the micro-steps
            survivors[index] = live[tensor_storage_key(params[index].grad)].nbytes
            renamed[symbol] = ("grad", index)
        if {id(ref) for ref in live.values()} != earlier | set(born):
            return
        segment = [(renamed.get(symbol, symbol), nbytes) for symbol, nbytes in segment]
        tail = phases.classified_high()
        windows = phases.windows.get(AFTER_BACKWARD)
        self.cache[self.key] = _Record(
            segment=segment, needs=needs, freed=freed, survivors=survivors, start=dict(self.start),
            best={phase: dict(phases.best[phase]) for phase in (AFTER_FORWARD, AFTER_BACKWARD)},
            details={phase: {c: dict(d) for c, d in phases.details.get(phase, {}).items()}
                     for phase in (AFTER_FORWARD, AFTER_BACKWARD)},
            windows=None if windows is None else [[(label, dict(c)) for label, c in w] for w in windows],
            tail=None if tail is None else (dict(tail[0]), {c: dict(d) for c, d in tail[1].items()}))

    def _apply(self, record: _Record) -> None:
        tracker, phases = self.run.tracker, self.run.phases
        params = list(self.run.model.parameters())
        made = {}
        for index in record.survivors:
            params[index].grad = torch.zeros_like(params[index])  # what the backward leaves: its shape, dtype
        live = tracker.live_refs()
        for index, nbytes in record.survivors.items():
            ref = live.get(tensor_storage_key(params[index].grad))
            if ref is None or ref.nbytes != nbytes:
                raise SwapMismatch(f"parameter {index}'s gradient")
            made[index] = id(ref)
        freed = {self.names[name][0] for name in record.freed}
        if {id(ref) for ref in live.values()} != (self.live_at_start - freed) | set(made.values()):
            raise SwapMismatch("the live set after the micro-steps")
        delta = {name: self.start.get(name, 0) - record.start.get(name, 0)
                 for name in {*self.start, *record.start}}

        def shifted(classes: dict[str, int]) -> dict[str, int]:
            return {name: nbytes + delta.get(name, 0) for name, nbytes in classes.items()}

        for phase in (AFTER_FORWARD, AFTER_BACKWARD):
            phases.best[phase] = shifted(record.best[phase])
            phases.details[phase] = {c: dict(d) for c, d in record.details[phase].items()}
        if record.windows is not None:
            phases.windows[AFTER_BACKWARD] = [[(label, shifted(c)) for label, c in w] for w in record.windows]
        if not self.own_events:  # the sequence the caching allocator replays: the record's micro-steps
            keys = {("name", name): self.names[name][0] for name in record.needs}
            keys.update({("grad", index): key for index, key in made.items()})
            tracker.events[self.start_index:] = [(keys.get(symbol, ("optimizer_swap", symbol)), nbytes)
                                                 for symbol, nbytes in record.segment]
        tracker.reset_peak()
        if record.tail is not None:
            phases.carry(shifted(record.tail[0]), record.tail[1])
