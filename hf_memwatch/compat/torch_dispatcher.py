"""torch's dispatcher internals the CUDA autocast replay overrides kernels with, with their probe.
Verified on torch 2.13.0.

``estimation/cuda_autocast.py`` registers CUDA autocast's policy as the replay's AutocastCPU kernels
for the duration of a CUDA-target estimate: it lists the build's AutocastCPU registrations
(``torch._C._dispatch_get_registrations_for_dispatch_key``), reads each op's schema arguments
(``OpOverload._schema``), runs the op below the autocast key (``torch._C._ExcludeDispatchKeyGuard``),
caches casts of leaf non-view weights (``Tensor._is_view``) and removes its registrations on exit
(``Library._destroy``). Without them (:data:`AUTOCAST_DISPATCH` failed) a CUDA target is replayed
under CPU autocast's policy, warned (the fp32 copies CUDA keeps of softmax, norms... are not counted).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload

from .probes import Probe, holds

__all__ = ["AUTOCAST_DISPATCH", "OpOverload", "destroy_library", "dispatch_registrations", "excluding_dispatch_key",
           "is_view", "op_arguments", "overrides_autocast"]


def _dispatcher_as_verified() -> bool:
    names = torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")
    arguments = torch.ops.aten.mm.default._schema.arguments
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
        pass
    return ("aten::mm" in names and [a.name for a in arguments] == ["self", "mat2"]
            and callable(getattr(torch.library.Library, "_destroy", None)) and torch.zeros(2)[1:]._is_view())


AUTOCAST_DISPATCH = Probe("torch", "torch._C._dispatch_get_registrations_for_dispatch_key, _ExcludeDispatchKeyGuard, "
                          "OpOverload._schema, Library._destroy, Tensor._is_view",
                          "CUDA autocast's policy in a CUDA-target replay (CPU autocast's is used)",
                          _dispatcher_as_verified)


def overrides_autocast() -> bool:
    """Whether the CUDA autocast policy can be installed (:data:`AUTOCAST_DISPATCH`, run once)."""
    return holds(AUTOCAST_DISPATCH)


def dispatch_registrations(dispatch_key: str) -> list[str]:
    """The ops the running build registers a kernel for under ``dispatch_key`` (``"aten::mm"``...)."""
    return torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key)


def op_arguments(op: Any) -> Any:
    """The schema arguments of an ``OpOverload``."""
    return op._schema.arguments


def excluding_dispatch_key(name: str) -> Any:
    """A guard that runs its body with dispatch key ``name`` (``"AutocastCPU"``) excluded."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, name)))


def is_view(tensor: torch.Tensor) -> bool:
    return bool(tensor._is_view())


def destroy_library(lib: Any) -> None:
    """Remove every registration ``lib`` (a ``torch.library.Library``) made."""
    lib._destroy()
