"""The C++ frame names of torch that :mod:`hf_memwatch.measure.unperturbed` recognises a caller by,
read through torch's private symbolizer, and their probe. Verified on torch 2.13.0.

``ACCUMULATE_CALLERS`` (``torch/csrc/autograd/input_buffer.cpp``: the engine adding two gradients
of one input) and ``GATHER_BACKWARD_CALLER`` (``aten/src/ATen/native/TensorAdvancedIndexing.cpp``)
are symbols of a torch build; another release (or a build without exported symbols) may name them
otherwise, and then the CPU tracker and the estimator would silently see these two operators as a
dispatch mode perturbs them (one more gradient-sized buffer). :data:`FRAMES` checks, once, that a
tiny gather backward under a no-op mode shows both callers; failed, the unperturbed replay is off
(warned, ``meta.degraded``) and the operators run as called.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .probes import Probe, holds
from .torch_internals import tensor_storage_key

ACCUMULATE_CALLERS = ("torch::autograd::accumulate(", "torch::autograd::InputBuffer::add(")
GATHER_BACKWARD_CALLER = "gather_backward("
_SYMBOLIZE_MODE = "TORCH_SYMBOLIZE_MODE"
_symbolized_once = False


def _symbolized_frames() -> list[dict[str, Any]]:
    """The C++ frames of this call, named. PyTorch fixes its symbolizer at the first use in a process:
    ``dladdr`` (exported symbols; about 30 us a call, 11 ms the first) unless the user chose one —
    the default, ``addr2line``, took 0.4-0.6 s the first time and about 0.1 s for each new call site
    (4.2 s for the 38 gradient additions of 2 tiny Qwen2 steps, 0.11 s with ``dladdr``). The
    variable is set for that first use only."""
    from torch._C._profiler import gather_traceback, symbolize_tracebacks

    global _symbolized_once
    traceback = gather_traceback(python=False, script=False, cpp=True)
    if _symbolized_once or _SYMBOLIZE_MODE in os.environ:
        return symbolize_tracebacks([traceback])[0]
    os.environ[_SYMBOLIZE_MODE] = "dladdr"
    try:
        return symbolize_tracebacks([traceback])[0]
    finally:
        os.environ.pop(_SYMBOLIZE_MODE, None)
        _symbolized_once = True


def callers() -> str:
    """The two C++ frames below the running operator's ``at::_ops::*::call`` (its caller; a static
    caller has no exported name, then the one that called it)."""
    frames = _symbolized_frames()
    for index, frame in enumerate(frames[:-1]):
        name = frame["name"]
        if name.startswith("at::_ops::") and "::call(" in name:
            return " | ".join(f["name"] for f in frames[index + 1:index + 3])
    return ""


def in_autograd_node() -> bool:
    """Whether the autograd engine is running a node (a backward function) on this thread."""
    return torch._C._current_autograd_node() is not None


def _frames_named() -> bool:
    """A gather whose input also gets a second gradient, backward under a no-op mode: the engine's
    addition and ``gather_backward``'s ``scatter_add`` must show the callers named above."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    aten = torch.ops.aten
    seen: dict[Any, str] = {}

    class Callers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (aten.add.Tensor, aten.scatter_add.default) and func not in seen and in_autograd_node():
                seen[func] = callers()
            return func(*args, **(kwargs or {}))

    with _disable_current_modes(), torch.inference_mode(False), torch.enable_grad():
        source = torch.zeros(4, requires_grad=True)
        with Callers():
            (torch.gather(source, 0, torch.zeros(1, dtype=torch.long)).sum() + (source * 2).sum()).backward()
    return (GATHER_BACKWARD_CALLER in seen.get(aten.scatter_add.default, "")
            and any(c in seen.get(aten.add.Tensor, "") for c in ACCUMULATE_CALLERS))


FRAMES = Probe("torch", "the C++ frame names gather_backward( and torch::autograd::accumulate(",
               "running gradient accumulation and gather_backward unperturbed under the CPU tracker "
               "(their bytes are those under a dispatch mode)", _frames_named)


def frames_named() -> bool:
    """Whether the callers can be told by their frames (:data:`FRAMES`, run once)."""
    return holds(FRAMES)


def references(tensor: torch.Tensor) -> tuple[int, int]:
    """(tensor, storage) reference counts, as the autograd engine's ``can_accumulate_inplace`` reads
    them (``Tensor._use_count``, ``torch._C._storage_Use_Count``)."""
    return tensor._use_count(), torch._C._storage_Use_Count(tensor_storage_key(tensor))


def is_zerotensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ZeroTensor (the engine never adds into one in place)."""
    return bool(tensor._is_zerotensor())


def _references_counted() -> bool:
    """A view adds one reference to its base's storage; a plain tensor is no ZeroTensor."""
    base = torch.zeros(2)
    tensor_refs, storage_refs = references(base)
    view = base[1:]
    return tensor_refs >= 1 and references(base)[1] == storage_refs + 1 and view.numel() == 1 and not is_zerotensor(base)


REFERENCES = Probe("torch", "Tensor._use_count, torch._C._storage_Use_Count, Tensor._is_zerotensor",
                   "replaying the autograd engine's in-place gradient accumulation under the CPU tracker "
                   "(its bytes are those under a dispatch mode)", _references_counted)


def references_counted() -> bool:
    """Whether the engine's "last reference" test can be replayed (:data:`REFERENCES`, run once)."""
    return holds(REFERENCES)
