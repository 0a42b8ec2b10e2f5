"""The tensors alive at a peak: which storages, how large, made by which operator in which module.

:class:`PeakCensus` is fed by a :class:`~hf_memwatch.measure.tracker.StorageTracker` (its only
coupling to it: ``on_alloc``/``on_free``/``on_resize``/``on_peak``/``start_window``), so it follows
however the tracker observes allocations. Each event is O(1): an allocation stores one small
:class:`TensorInfo` (shape, dtype, the operator, the module scope running then) and a sequence
number; a free stamps its info with the sequence number of its death. The live set at a window's
peak is rebuilt only when asked (:meth:`PeakCensus.alive_at_peak`): the storages born at or before
the peak's sequence number and not dead by then — no copy of the live set at each new high, which
would cost O(live) per allocation of a forward pass.

The module scope (``model.layers.3.self_attn``, forward or backward) comes from
:class:`~hf_memwatch.measure.module_scope.ModuleScope`. :func:`summarize` turns the live set at a
peak into :class:`PeakTensors` — the ``N`` largest storages and the bytes grouped by module and by
operator — the ``peak_tensors`` timeline record and the estimate's ``peak_tensors``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..compat.torch_internals import tensor_storage_key
from ..core.categories import RESIDENT_CLASSES
from ..core.units import format_bytes
from .attribution import unwrap_optimizer

DEFAULT_TOP = 20  # storages listed per peak; the groups are cut to the same number
NO_SCOPE = ("(outside)", "outside")  # (module path, stage) before any hook fired


class TensorInfo:
    """What is known of one storage from its allocation on."""

    __slots__ = ("key", "nbytes", "shape", "dtype", "func", "scope", "born", "died", "saved")

    def __init__(self, key: int, nbytes: int, shape: tuple[int, ...], dtype: Any, func: Any,
                 scope: tuple[str, str], born: int) -> None:
        self.key, self.nbytes, self.shape, self.dtype = key, nbytes, shape, dtype
        self.func, self.scope, self.born = func, scope, born
        self.died = 0  # 0: alive
        self.saved = False  # saved for backward by autograd at some point of its life


class PeakCensus:
    """Follows every storage its tracker follows; rebuilds the live set at the current window's peak.

    Example:
        >>> from hf_memwatch.measure.tracker import StorageTracker
        >>> tracker = StorageTracker("cpu"); census = tracker.census = PeakCensus()
        >>> with tracker:
        ...     a = torch.ones(256)            # 1 KiB
        ...     b = torch.ones(512)            # peak: 3 KiB, a and b alive
        ...     del b
        ...     c = torch.ones(128)
        >>> sorted(info.nbytes for info in census.alive_at_peak())
        [1024, 2048]
    """

    def __init__(self) -> None:
        self.seq = 0
        self.live: dict[int, TensorInfo] = {}
        self.freed: list[TensorInfo] = []  # died since the window started
        self.peak_seq = 0
        self.scope: tuple[str, str] = NO_SCOPE  # set by ModuleScope and the monitor

    # -- fed by the tracker ---------------------------------------------------------------------
    def on_alloc(self, key: int, nbytes: int, tensor: torch.Tensor, func: Any) -> None:
        self.seq += 1
        self.live[key] = TensorInfo(key, nbytes, tuple(tensor.shape), tensor.dtype, func, self.scope, self.seq)

    def on_free(self, key: int) -> None:
        info = self.live.pop(key, None)
        if info is not None:
            self.seq += 1
            info.died = self.seq
            self.freed.append(info)

    def on_resize(self, key: int, nbytes: int) -> None:
        info = self.live.get(key)
        if info is not None:
            info.nbytes = nbytes

    def on_peak(self) -> None:
        self.peak_seq = self.seq

    def on_saved(self, key: int) -> None:
        """A storage autograd saved for backward (:class:`~hf_memwatch.measure.saved_tensors.SavedTensorRegistry`)."""
        info = self.live.get(key)
        if info is not None:
            info.saved = True

    def start_window(self) -> None:
        """A new peak window starts at the live set now."""
        self.freed.clear()
        self.peak_seq = self.seq

    # -- read ----------------------------------------------------------------------------------
    def alive_at_peak(self) -> list[TensorInfo]:
        """Every storage alive at the current window's peak (the moment its bytes were highest)."""
        peak = self.peak_seq
        alive = [info for info in self.live.values() if info.born <= peak]
        alive.extend(info for info in self.freed if info.born <= peak < info.died)
        return alive

    def alive_now(self) -> list[TensorInfo]:
        """Every storage alive now (an out-of-memory error: the moment of the failure)."""
        return list(self.live.values())


@dataclass
class PeakTensor:
    """One storage alive at a peak."""

    bytes: int
    shape: list[int]
    dtype: str
    cls: str  # the memory class: weights, gradients, optimizer_states, activations, other, temporaries
    operator: str  # the operator that returned it ("aten.bmm"); "parameter", "grad", ... for registered ones
    module: str  # the module running then ("model.layers.3.self_attn"); the parameter's name for weights
    stage: str  # forward, backward, optimizer, outside

    def describe(self) -> str:
        """One line: ``attention scores 4 × 32 × 512 × 512 fp32``-like (shape, dtype, operator, module)."""
        shape = " × ".join(str(d) for d in self.shape) or "scalar"
        return f"{shape} {self.dtype} ({self.operator} in {self.module or '?'}, {self.stage}, {self.cls})"


@dataclass
class TensorGroup:
    """The storages alive at a peak that share a module (or an operator)."""

    name: str
    bytes: int
    count: int


@dataclass
class PeakTensors:
    """The tensors alive at one peak: the ``top`` largest, and all of them grouped."""

    peak: int  # bytes alive at the peak (the sum over every storage, not only the listed ones)
    count: int  # storages alive at the peak
    tensors: list[PeakTensor] = field(default_factory=list)
    by_module: list[TensorGroup] = field(default_factory=list)
    by_operator: list[TensorGroup] = field(default_factory=list)
    by_class: dict[str, int] = field(default_factory=dict)

    def as_record(self) -> dict[str, Any]:
        """Plain data (``cls`` written as ``class``), for the timeline."""
        data = asdict(self)
        for tensor in data["tensors"]:
            tensor["class"] = tensor.pop("cls")
        return data

    @staticmethod
    def from_record(data: Any) -> PeakTensors:
        """Back from :meth:`as_record` (a timeline line, an estimate's JSON) or from a typed
        ``peak_tensors`` record (:class:`~hf_memwatch.core.records.PeakTensorsRecord`)."""
        if not isinstance(data, dict):
            data = {name: getattr(data, name) for name in ("peak", "count", "tensors", "by_module", "by_operator",
                                                           "by_class")}
        tensors = [PeakTensor(**{("cls" if k == "class" else k): v for k, v in t.items()}) for t in data["tensors"]]
        return PeakTensors(data["peak"], data["count"], tensors,
                           [TensorGroup(**g) for g in data.get("by_module", [])],
                           [TensorGroup(**g) for g in data.get("by_operator", [])],
                           dict(data.get("by_class", {})))


def operator_name(func: Any) -> str:
    """``aten.mm`` for ``torch.ops.aten.mm.default``; ``?`` when unknown."""
    packet = getattr(func, "overloadpacket", None)
    if packet is not None:
        return f"{getattr(func, 'namespace', 'aten')}.{packet.__name__}"
    return getattr(func, "__name__", "?") if func is not None else "?"


def dtype_name(dtype: Any) -> str:
    """``fp32``-style names: the ones the CLI and the docs use."""
    short = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
    if dtype is None:
        return "?"  # known by its size only (CUDA allocator blocks, saved storages)
    return short.get(dtype, str(dtype).replace("torch.", ""))


Classifier = Callable[[TensorInfo], str]
Namer = Callable[[TensorInfo], "tuple[str, str] | None"]  # (operator, module) of a registered storage


def summarize(alive: Iterable[TensorInfo], classify: Classifier, name: Namer | None = None,
              top: int = DEFAULT_TOP) -> PeakTensors:
    """The ``top`` largest of ``alive`` and all of them grouped by module, operator and class.

    ``classify`` gives each storage its memory class; ``name`` the (operator, module) of a storage
    no operator made while observed (weights, gradients and states registered at a step's start).
    """
    alive = list(alive)
    by_module: dict[str, list[int]] = {}
    by_operator: dict[str, list[int]] = {}
    by_class: dict[str, int] = {}
    described: dict[int, PeakTensor] = {}
    largest = heapq.nlargest(top, alive, key=lambda info: info.nbytes) if top > 0 else []
    chosen = {id(info) for info in largest}
    for info in alive:
        cls = classify(info)
        operator, module = operator_name(info.func) if info.func is not None else "?", info.scope[0]
        stage = info.scope[1]
        if name is not None and (info.func is None or cls in RESIDENT_CLASSES):
            named = name(info)  # a weight, gradient or state: its parameter's module
            if named is not None:
                module = named[1]
                if info.func is None:
                    operator, stage = named[0], "resident"
        if id(info) in chosen:
            described[id(info)] = PeakTensor(info.nbytes, list(info.shape), dtype_name(info.dtype), cls,
                                             operator, module, stage)
        for groups, key in ((by_module, module), (by_operator, operator)):
            entry = groups.setdefault(key, [0, 0])
            entry[0] += info.nbytes
            entry[1] += 1
        by_class[cls] = by_class.get(cls, 0) + info.nbytes
    return PeakTensors(
        peak=sum(info.nbytes for info in alive), count=len(alive),
        tensors=[described[id(info)] for info in largest],
        by_module=_top_groups(by_module, top), by_operator=_top_groups(by_operator, top), by_class=by_class,
    )


def resident_namer(model: torch.nn.Module | None, optimizer: Any) -> Namer:
    """(operator, module) of the storages a model and its optimizer hold: ``parameter``/``grad``/
    ``buffer``/``state exp_avg`` and the module owning the parameter; ``input`` for other storages
    registered from outside (the batch); None for the rest (an operator made them)."""
    names: dict[int, tuple[str, str]] = {}
    owners: dict[int, str] = {}
    if model is not None:
        root = type(model).__name__
        for name, param in model.named_parameters(remove_duplicate=False):
            owner = owners[id(param)] = name.rpartition(".")[0] or root
            names.setdefault(tensor_storage_key(param), ("parameter", owner))
            if param.grad is not None:
                names.setdefault(tensor_storage_key(param.grad), ("grad", owner))
        for name, buffer in model.named_buffers():
            names.setdefault(tensor_storage_key(buffer), ("buffer", name.rpartition(".")[0] or root))
    optimizer = unwrap_optimizer(optimizer) if optimizer is not None else None
    state = getattr(optimizer, "state", None)
    for param, values in (state.items() if isinstance(state, Mapping) else ()):
        if isinstance(values, Mapping):
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    names.setdefault(tensor_storage_key(value), (f"state {key}", owners.get(id(param), "?")))
    outside = ("input", "(outside)")
    return lambda info: names.get(info.key) or (outside if info.func is None else None)


def _top_groups(groups: dict[str, list[int]], top: int) -> list[TensorGroup]:
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])[:max(top, 0)]
    return [TensorGroup(name, nbytes, count) for name, (nbytes, count) in ranked]


def headline(peak: PeakTensors, phase: str | None = None, limit: int = 3) -> list[str]:
    """Lines saying where the peak is and its largest tensors, identical ones counted together.

    ``the peak is in the backward of model.layers.0 (after_backward): 4 × 4 × 64 × 64 fp32 = 256.00 KiB
    each, 2 alive among the top 20 (aten._softmax in model.layers.0.attn)``.
    """
    lines: list[str] = []
    if peak.tensors:
        first = peak.tensors[0]
        where = f"the {first.stage} of {first.module}" if first.module else first.stage
        lines.append(f"the peak{'' if phase is None else f' ({phase})'} is in {where}: "
                     f"{format_bytes(peak.peak)} in {peak.count} storages")
    kinds: dict[tuple[Any, ...], list[PeakTensor]] = {}
    for tensor in peak.tensors:
        kinds.setdefault((tuple(tensor.shape), tensor.dtype, tensor.operator, tensor.cls), []).append(tensor)
    for (_, _, operator, cls), same in list(kinds.items())[:limit]:
        t = same[0]
        shape = " × ".join(str(d) for d in t.shape) or "scalar"
        where = _common_module(same)
        lines.append(f"  {shape} {t.dtype} = {format_bytes(t.bytes)} each, {len(same)} alive among the top {len(peak.tensors)} — {cls}, "
                     f"{operator} in {where}")
    return lines


def removed_by(before: PeakTensors, after: PeakTensors, limit: int = 3) -> list[str]:
    """What a change (a remedy) takes off the peak: each class's bytes less, then the kinds of listed
    tensors (shape, dtype, operator) at ``before``'s peak that ``after``'s no longer has.

    Example:
        >>> a = PeakTensor(4096, [4, 256], "fp32", "activations", "aten.mul", "m.layers.0.mlp", "forward")
        >>> before = PeakTensors(8192, 2, [a, a], by_class={"activations": 8192})
        >>> removed_by(before, PeakTensors(0, 0, [], by_class={}))
        ['activations -8.00 KiB', '2 × 4 × 256 fp32 (aten.mul in m.layers.0.mlp)']
    """
    lines = [f"{cls} -{format_bytes(nbytes - after.by_class.get(cls, 0))}"
             for cls, nbytes in sorted(before.by_class.items(), key=lambda item: -item[1])
             if nbytes - after.by_class.get(cls, 0) > 0]
    kinds: dict[tuple[Any, ...], list[PeakTensor]] = {}
    for tensor in before.tensors:
        kinds.setdefault((tuple(tensor.shape), tensor.dtype, tensor.operator), []).append(tensor)
    left: dict[tuple[Any, ...], int] = {}
    for tensor in after.tensors:
        key = (tuple(tensor.shape), tensor.dtype, tensor.operator)
        left[key] = left.get(key, 0) + 1
    for key, same in kinds.items():
        gone = len(same) - left.get(key, 0)
        if gone > 0 and len(lines) < limit + len(before.by_class):
            shape = " × ".join(str(d) for d in key[0]) or "scalar"
            lines.append(f"{gone} × {shape} {key[1]} ({key[2]} in {_common_module(same)})")
    return lines


def _common_module(tensors: list[PeakTensor]) -> str:
    """The module path, or the pattern of several (``model.layers.*.mlp``)."""
    names = sorted({t.module for t in tensors})
    if len(names) == 1:
        return names[0]
    parts = [name.split(".") for name in names]
    if len({len(p) for p in parts}) == 1:
        return ".".join(p[0] if len({q[i] for q in parts}) == 1 else "*" for i, p in enumerate(zip(*parts)))
    return f"{names[0]} … ({len(names)} modules)"
