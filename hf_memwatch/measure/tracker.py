"""Live-storage tracking for devices whose allocator keeps no statistics (the CPU), and for fake tensors.

PyTorch's CPU allocator has no ``memory_allocated()``. :class:`StorageTracker` is a
``TorchDispatchMode`` that sees every tensor an operator returns, registers each new storage with a
weak reference, and drops it when the storage dies: a live byte count and its peak, as the allocator
would report them. It only observes (``func`` runs unchanged, another library's Python kernel under
its caller's autocast: :func:`run_as_called`, the two operators whose C++ callers branch on "a
dispatch mode is active" as unobserved: :mod:`~hf_memwatch.measure.unperturbed`) so numerics and
bytes are untouched, and it nests
with other dispatch modes and with ``torch.profiler``. Under ``FakeTensorMode`` the same tracker
measures a step without allocating it, which is how the estimator works.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..compat.torch_internals import (
    TorchDispatchMode,
    autocast_devices_of_caller,
    cpu_kernel_keys,
    pop_mode,
    push_mode,
    storage_key,
    tensor_storage_key,
    tree_leaves,
)
from ..engines.gloo_staging import staged
from .rng_states import count_rng_states, uncount_rng_states
from .storage import plain_tensors
from .unperturbed import OPERATORS as _UNPERTURBED
from .unperturbed import prepare as _prepare_unperturbed
from .unperturbed import run_unperturbed

# Operator namespaces whose kernels are PyTorch's own: they run alike in a dispatch mode or not.
_BUILT_IN_NAMESPACES = frozenset({"aten", "prim", "prims"})
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")
# Operators whose CPU kernel is Python code with temporaries of its own, which a dispatch mode
# would not see (it is popped while its handler runs): their kernel is run with the tracker
# observing its inner operators. bitsandbytes 0.50's CPU 8-bit AdamW step dequantizes both states
# to fp32 and builds the update in fp32: 5 x 4 B per element of the parameter at its peak (measured
# with the profiler on a 256 x 512 parameter: 2,621,460 B; tracked before: 0, now 2,621,440).
_OBSERVED_INSIDE = frozenset({
    "bitsandbytes::optimizer_update_8bit_blockwise",
    "bitsandbytes::optimizer_update_32bit",
})


def run_as_called(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Run another library's operator (``bitsandbytes::gemm_4bit``...) with the autocast its caller had.

    A dispatch mode runs below autocast: PyTorch excludes it while the mode handles an operator, so
    a kernel written in Python (as bitsandbytes' CPU kernels are) would run its own inner operators
    in fp32 where, unobserved, autocast makes them bf16 — monitoring would change the numbers. The
    caller's autocast (PyTorch keeps a snapshot of its dispatch state for handlers) is restored
    around the kernel, nothing else.
    """
    devices = autocast_devices_of_caller(_AUTOCAST_DEVICES)
    if not devices:
        return func(*args, **kwargs)
    for device in devices:
        torch.set_autocast_enabled(device, True)
    try:
        return func(*args, **kwargs)
    finally:
        for device in devices:
            torch.set_autocast_enabled(device, False)


# Allocation sequences being recorded (see recording_allocations); None: no recording.
_RECORDING: contextvars.ContextVar[list[list[tuple[int, int]]] | None] = contextvars.ContextVar(
    "hf_memwatch_allocation_recording", default=None)


@contextlib.contextmanager
def recording_allocations() -> Iterator[list[list[tuple[int, int]]]]:
    """Within, each :class:`StorageTracker` created records its allocation sequence: the list yielded
    gets one list of ``(key, nbytes)`` events per tracker, in creation order — ``nbytes > 0`` a storage
    counted (as sized by ``round_to``), ``0`` the storage ``key`` freed. The CUDA reserve prediction
    replays it (:mod:`hf_memwatch.estimation.cuda_allocator`).

    Example:
        >>> with recording_allocations() as traces:
        ...     tracker = StorageTracker("cpu")
        ...     with tracker:
        ...         x = torch.empty(1024, dtype=torch.uint8)
        ...         del x
        >>> [nbytes for _, nbytes in traces[0]]
        [1024, 0]
    """
    traces: list[list[tuple[int, int]]] = []
    token = _RECORDING.set(traces)
    try:
        yield traces
    finally:
        _RECORDING.reset(token)
if TYPE_CHECKING:
    from .peak_tensors import PeakCensus


class _StorageRef(weakref.ref):
    __slots__ = ("key", "nbytes")


class StorageTracker(TorchDispatchMode):
    """Count live storages on one device type; ``allocated`` and ``peak`` in bytes.

    Example:
        >>> tracker = StorageTracker("cpu")
        >>> with tracker:
        ...     x = torch.empty(1024, dtype=torch.uint8)
        ...     y = x + 1
        ...     del y
        >>> tracker.allocated, tracker.peak
        (1024, 2048)
    """

    counts_rng_states = True  # measure/rng_states registers the CPU RNG states it returns with such a mode
    # Whether the Python CPU kernels of ``_OBSERVED_INSIDE`` run observed (on a CPU device): what a CPU
    # run allocates. A replay that decides per target itself (the estimate's tracker) turns it off.
    observes_python_kernels = True

    def __init__(self, device_type: str = "cpu", round_to: int = 1) -> None:
        super().__init__()
        self.device_type = device_type
        self.round_to = round_to  # size each storage as the target allocator would (512 B on CUDA)
        self.allocated = 0
        self.peak = 0
        # Bytes gloo's worker threads hold for all-gathers in flight (gloo_staging): in ``peak``, not in
        # ``allocated`` (no storage of the live set). ``_works``: (bytes, future) of each running one,
        # polled on this thread (:meth:`_settle`); no callback on gloo's thread.
        self.in_flight = 0
        self._works: list[tuple[int, Any]] = []
        self._live: dict[int, _StorageRef] = {}
        self._on_free = self._free  # bound once: one object for every weakref callback
        recording = _RECORDING.get()
        self.events: list[tuple[int, int]] | None = None  # the allocation sequence, when recorded
        if recording is not None:
            self.events = []
            recording.append(self.events)
        # Re-read storage sizes (refresh_sizes) at each would-be peak: on once a DTensor (FSDP2) is
        # registered, as its all-gathers are resized outside operators; off, no per-peak cost.
        self.watch_resizes = False
        # Optional: told of each allocation, free and new peak (the tensors at a peak); None costs nothing.
        self.census: PeakCensus | None = None
        self._func: Any = None  # the operator whose outputs are being tracked (None: registered)
        # Count a storage first seen as an operator's in-place/view output of an input it was not
        # tracking as resident since the window opened (``peak`` raised too): on for DDP, whose
        # reducer allocates its gradient buckets in C++ before any tracked step and writes into
        # them first in the middle of a backward. Off: no per-operator cost.
        self.resident_aliases = False
        self._args: Any = None
        # Optional ``(func, args, kwargs) -> (output, bytes)``: runs a built-in operator and says what its
        # CPU kernel allocated and freed inside itself (oneDNN's packed operand blocks of a bf16 product,
        # the flash-attention kernel's per-thread buffers): the allocator counts them, the dispatcher never
        # sees them, so they are added to the peak at the operator's end as a transient. Set by the live
        # monitor for a CPU run (``integration.session.live_backend``: ``estimation.kernel_workspaces.run_cpu_kernel``).
        self.kernel_call: Any = None

    # -- accounting -------------------------------------------------------------------------
    def _free(self, ref: _StorageRef) -> None:
        if self._live.get(ref.key) is ref:
            del self._live[ref.key]
            self.allocated -= ref.nbytes
            if self.events is not None:
                self.events.append((id(ref), 0))
            if self.census is not None:
                self.census.on_free(ref.key)

    def _track_plain(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device_type:
            return
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        nbytes = storage.nbytes()
        if self.round_to > 1 and nbytes:
            nbytes = -(-nbytes // self.round_to) * self.round_to
        known = self._live.get(key)
        if known is not None:
            if known.nbytes == nbytes:
                return
            self.allocated += nbytes - known.nbytes  # resized in place (out= ops, resize_)
            known.nbytes = nbytes
            if self.events is not None:  # to an allocator: a free, then a new block
                self.events.extend(((id(known), 0), (id(known), nbytes)))
            if self.census is not None:
                self.census.on_resize(key, nbytes)
        elif nbytes:
            ref = _StorageRef(storage, self._on_free)
            ref.key = key
            ref.nbytes = nbytes
            self._live[key] = ref
            self.allocated += nbytes
            if self.resident_aliases and self._func is not None and self._is_input_storage(key):
                self.peak += nbytes  # alive before this operator, so all through the window
            if self.events is not None:
                self.events.append((id(ref), nbytes))
            if self.census is not None:
                self.census.on_alloc(key, nbytes, tensor, self._func)
        else:
            return
        if self.watch_resizes and self.allocated > self.peak:
            self.refresh_sizes()  # storages resized outside any operator (FSDP2's resize_(0)) first
        if self._works:
            self._settle()
        if self.allocated + self.in_flight > self.peak:
            self.peak = self.allocated + self.in_flight
            if self.census is not None:
                self.census.on_peak()
            self.on_new_peak()

    def _settle(self) -> None:
        """Drop the all-gathers whose work completed (gloo freed its staging copy before), read with
        ``Future.done()`` on this thread, at every operator and snapshot while one runs.

        No Python runs on gloo's thread. A done-callback there (how this was counted before) made gloo's
        worker wait for the GIL inside the future's completion, still holding the work and so its output
        (DeepSpeed's flat all-gather buffer): with this thread keeping the GIL for a second the work had
        not completed (tests/test_tracker.py). Under load, buffers DeepSpeed had released lived on into the
        backward (CI, ZeRO-3 + offload, 2 gloo ranks, rank 0: +265,728 B and +512,000 B of ``aten.empty``
        flat buffers alive past their parameters, step peak +1.7%), and once a rank aborted after its last
        line (``terminate called without an active exception``: a thread still waiting for the GIL when the
        interpreter finalizes, most likely; not reproduced since). A held future keeps its
        value (the output) alive, so it is dropped at the first operator after it completed: before
        DeepSpeed's release (``param.data = torch.empty(0)``, an operator) can be the output's last one."""
        running = []
        for nbytes, future in self._works:
            if future.done():
                self.in_flight -= nbytes
            else:
                running.append((nbytes, future))
        self._works = running

    def _stage(self, func: Any, out: Any) -> None:
        """Count a CPU all-gather's staging copy on gloo's thread (:mod:`.gloo_staging`) until its work
        completes; at its dispatch the output's size is in the peak either way (the caller's thread
        holds a copy of that size inside the operator too: measured, freed before it returns)."""
        found = staged(func, out)
        if found is None:
            return
        nbytes, future = found
        if self._works:
            self._settle()
        self._works.append((nbytes, future))
        self.in_flight += nbytes
        if self.allocated + self.in_flight > self.peak:
            self.peak = self.allocated + self.in_flight
            if self.census is not None:
                self.census.on_peak()  # the storages alive at this moment, with the copy in flight
            self.on_new_peak()

    def _is_input_storage(self, key: int) -> bool:
        """Whether an input of the operator being tracked has the storage ``key`` (an in-place or
        view result: the storage existed before the operator ran)."""
        for leaf in tree_leaves(self._args):
            if isinstance(leaf, torch.Tensor):
                try:
                    if tensor_storage_key(leaf) == key:
                        return True
                except (RuntimeError, NotImplementedError):  # a subclass without a storage
                    continue
        return False

    def refresh_sizes(self) -> int:
        """Re-read the size of every live storage; returns the bytes the count changed by.

        ``UntypedStorage.resize_`` is no operator (the dispatch mode never sees it): FSDP2 frees its
        all-gathered parameters with ``resize_(0)`` and allocates them again with ``resize_(n)``. A
        storage resized so is counted at its size when the peak could rise and when the live set is
        read, so a freed all-gather is neither in the peak nor in ``other`` (with ``watch_resizes``,
        set when a DTensor is registered; :meth:`live` always re-reads).
        """
        change = 0
        for ref in list(self._live.values()):
            storage = ref()
            if storage is None:
                continue
            nbytes = storage.nbytes()
            if self.round_to > 1 and nbytes:
                nbytes = -(-nbytes // self.round_to) * self.round_to
            if nbytes != ref.nbytes:
                change += nbytes - ref.nbytes
                ref.nbytes = nbytes
        self.allocated += change
        if change > 0 and self.allocated > self.peak:  # grown back in place (resize_(n)) since last seen
            self.peak = self.allocated
            self.on_new_peak()
        return change

    def on_new_peak(self) -> None:
        """Called when ``peak`` rises; subclasses record what is live at that moment."""

    def register(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count storages created outside the tracker (weights, a batch loaded between steps)."""
        self._func = None
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                if not self.watch_resizes and type(tensor).__name__ == "DTensor":
                    self.watch_resizes = True  # FSDP2: all-gathers freed by resize_(0)
                for plain in plain_tensors(tensor):
                    self._track_plain(plain)

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes (with the all-gathers in flight)."""
        if self._works:
            self._settle()
        self.peak = self.allocated + self.in_flight
        if self.census is not None:
            self.census.start_window()

    def live(self) -> Mapping[int, int]:
        """Snapshot of live storage key -> bytes (sizes re-read: :meth:`refresh_sizes`)."""
        self.refresh_sizes()
        return {key: ref.nbytes for key, ref in list(self._live.items())}

    def live_refs(self) -> Mapping[int, Any]:
        """Live storage key -> the tracker's reference to it (one object per storage lifetime, so two
        reads name the same storage only when they hold the same reference). A read-only view."""
        return types.MappingProxyType(self._live)

    def live_storage_objects(self) -> dict[int, torch.UntypedStorage]:
        """Live storage key -> the storage itself, for storages still reachable."""
        storages = {}
        for key, ref in list(self._live.items()):
            storage = ref()
            if storage is not None:
                storages[key] = storage
        return storages

    # -- dispatch ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._works:
            self._settle()  # before the operator: the futures held here keep no output alive into it
        transient = 0
        if func in _UNPERTURBED:  # kernels a mode would change: as they run unobserved
            out = run_unperturbed(func, args, kwargs or {})
            if out is None:
                out = func(*args, **(kwargs or {}))
        elif getattr(func, "namespace", "aten") in _BUILT_IN_NAMESPACES:  # (a wrapper of ours: plain)
            if self.kernel_call is not None:
                out, transient = self.kernel_call(func, args, kwargs or {})
            else:
                out = func(*args, **(kwargs or {}))
        elif (self.observes_python_kernels and self.device_type == "cpu"
              and func.name().partition(".")[0] in _OBSERVED_INSIDE):
            out = run_as_called(functools.partial(self._run_observed, func), args, kwargs or {})
        else:
            out = run_as_called(func, args, kwargs or {})
            if self.device_type == "cpu" and getattr(func, "namespace", None) == "c10d":
                self._stage(func, out)  # gloo's all-gather staging, on its thread (unseen)
        self._func = func
        self._args = (args, kwargs) if self.resident_aliases else None
        try:
            self._track_outputs(out)
        finally:
            self._args = None  # never keep an input alive
        self.add_transient(transient)
        return out

    def _track_outputs(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            self._track_output(out)
        elif isinstance(out, (tuple, list)):
            for item in out:
                if isinstance(item, torch.Tensor):
                    self._track_output(item)
                elif isinstance(item, (tuple, list)):  # _foreach ops and friends
                    for inner in item:
                        if isinstance(inner, torch.Tensor):
                            self._track_output(inner)

    def add_transient(self, nbytes: int) -> None:
        """``nbytes`` a kernel held inside itself on top of the live set (with its outputs): the peak
        rises to it where it is the highest, ``allocated`` is unchanged (freed before the kernel returned)."""
        if nbytes > 0 and self.allocated + self.in_flight + nbytes > self.peak:
            self.peak = self.allocated + self.in_flight + nbytes
            if self.census is not None:
                self.census.on_peak()
            self.on_new_peak()

    def _run_observed(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``func``'s CPU kernel with this mode on the stack again, so its inner operators are
        tracked (``redispatch`` below the Python key: the handler is not entered a second time)."""
        push_mode(self)
        try:
            return func.redispatch(cpu_kernel_keys(), *args, **kwargs)
        finally:
            pop_mode()

    def _track_output(self, tensor: torch.Tensor) -> None:
        if type(tensor) is torch.Tensor or not hasattr(tensor, "__tensor_flatten__"):
            self._track_plain(tensor)
        else:
            for plain in plain_tensors(tensor):
                self._track_plain(plain)

    def __enter__(self) -> StorageTracker:
        _prepare_unperturbed()  # once per process, before any operator is handled
        count_rng_states()  # checkpointing's saved CPU RNG state: no operator makes it (rng_states.py)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            uncount_rng_states()  # torch's own get_rng_state back once no tracker is entered
            if self._works:
                self._settle()  # the completed works' futures let go (their outputs) when the mode is left

    # The mode is entered and left from different Trainer events, not in one ``with`` block.
    def start(self) -> None:
        """Enter the dispatch mode (pair with :meth:`stop`)."""
        self.__enter__()

    def stop(self) -> None:
        """Leave the dispatch mode entered by :meth:`start`."""
        self.__exit__(None, None, None)
