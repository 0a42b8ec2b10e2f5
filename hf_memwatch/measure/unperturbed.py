"""Kernels that a dispatch mode changes, run as PyTorch runs them unobserved.

Any ``TorchDispatchMode`` on the stack — even one that does nothing — makes ATen's
``isTensorSubclassLike()`` true for every tensor (``c10::impl::dispatch_mode_enabled()``), and some
C++ code takes a functional, out-of-place branch then, meant for subclasses and tracing:

============================================  ==============================  =====================
C++ caller (torch 2.13)                       unobserved                      under any mode
============================================  ==============================  =====================
``torch::autograd::accumulate`` (the engine   ``old.add_(new)`` when the      ``old + new``: one more
adding two gradients of one input)            buffer holds the last reference  gradient-sized buffer
``at::native::gather_backward``               ``zeros.scatter_add_(...)``     ``zeros.scatter_add``
============================================  ==============================  =====================

Measured with the profiler's memory events: TRL's fp32 ``selective_log_softmax`` (gather +
logsumexp, ORPO/CPO) allocated 50% more in its backward under a no-op mode; Mamba's slow path
(a sequential scan: every step's tensors get several gradients) +6.3% on the step's peak; a whole
ORPO step +13.6%. The CPU tracker and the estimator's replay see these two operators arrive from
those callers (the C++ frames of the call, read only for these operators; their names and the
symbolizer live in :mod:`hf_memwatch.compat.torch_frames`, probed at first use) and run the in-place
variant the unobserved code runs, with the same condition — the engine's "last reference" test
replayed with the references the mode's handler itself adds subtracted (calibrated once per
process on ``gather_backward``, whose buffer is a C++ local). The values are bit-identical (the
same elementwise kernel), the bytes are those of the unobserved run.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..compat.torch_frames import (
    ACCUMULATE_CALLERS,
    GATHER_BACKWARD_CALLER,
    callers,
    frames_named,
    in_autograd_node,
    is_zerotensor,
    references,
    references_counted,
)
from ..compat.torch_internals import FakeTensor, FakeTensorMode, TorchDispatchMode, disable_current_modes
from ..compat.torch_internals import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

aten = torch.ops.aten


class _Probe(TorchDispatchMode):
    """Reads the counts of ``gather_backward``'s buffer, which only its C++ frame holds."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: tuple[int, int] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.scatter_add.default and self.counts is None:
            self.counts = references(args[0])
        return func(*args, **(kwargs or {}))


@functools.cache
def _handler_references(fake: bool) -> tuple[int, int] | None:
    """References a handler adds beyond the C++ caller's one, for real or fake tensors (None: unknown)."""
    probe = _Probe()
    try:
        with disable_current_modes(), torch.inference_mode(False), torch.enable_grad():
            mode: Any = None
            if fake:
                mode = FakeTensorMode()
                mode.__enter__()
            try:
                source = torch.zeros(4, requires_grad=True)
                with probe:
                    torch.gather(source, 0, torch.zeros(1, dtype=torch.long)).sum().backward()
            finally:
                if mode is not None:
                    mode.__exit__(None, None, None)
    except Exception:  # noqa: BLE001 - never fail the run: the operators then run as called
        return None
    if probe.counts is None:
        return None
    return probe.counts[0] - 1, probe.counts[1] - 1


def _plain_kind(tensor: Any) -> bool | None:
    """False for a plain tensor, True for a fake one, None for anything else (left alone)."""
    if type(tensor) is torch.Tensor:
        return False
    return True if type(tensor) is FakeTensor else None


def _engine_accumulates_in_place(old: torch.Tensor, new: Any) -> bool:
    """``can_accumulate_inplace(old)`` of ``torch/csrc/autograd/input_buffer.cpp``, as unobserved."""
    fake = _plain_kind(old)
    if fake is None or not isinstance(new, torch.Tensor) or torch.is_grad_enabled():
        return False
    if old.layout != torch.strided or new.layout != torch.strided or old.is_nested or is_zerotensor(old):
        return False
    if old.shape != new.shape or old.dtype != new.dtype or not is_non_overlapping_and_dense(old):
        return False
    extra = _handler_references(fake) if references_counted() else None
    if extra is None:
        return False
    tensor_refs, storage_refs = references(old)
    return tensor_refs - extra[0] == 1 and storage_refs - extra[1] == 1


def _add(args: tuple, kwargs: dict[str, Any]) -> Any:
    if kwargs or len(args) != 2 or not in_autograd_node():
        return None
    old, new = args
    if not isinstance(old, torch.Tensor) or not _engine_accumulates_in_place(old, new):
        return None
    if not frames_named():
        return None
    found = callers()
    if not any(caller in found for caller in ACCUMULATE_CALLERS):
        return None
    return aten.add_.Tensor(old, new)


def _scatter_add(args: tuple, kwargs: dict[str, Any]) -> Any:
    if kwargs or len(args) != 4 or _plain_kind(args[0]) is None or not in_autograd_node():
        return None
    if not frames_named() or GATHER_BACKWARD_CALLER not in callers():
        return None
    return aten.scatter_add_.default(*args)


def prepare() -> None:
    """Calibrate the handler's own references (a tiny gather backward, real and fake) outside any
    mode; probe the C++ frame names (:mod:`hf_memwatch.compat.torch_frames`: failed, warned once)."""
    frames_named()
    references_counted()
    _handler_references(False)
    _handler_references(True)


_HANDLERS = {aten.add.Tensor: _add, aten.scatter_add.default: _scatter_add}
OPERATORS = frozenset(_HANDLERS)


def run_unperturbed(func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Run ``func`` (one of :data:`OPERATORS`) as it runs unobserved; None when it runs as called.

    Example (no autograd node is running, so nothing to change):
        >>> run_unperturbed(aten.add.Tensor, (torch.ones(2), torch.ones(2)), {}) is None
        True
    """
    return _HANDLERS[func](args, kwargs)
