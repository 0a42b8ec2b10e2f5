"""PyTorch's own CPU allocator accounting, read from ``torch.profiler`` memory events.

The reference every CPU figure of hf-memwatch is checked against (tests, ``benchmarks/accuracy.py``):
bytes live before the profiled window plus the highest running sum of the ``[memory]`` byte deltas
the CPU allocator reported inside it. :class:`StepMarker` brackets each optimizer step with a
``record_function`` range so the peak can be read per step.

Use :func:`cpu_memory_profile` rather than a bare ``profile(...)``: the CPU allocator remembers the
size of every block allocated under *any* earlier profiler session, so garbage of an earlier run that
the cycle collector frees inside the window would show up as negative deltas (seen: -4.7 MB on a
BERT run that followed a GPT-2 run in one process). Collecting first keeps the window clean.

Frees on other threads. The reporter is thread-local too: a block allocated on the profiled
(training) thread whose last reference is dropped on a thread that does not profile — gloo's
worker threads, which hold a collective's tensors until after the training thread's ``wait()``
returned and its own references were gone — is freed without a ``[memory]`` event, and the
running sum keeps it for the rest of the window. Measured under DeepSpeed ZeRO-2 on 2 gloo ranks
(``tests/dist_scripts/deepspeed_zero.py``, test GPT-2): the flattened reduce bucket
(``allreduce_bucket``'s ``aten::cat``, 793,088 B on rank 0 over two steps), the gradient buffer
``grads_in_partition`` (1,305,600 B) and the tied embedding's gradient (``aten::add``, 512,000 B
a step) — 1.6 to 3.1 MB of phantom bytes by step 2, a different amount in every run (which thread
drops the last reference is a race). :func:`cpu_memory_deltas` with ``reconcile=True`` accounts for
them from the allocator's addresses (the profiler's event tree gives each event's pointer; a profile
with ``record_shapes`` gives each operator's input pointers): a pointer reported allocated again
with no free in between was freed before, and the free is placed at the end of the last operator
that read the block on the profiled thread (the training thread drops its references after its
last use; gloo's thread drops its own once the collective completed, which that use waited for),
else just before the new allocation. Measured on the same ZeRO-2 run (rank 0, step 2): the raw sum
13,874,544 B, reconciled 13,279,592 B, MemWatch 13,279,524 B. A block freed elsewhere whose address
is never reused in the window (ZeRO-3's all-gather buffers, ``reduce_scatter_single``'s clones) is
found with ``alive`` — :func:`alive_storages`, the storages every tensor Python can reach holds when
the window closes: a block no tensor holds then and whose free was never reported was freed, at its
last reader. ZeRO-3, rank 0, step 2: raw 19,838,047 B, reconciled 14,735,321 B, MemWatch 14,735,272 B.
Where such a free happens is an inference; the profiler bounds it. Earliest: the block's last reader
(the point figure above). Latest: the reuse of its address, or — for a block that gloo's worker read
(``gloo:all_gather`` lists its tensors) — that worker's next recorded event: ``ProcessGroupGloo::runLoop``
drops a work's tensors before it takes the next. The worker can drop them late: a tensor whose Python
object must be released takes the GIL first, and under CPU load the training thread holds it while it
allocates more. Seen on FSDP2 (2 gloo ranks, test GPT-2, fp32, 2 steps): one GPT2Block's all-gather
output (793,088 B) freed after the next allocations; the point figure read 4.6% under the live bytes
MemWatch saw (``tests/engines/test_distributed.py`` flaked; seen once, not reproduced in 13 later
launches under load, 45 profiled runs a rank). :func:`step_peak_bounds` gives each step's
peak with every such free at its earliest and at its latest time, and comparisons are made against that
interval (:func:`within_bounds`). Measured on that FSDP2 test under load (8 launches, 3 profiled runs, 2
ranks, 2 steps): the bounds equal in most steps; the widest by one unit's all-gather output (793,088 B:
+8.3% on a planned run's step 1, +6.8% on ``benchmarks/fsdp2_accuracy.py``'s steady steps), where the
worker records nothing between that collective and the step's peak; MemWatch inside every interval and
identical to the byte in every launch (it sees the free when it happens). The high bound cannot decide
that a run fits a budget; the point figure and MemWatch's peaks do.
Checked independently (``tests/test_truth_threads.py``) on a workload whose live bytes are known by
construction (blocks read on the profiled thread, freed by a long-lived worker thread at known points,
3 steps of 2-5 MiB blocks): where the worker frees after the training thread's last read and before its
next allocation — gloo's usual pattern — the point figure (the low bound) equals the known bytes to the
byte (raw: +11 to +26 MB kept for good); where the worker (after a 20 ms wait, its GIL) frees past
further allocations, the point figure is under the known bytes by that block (-4 MiB) and the bounds
hold them. Allocations made *on* those threads through PyTorch's allocator are reported, with their frees:
gloo's worker stages a flat copy of each all-gather's output there (``aten::empty`` inside
``gloo:all_gather``, alive while the collective runs; measured on ZeRO-3, 2 gloo ranks: 594,944 and
528,896 B at once at rank 0's step-2 peak). The truth counts them; a dispatch mode is thread-local,
so MemWatch counts them from the collective's dispatch to its completion
(:mod:`hf_memwatch.engines.gloo_staging`). gloo's internal buffers outside PyTorch's allocator are in
neither figure.

Usage:
    >>> trainer.add_callback(StepMarker())                               # doctest: +SKIP
    >>> with cpu_memory_profile() as prof:                               # doctest: +SKIP
    ...     trainer.train()
    >>> step_peaks(prof, baseline=live_bytes_before)                   # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import ctypes
import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from . import STEP_MARK  # defined in the package (step_marker reads it too); tests read it here


def cpu_memory_profile(record_shapes: bool = False) -> profile:
    """A ``torch.profiler.profile`` recording CPU memory events, started after a full garbage collection
    (``record_shapes``: operators' tensor inputs too, which ``reconcile`` reads)."""
    gc.collect()
    return profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=record_shapes)


def remembered_allocations() -> profile:
    """A started memory-profiling session whose only use is to make blocks allocated while it runs
    known to the CPU allocator's reporter; stop it where the measured window starts.

    The reporter reports a free only for a block it saw allocated under a memory-profiling session
    (on the same thread): a block allocated before the window and freed inside it (DDP's initial
    gradient buckets, freed when DDP rebuilds them in iteration 2) would otherwise stay in the
    running sum for good. Start this before building the model.
    """
    prime = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prime.start()
    return prime


@contextmanager
def ops_unrecorded(prof: profile, mark: str) -> Iterator[None]:
    """Inside, ``prof`` records every memory event but no operator (``toggle_collection_dynamic``).

    For a replay on fake tensors inside a profiled window (``estimate()``, the auto mode's planning):
    recording its thousands of operators, each with its input shapes under ``record_shapes``, doubled
    its cost (two ZeRO-3 estimates of the test GPT-2: 0.91 s unprofiled, 1.82 s profiled, 0.89 s inside
    this span). Fake tensors allocate nothing, so no byte of the truth is lost. A real operator inside
    is not recorded either, so ``reconcile`` does not know it read a block: a block freed on another
    thread whose last reader ran here would be placed at an earlier reader, or at its reuse. The
    planning's real operators are its agreement across ranks, on a few small tensors.
    The span is bracketed by two ranges, ``<mark>.begin`` and ``<mark>.end``, for :func:`left_alive`;
    ``ops_unrecorded(prof, mark)(call)`` wraps a function in it (one span per call)."""
    with torch.profiler.record_function(f"{mark}.begin"):
        pass
    prof.toggle_collection_dynamic(False, [ProfilerActivity.CPU])
    try:
        yield
    finally:
        prof.toggle_collection_dynamic(True, [ProfilerActivity.CPU])
        with torch.profiler.record_function(f"{mark}.end"):
            pass


def left_alive(prof: profile, mark: str) -> int:
    """CPU bytes of the blocks allocated inside the :func:`ops_unrecorded` span ``mark`` and not freed
    inside it (an estimate's caches: no training bytes).

    A free inside the span of a block made before it is a real free, not the span's: the training
    after it runs without that block, so it is not taken out. (The net bytes of the span took it out:
    in a two-rank ZeRO-3 draw, ``benchmarks/sweep_ranks.py`` seed 43, a 64,000 B block made during the
    model's construction was freed 14 ms into ``estimate(trainer)``, and the run's truth read
    +64,000 B at both steps against the same run without the estimate, which MemWatch's step peaks
    and the estimate matched.)
    """
    events = prof.profiler.kineto_results.events()
    (start,), (end,) = ([e.end_ns() for e in events if e.name() == f"{mark}.begin"],
                        [e.start_ns() for e in events if e.name() == f"{mark}.end"])
    made: dict[int, int] = {}
    for time, ptr, delta, _ in _Tree(prof).allocations:
        if start <= time <= end:
            if delta > 0:
                made[ptr] = delta
            elif delta < 0:
                made.pop(ptr, None)
    return sum(made.values())


def __getattr__(name: str) -> Any:
    """:class:`~hf_memwatch.testing.step_marker.StepMarker`, imported on first use: it is a Trainer
    callback, and importing transformers costs ~7 CPU s that a process reading the profiler alone
    (the gloo subprocess of ``tests/test_tracker.py``) need not pay."""
    if name == "StepMarker":
        from .step_marker import StepMarker

        return StepMarker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cpu_memory_deltas(prof: Any, reconcile: bool = False, alive: set[int] | None = None,
                      late: bool = False) -> list[tuple[int, int]]:
    """(time in ns, byte delta) of every CPU allocator event the profiler saw, in time order.

    Allocations inside an operator are folded into the operator in ``prof.events()``; the raw kineto
    events keep each one. ``reconcile``: with the frees made on other threads (see the module doc);
    ``alive`` (:func:`alive_storages` read right after the window): the blocks no tensor holds then
    were freed too. Each such free is placed at the earliest time it can have happened (its last
    reader), or with ``late`` at the latest (:func:`unreported_frees`): the two bound the truth.
    """
    if reconcile:
        return _reconciled_deltas(prof, alive, late)
    cpu = torch.autograd.DeviceType.CPU
    events = prof.profiler.kineto_results.events()
    return sorted(
        (event.start_ns(), event.nbytes())
        for event in events
        if event.name() == "[memory]" and event.device_type() == cpu
    )


class _Tree:
    """What ``reconcile`` reads from the profiler's event tree: (time in ns, pointer, byte delta, thread)
    of every CPU allocation event in time order; for each data pointer, (end time, thread) of the
    operators that read it; for each thread, the start times of all its events, sorted."""

    def __init__(self, prof: Any) -> None:
        self.allocations: list[tuple[int, int, int, int]] = []
        self.uses: dict[int, list[tuple[int, int]]] = {}
        self.starts: dict[int, list[int]] = {}
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            kind, fields = type(event.typed[1]).__name__, event.typed[1]
            if kind == "_ExtraFields_Allocation":
                if fields.device.type == "cpu":
                    self.allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size, event.start_tid))
                    self.starts.setdefault(event.start_tid, []).append(event.start_time_ns)
                continue
            self.starts.setdefault(event.start_tid, []).append(event.start_time_ns)
            if kind == "_ExtraFields_TorchOp":
                for tensor in fields.inputs:
                    if type(tensor).__name__ != "_TensorMetadata":
                        continue
                    ptr = tensor.storage_data_ptr
                    if ptr is None:
                        _repay_none()
                    elif ptr:
                        self.uses.setdefault(ptr, []).append((event.end_time_ns, event.start_tid))
            stack.extend(event.children)
        self.allocations.sort()
        for times in self.starts.values():
            times.sort()

    def bounds(self, ptr: int, born: int, thread: int, until: int) -> tuple[int, int]:
        """Earliest and latest time of the unreported free of the block allocated at ``born`` on
        ``thread`` at ``ptr``, given that it was freed before ``until``."""
        reads = [(end, tid) for end, tid in self.uses.get(ptr, ()) if born <= end <= until]
        # no reader recorded: at the reuse (the rule before the bounds), or at the allocation
        earliest = max((end for end, _ in reads), default=born if until == sys.maxsize else until)
        latest = until
        holders = {tid for _, tid in reads if tid != thread}  # gloo's worker threads
        if holders:  # the free is on one of them, after its last read there, before its next event
            nexts = [self._next_event(tid, max(end for end, t in reads if t == tid)) for tid in holders]
            if None not in nexts and max(nexts) >= earliest:  # else another thread dropped it last
                latest = min(latest, max(nexts))
        return earliest, max(earliest, latest)

    def _next_event(self, thread: int, after: int) -> int | None:
        times = self.starts.get(thread, [])
        index = bisect.bisect_right(times, after)
        return times[index] if index < len(times) else None


def unreported_frees(prof: Any, alive: set[int] | None = None) -> list[tuple[int, int, int]]:
    """(earliest, latest time in ns, bytes) of each free the profiler did not report (see the module doc).

    Earliest: the block's last reader, on any thread. Latest: the reuse of its address; for a block
    that a thread other than its allocating one read (gloo's worker: ``gloo:all_gather`` lists its
    tensors), that thread's next event after its last read — ``ProcessGroupGloo::runLoop`` drops a work's
    tensors before it starts the next work; else (a block no tensor holds at the end and whose address
    was never reused) the window's end (``sys.maxsize``).
    """
    return _unreported(_Tree(prof), alive)


def _unreported(tree: _Tree, alive: set[int] | None) -> list[tuple[int, int, int]]:
    live: dict[int, tuple[int, int, int]] = {}
    frees: list[tuple[int, int, int]] = []
    for time, ptr, delta, thread in tree.allocations:
        if delta > 0:
            unseen = live.pop(ptr, None)
            if unseen is not None:  # freed where the profiler does not look, before this reuse
                born, size, owner = unseen
                frees.append((*tree.bounds(ptr, born, owner, time), size))
            live[ptr] = (time, delta, thread)
        elif delta < 0:
            live.pop(ptr, None)
    for ptr, (born, size, owner) in live.items() if alive is not None else ():
        if ptr not in alive:  # no tensor holds it at the window's end, and no free was reported
            frees.append((*tree.bounds(ptr, born, owner, sys.maxsize), size))
    return frees


def _repay_none() -> None:
    """The reference to ``None`` that ``_TensorMetadata.storage_data_ptr`` returns without owning.

    For a tensor without storage (the fake tensors of a replay profiled inside the window: the auto
    mode's planning) torch 2.13 returns ``None`` without a new reference, so each read takes one
    from ``None`` (measured: 2,000 reads, ``sys.getrefcount(None)`` 2,000 lower). On Python 3.11
    ``None`` is not immortal: reconciling several profiled planned runs in one process aborted it
    ("none_dealloc: deallocating None"). A no-op where ``None`` is immortal (3.12+)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(None))


def alive_storages() -> set[int]:
    """Data pointers of every tensor storage Python can reach now (``gc``), for ``reconcile``'s ``alive``.

    Objects frozen by ``gc.freeze()`` are not listed (the suite freezes what its imports made, before any
    run: ``tests/conftest.py``); a measured window's tensors are made after such a freeze."""
    from ..compat.torch_internals import FakeTensor

    gc.collect()
    found: set[int] = set()
    for obj in gc.get_objects():
        try:  # a fake tensor (an estimate's) holds no real block: its data pointer is a deprecated read
            if isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor) and obj.device.type == "cpu":
                found.add(obj.untyped_storage().data_ptr())
        except Exception:  # noqa: BLE001 - fake, meta or sparse tensors have no storage to read
            continue
    return found


def _reconciled_deltas(prof: Any, alive: set[int] | None = None, late: bool = False) -> list[tuple[int, int]]:
    """:func:`cpu_memory_deltas` plus each free another thread made (see the module doc), in time order:
    a free placed at a reuse sorts before that allocation (same time, negative delta first)."""
    tree = _Tree(prof)
    placed = [(latest if late else earliest, -size) for earliest, latest, size in _unreported(tree, alive)]
    return sorted([(time, delta) for time, _, delta, _ in tree.allocations] + placed)


def window_peak(prof: Any, baseline: int) -> int:
    """Peak live CPU bytes in the whole profiled window: ``baseline`` + highest running sum."""
    running = peak = baseline
    for _, delta in cpu_memory_deltas(prof):
        running += delta
        peak = max(peak, running)
    return peak


def step_peaks(prof: Any, baseline: int, reconcile: bool = False, alive: set[int] | None = None,
               late: bool = False) -> list[int]:
    """Peak live CPU bytes inside each :class:`StepMarker` range, in step order (``reconcile``, ``late``: see
    :func:`cpu_memory_deltas`)."""
    steps = sorted(
        (event.start_ns(), event.end_ns())
        for event in prof.profiler.kineto_results.events()
        if event.name() == STEP_MARK
    )
    deltas = cpu_memory_deltas(prof, reconcile, alive, late)
    running, index, peaks = baseline, 0, []
    for start, end in steps:
        while index < len(deltas) and deltas[index][0] < start:
            running += deltas[index][1]
            index += 1
        peak = running
        while index < len(deltas) and deltas[index][0] <= end:
            running += deltas[index][1]
            peak = max(peak, running)
            index += 1
        peaks.append(peak)
    return peaks


def step_peak_bounds(prof: Any, baseline: int, alive: set[int] | None = None) -> list[tuple[int, int]]:
    """(low, high) of each step's reconciled peak: every unreported free at its earliest possible time,
    then at its latest (:func:`unreported_frees`); the live bytes lie between (``tests/test_truth_threads.py``)."""
    return list(zip(step_peaks(prof, baseline, True, alive), step_peaks(prof, baseline, True, alive, late=True)))


def within_bounds(measured: int, bounds: tuple[int, int], tolerance: float) -> bool:
    """``measured`` within ``tolerance`` (a share) of the interval ``bounds`` (:func:`step_peak_bounds`)."""
    low, high = bounds
    return low * (1 - tolerance) <= measured <= high * (1 + tolerance)
