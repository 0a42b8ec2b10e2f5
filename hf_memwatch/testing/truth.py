"""PyTorch's own CPU allocator accounting, read from ``torch.profiler`` memory events.

The reference every CPU figure of hf-memwatch is checked against (tests, ``benchmarks/accuracy.py``):
bytes live before the profiled window plus the highest running sum of the ``[memory]`` byte deltas
the CPU allocator reported inside it. :class:`StepMarker` brackets each optimizer step with a
``record_function`` range so the peak can be read per step.

Use :func:`cpu_memory_profile` rather than a bare ``profile(...)``: the CPU allocator remembers the
size of every block allocated under *any* earlier profiler session, so garbage of an earlier run that
the cycle collector frees inside the window would show up as negative deltas (seen: -4.7 MB on a
BERT run that followed a GPT-2 run in one process). Collecting first keeps the window clean.

Usage:
    >>> trainer.add_callback(StepMarker())                               # doctest: +SKIP
    >>> with cpu_memory_profile() as prof:                               # doctest: +SKIP
    ...     trainer.train()
    >>> step_peaks(prof, baseline=live_bytes_before)                   # doctest: +SKIP
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import TrainerCallback

STEP_MARK = "hf_memwatch.testing.truth.step"


def cpu_memory_profile() -> profile:
    """A ``torch.profiler.profile`` recording CPU memory events, started after a full garbage collection."""
    gc.collect()
    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


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


class StepMarker(TrainerCallback):
    """Opens a profiler range at ``on_step_begin`` and closes it at ``on_step_end``."""

    def __init__(self) -> None:
        self._range: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._range = torch.profiler.record_function(STEP_MARK)
        self._range.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None


def cpu_memory_deltas(prof: Any) -> list[tuple[int, int]]:
    """(time in ns, byte delta) of every CPU allocator event the profiler saw, in time order.

    Allocations inside an operator are folded into the operator in ``prof.events()``; the raw kineto
    events keep each one.
    """
    cpu = torch._C._autograd.DeviceType.CPU
    events = prof.profiler.kineto_results.events()
    return sorted(
        (event.start_ns(), event.nbytes())
        for event in events
        if event.name() == "[memory]" and event.device_type() == cpu
    )


def window_peak(prof: Any, baseline: int) -> int:
    """Peak live CPU bytes in the whole profiled window: ``baseline`` + highest running sum."""
    running = peak = baseline
    for _, delta in cpu_memory_deltas(prof):
        running += delta
        peak = max(peak, running)
    return peak


def step_peaks(prof: Any, baseline: int) -> list[int]:
    """Peak live CPU bytes inside each :class:`StepMarker` range, in step order."""
    steps = sorted(
        (event.start_ns(), event.end_ns())
        for event in prof.profiler.kineto_results.events()
        if event.name() == STEP_MARK
    )
    deltas = cpu_memory_deltas(prof)
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
