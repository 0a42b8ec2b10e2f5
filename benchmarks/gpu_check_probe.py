"""The figures the GPU check reads, and the time each check is given (``benchmarks/gpu_check.py``).

:class:`CudaProbe` reads the caching allocator; :class:`CpuProbe` (the dry run) the CPU backend's
figures: a :class:`RunTracker` counting the weights and every storage the run allocates, as
PyTorch's CPU allocator (the profiler's ``[memory]`` events) does.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from gpu_check_report import CHECK_SHARES, ResultsFile

from hf_memwatch.measure.storage import nested_tensors
from hf_memwatch.measure.tracker import StorageTracker


# -- the device's figures -----------------------------------------------------------------------
class Probe:
    """The figures of the memory the checks read: allocated, its peak, reserved, OOMs, device used.

    :class:`CudaProbe` reads the caching allocator; :class:`CpuProbe` the CPU backend's figures.
    ``shares_memwatch_peak``: MemWatch resets this very peak counter at each snapshot (CUDA).
    """

    kind = "none"
    shares_memwatch_peak = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def session(self, model: Any, dataset: Any = None) -> contextlib.AbstractContextManager[Any]:
        """Around one training run (the CPU counts storages inside it, the dataset's left out)."""
        return contextlib.nullcontext()

    def allocated(self) -> int: raise NotImplementedError
    def peak(self) -> int: raise NotImplementedError
    def reset_peak(self) -> None: raise NotImplementedError
    def reserved(self) -> int | None: return None
    def peak_reserved(self) -> int | None: return None
    def num_ooms(self) -> int | None: return None
    def num_alloc_retries(self) -> int | None: return None
    def device_used(self) -> int | None: return None
    def total_memory(self) -> int | None: return None
    def synchronize(self) -> None: pass

    def free(self) -> None:
        """Drop what earlier runs left (the caching allocator's cache on CUDA), so each run starts alike."""
        gc.collect()


class CudaProbe(Probe):
    kind = "cuda"
    shares_memwatch_peak = True

    def allocated(self) -> int: return torch.cuda.memory_allocated(self.device)
    def peak(self) -> int: return torch.cuda.max_memory_allocated(self.device)
    def reset_peak(self) -> None: torch.cuda.reset_peak_memory_stats(self.device)
    def reserved(self) -> int | None: return torch.cuda.memory_reserved(self.device)
    def peak_reserved(self) -> int | None: return torch.cuda.max_memory_reserved(self.device)
    def num_ooms(self) -> int | None: return torch.cuda.memory_stats(self.device).get("num_ooms", 0)
    def num_alloc_retries(self) -> int | None: return torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
    def total_memory(self) -> int | None: return torch.cuda.mem_get_info(self.device)[1]
    def synchronize(self) -> None: torch.cuda.synchronize(self.device)

    def device_used(self) -> int | None:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def free(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


class RunTracker(StorageTracker):
    """A :class:`StorageTracker` of the weights and what the run allocates: the storages of
    ``before`` (the dataset's tensors, alive before the run) are left out.

    A view allocates nothing, yet a tracker counts the storage of every tensor an operator returns:
    the dataloader's ``dataset[i]`` (a ``select`` of the dataset's tensor) would count the whole
    dataset as allocated in the run. Measured on the dry run's attribution check against the
    profiler's ``[memory]`` events: +2,048 B at every snapshot, the 8 x 32 int64 token table. What
    PyTorch's CPU allocator counts is the weights plus what the run allocates (the project's truth,
    :mod:`hf_memwatch.testing.truth`); with the dataset left out the reader equals it at every
    snapshot but ``after_forward``, where neither it nor MemWatch sees the Python numbers autograd
    saves as 8-byte tensors (``0.5 * x``: 48 B on the tiny GPT-2).
    """

    def __init__(self, weights: list[torch.Tensor], before: Iterable[torch.Tensor] = ()) -> None:
        super().__init__("cpu")
        own = {t.untyped_storage()._cdata for t in weights}
        self._before: dict[int, weakref.ref] = {}
        for tensor in before:
            storage = tensor.untyped_storage()
            if storage._cdata not in own:
                self._before[storage._cdata] = weakref.ref(storage)
        self.register(weights)

    def _track_plain(self, tensor: torch.Tensor) -> None:
        if self._before and tensor.device.type == "cpu":
            ref = self._before.get(tensor.untyped_storage()._cdata)
            if ref is not None and ref() is not None:  # alive since before the run (a freed key is reused)
                return
        super()._track_plain(tensor)


class CpuProbe(Probe):
    """The CPU backend's figures: a :class:`RunTracker` entered around each run, weights registered."""

    kind = "cpu"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.tracker: StorageTracker = StorageTracker("cpu")

    @contextlib.contextmanager
    def session(self, model: Any, dataset: Any = None) -> Iterator[None]:
        before = [t for t in nested_tensors(dict(vars(dataset))) if t.device.type == "cpu"] if hasattr(
            dataset, "__dict__") else []
        self.tracker = RunTracker(list(model.parameters()) + list(model.buffers()), before)
        with self.tracker:
            yield

    def allocated(self) -> int: return self.tracker.allocated
    def peak(self) -> int: return max(self.tracker.peak, self.tracker.allocated)
    def reset_peak(self) -> None: self.tracker.reset_peak()

    def free(self) -> None:
        """Nothing: the tracker counts only what a run allocates, an earlier run's garbage is not in it
        (and a full collection costs about 0.3 s a run on the dry run's process)."""


CUDA_ONLY = {  # what the CPU dry run cannot do, and why (listed in the JSON's "skipped")
    "reserved": "the CPU allocator keeps no reserve (max_memory_reserved is CUDA's caching allocator)",
    "mem_get_info": "torch.cuda.mem_get_info: the device's used memory and the CUDA context are CUDA's",
    "num_ooms": "memory_stats()['num_ooms'] is counted by CUDA's caching allocator only",
    "fraction": "torch.cuda.set_per_process_memory_fraction limits CUDA's allocator only: the CPU run gets budget= "
                "the same bytes instead",
    "auto_find_batch_size": "its retries are triggered by CUDA out-of-memory errors; the CPU does not raise one",
    "overhead_goal": "CPU steps are tracked operator by operator: a CPU ratio says nothing of CUDA's, it is reported "
                     "only",
}


CPU_BLIND = {  # where the CPU backend's figures are not a truth to compare with
    "bnb": "bitsandbytes' CPU optimizer kernels allocate their temporaries inside one operator, where the CPU "
           "backend's tracker does not see them (the estimate counts them): compared, not counted on the CPU",
}


# -- time -----------------------------------------------------------------------------------------
@dataclass
class Context:
    """What a check is given: the probe, a scratch folder, its deadline and where results go."""

    probe: Probe
    workdir: str
    quick: bool
    deadline: float  # time.perf_counter() by which the check must end
    results: ResultsFile

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def fits(self, seconds: float) -> bool:
        """Whether ``seconds`` more (with 10 % slack) end before the deadline."""
        return 1.1 * seconds <= self.left()

    def skip(self, check: str, what: str, why: str) -> None:
        self.results.skip(check, what, why)

    @property
    def cuda(self) -> bool:
        return self.probe.kind == "cuda"


def measured_rows(ctx: Context, check: str, items: Sequence[Any], measure: Callable[[Any], dict[str, Any]],
                  failed: Callable[[Any, Exception], dict[str, Any]], publish: Callable[[list[dict[str, Any]]], None],
                  describe: Callable[[list[Any]], str], unit: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """``measure(item)`` for each item in order while the longest so far still fits the check's time: a
    failure is the row ``failed(item, exc)`` (the others still run), each row gets its ``seconds``, and
    ``publish(rows)`` follows every one. Returns the rows and the items dropped for time (listed in
    ``skipped``: ``describe(dropped)``, the seconds left and the longest ``unit``'s time)."""
    rows: list[dict[str, Any]] = []
    longest = 0.0
    for index, item in enumerate(items):
        if rows and not ctx.fits(longest):
            dropped = list(items[index:])
            ctx.skip(check, describe(dropped),
                     f"out of time: {ctx.left():.0f} s left, the longest {unit} took {longest:.0f} s")
            return rows, dropped
        begun = time.perf_counter()
        try:
            rows.append(measure(item))
        except Exception as exc:  # noqa: BLE001 - one item failing is reported, the rest still run
            rows.append(failed(item, exc))
            ctx.probe.free()
        rows[-1]["seconds"] = time.perf_counter() - begun
        longest = max(longest, rows[-1]["seconds"])
        publish(rows)
    return rows, []


def check_deadline(started: float, total_s: float, name: str, remaining_names: Sequence[str]) -> float:
    """This check's deadline: its share of the time left among the checks still to run (what an
    earlier check left unused goes to the later ones)."""
    left = max(0.0, started + total_s - time.perf_counter())
    shares = sum(CHECK_SHARES[n] for n in remaining_names)
    return time.perf_counter() + left * CHECK_SHARES[name] / shares
