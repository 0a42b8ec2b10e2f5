"""torch's private names that the CPU tracker and the estimator are built on, and their probe.
Verified on torch 2.13.0 (:mod:`hf_memwatch.compat.versions`).

These are not a feature that can be switched off: the tracker is a ``TorchDispatchMode`` keyed by
storage, the estimator replays the step under ``FakeTensorMode``. Without one of them nothing of
hf-memwatch can count a byte, so a torch that lacks one fails at once with one
:class:`~hf_memwatch.core.errors.MemWatchConfigError` line naming torch's release and the name (at
import for a removed name; at ``MemWatch()``, ``estimate`` and the CLI, through
:func:`~hf_memwatch.compat.stack.check_stack`, for a changed behaviour: :data:`STORAGE_KEY`).

=====================================================  ==============================================
private thing (torch 2.13)                             what relies on it
=====================================================  ==============================================
``torch.utils._python_dispatch``: ``TorchDispatchMode``,  the tracker and every replay mode; the
``_disable_current_modes``, ``_get_current_dispatch_``    estimator leaves the caller's modes, the RNG
``mode_stack``, ``_push_mode``/``_pop_mode``,             counting finds the active trackers, DTensor
``is_traceable_wrapper_subclass``                         & co. are unwrapped to their storages
``torch._subclasses.fake_tensor``: ``FakeTensorMode``,     the estimator's replay on fake tensors
``FakeTensor``, ``is_fake``
``torch.utils._pytree``: ``tree_leaves``, ``tree_flatten``,  an operator's inputs walked (views, in-place)
``tree_unflatten``
``torch._prims_common.is_non_overlapping_and_dense_or_false``  the autograd engine's in-place test replayed
``UntypedStorage._cdata``                              a storage's identity (:func:`storage_key`): every
                                                       figure is a sum over distinct storages
``torch._C._current_graph_task_id``, ``Variable.``      the ZeRO-1/2 and FSDP2 gradient replays: probed
``_execution_engine.queue_callback``                   (:data:`AUTOGRAD_ENGINE`), without them the engine's
                                                       step is taken without its replay (one WARNING)
=====================================================  ==============================================

Example:
    >>> t = torch.zeros(4)
    >>> storage_key(t.untyped_storage()) == tensor_storage_key(t[1:]) != tensor_storage_key(torch.zeros(4))
    True
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..core.errors import MemWatchConfigError
from .probes import Probe, holds, require
from .versions import installed

try:
    from torch._prims_common import is_non_overlapping_and_dense_or_false
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, is_fake
    from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
    from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as current_dispatch_modes
    from torch.utils._python_dispatch import _pop_mode as pop_mode
    from torch.utils._python_dispatch import _push_mode as push_mode
    from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
except ImportError as gone:  # pragma: no cover - a torch this module was not verified on
    raise MemWatchConfigError(
        f"torch {installed('torch')}: {gone} - hf-memwatch's tracker and estimator need it "
        "(verified on torch 2.13: docs/compat.md)") from None

__all__ = [
    "FakeTensor", "FakeTensorMode", "TorchDispatchMode", "current_dispatch_modes", "disable_current_modes",
    "is_fake", "is_non_overlapping_and_dense_or_false", "is_traceable_wrapper_subclass", "pop_mode", "push_mode",
    "autocast_devices_of_caller", "autograd_engine_replayable", "cpu_kernel_keys", "in_backward",
    "queue_backward_callback", "storage_key", "tensor_storage_key", "tree_flatten", "tree_leaves", "tree_unflatten",
]


def storage_key(storage: Any) -> int:
    """The identity of an ``UntypedStorage`` (the address of its C++ ``StorageImpl``: the same for
    every view of it, stable while it lives), real or fake."""
    return storage._cdata


def tensor_storage_key(tensor: torch.Tensor) -> int:
    """:func:`storage_key` of the storage behind ``tensor``."""
    return storage_key(tensor.untyped_storage())


def _storage_keys_identify() -> bool:
    """Views share a key, distinct storages differ, and a fake tensor has one too."""
    with disable_current_modes():
        base, other = torch.zeros(4), torch.zeros(4)
        with FakeTensorMode():
            fake = torch.zeros(4)
            fake_key = tensor_storage_key(fake[1:])
        return (isinstance(tensor_storage_key(base), int) and tensor_storage_key(base[1:]) == tensor_storage_key(base)
                and tensor_storage_key(base) != tensor_storage_key(other) and isinstance(fake_key, int))


STORAGE_KEY = Probe("torch", "UntypedStorage._cdata (a storage's identity, views included)",
                    "counting memory by storage (the tracker and the estimator)", _storage_keys_identify)


def check() -> None:
    """Fail fast (one :class:`MemWatchConfigError` line) when the storage identity is not as verified;
    warn once when an operator the replay has a rule for is gone (:data:`~hf_memwatch.compat.torch_ops.OPS`)."""
    from .torch_ops import OPS

    require(STORAGE_KEY)
    holds(OPS)


def cpu_kernel_keys() -> Any:
    """The dispatch key set of the CPU kernel (``torch._C.DispatchKeySet(DispatchKey.CPU)``): an
    operator ``redispatch``-ed to it runs its CPU kernel below the Python dispatch key."""
    return torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _restores_python_tls() -> bool:
    """Inside a handler, the snapshot restores the caller's autocast (torch excluded it for the handler).
    Checked on a thread of its own: its dispatch state is fresh wherever the first use happens (the
    first use is itself inside a tracker's handler)."""
    seen: list[bool] = []
    thread = threading.Thread(target=_restore_in_a_handler, args=(seen,))
    thread.start()
    thread.join()
    return seen[:1] == [True]


def _restore_in_a_handler(seen: list[bool]) -> None:

    class Caller(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            with torch._C._RestorePythonTLSSnapshot():
                seen.append(torch.is_autocast_enabled("cpu"))
            return func(*args, **(kwargs or {}))

    try:
        with Caller(), torch.autocast("cpu", dtype=torch.bfloat16):
            torch.ones(1).add(1)
    except Exception:  # noqa: BLE001 - gone or changed: the probe fails (seen stays empty)
        seen.clear()


PYTHON_TLS = Probe("torch", "torch._C._RestorePythonTLSSnapshot (the dispatch state a handler's caller had)",
                   "running another library's operator under its caller's autocast (its kernel runs in its "
                   "own dtypes under the tracker)", _restores_python_tls)


def autocast_devices_of_caller(devices: tuple[str, ...]) -> list[str]:
    """Those of ``devices`` whose autocast the operator's caller had on (read inside a dispatch handler,
    where PyTorch has excluded autocast; :data:`PYTHON_TLS`): empty when it cannot be read."""
    if not holds(PYTHON_TLS):
        return []
    with torch._C._RestorePythonTLSSnapshot():
        return [device for device in devices if torch.is_autocast_enabled(device)]


def _autograd_engine_runs_callbacks() -> bool:
    """Outside a backward the graph task id is -1; inside one it is not, and a callback queued there
    runs when the backward ends (checked on real tensors, the caller's modes, no-grad and inference
    mode left)."""
    seen: list[int] = []
    with disable_current_modes(), torch.inference_mode(False), torch.enable_grad():
        leaf = torch.ones(1, requires_grad=True)
        outside = torch._C._current_graph_task_id()

        def hook(grad: torch.Tensor) -> torch.Tensor:
            seen.append(torch._C._current_graph_task_id())
            torch.autograd.Variable._execution_engine.queue_callback(lambda: seen.append(-2))
            return grad

        leaf.register_hook(hook)
        (leaf * 2).sum().backward()
    return outside == -1 and len(seen) == 2 and seen[0] != -1 and seen[1] == -2


AUTOGRAD_ENGINE = Probe("torch", "torch._C._current_graph_task_id, Variable._execution_engine.queue_callback",
                        "the ZeRO-1/2 and FSDP2 gradient replays (the engine's steps taken without them)",
                        _autograd_engine_runs_callbacks)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a recomputation's forward
    inside a checkpointed backward is)."""
    return torch._C._current_graph_task_id() != -1


def queue_backward_callback(callback: Any) -> None:
    """Run ``callback`` when the running backward ends (the autograd engine's ``queue_callback``, as
    DeepSpeed's and FSDP2's own epilogues do)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def autograd_engine_replayable() -> bool:
    """Whether :func:`in_backward` and :func:`queue_backward_callback` work as verified (:data:`AUTOGRAD_ENGINE`)."""
    return holds(AUTOGRAD_ENGINE)
