"""The staging copy gloo's worker thread allocates for an all-gather, which no dispatch mode sees.

``ProcessGroupGloo`` gathers into one flat tensor of the whole output (``newLikeFlat``) on its
worker thread, then copies it into the caller's output; the flat tensor lives while the collective
runs (measured with the profiler, which records gloo's threads: 2 gloo ranks, a 4,000 B input, an
8,000 B ``all_gather_into_tensor`` or ``all_gather`` output: one 8,000 B block allocated and freed
inside ``gloo:all_gather`` on the worker thread; ``all_reduce`` / ``broadcast``: none). A dispatch
mode is thread-local, so :class:`~hf_memwatch.measure.tracker.StorageTracker` never sees it; under
DeepSpeed ZeRO-3 (2 gloo ranks, test GPT-2, 1 x 8 + checkpointing) two prefetching all-gathers are in
flight at once (594,944 and 528,896 B), which is where the rank's peak is. The tracker counts the
output's bytes from the collective's dispatch until its ``Work`` reports completion (gloo frees the
flat copy before it marks the work completed).
"""

from __future__ import annotations

from typing import Any

import torch

# ``ProcessGroupGloo::Options``' ``threads{2}``: each worker holds the last work it ran (its tensors) until it takes
# the next; the replays' worst branch of that race keeps the last two collectives' tensors alive until more are issued.
HELD_WORKS = 2

# c10d's all-gather operators whose gloo CPU kernel stages the whole output (torch 2.13).
GATHERS = frozenset({
    "c10d::_allgather_base_",
    "c10d::allgather_",
    "c10d::allgather_coalesced_",
    "c10d::allgather_into_tensor_coalesced_",
})


def gloo_ranks(device: str) -> bool:
    """Whether the ranks' collectives are gloo's: this process's group where one exists, else the
    ranks' device (CPU ranks: gloo; CUDA ranks: NCCL)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend()) == "gloo"
    return device == "cpu"


def _cpu_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() if value.device.type == "cpu" else 0
    if isinstance(value, (list, tuple)):
        return sum(_cpu_bytes(item) for item in value)
    return 0


def staged(func: Any, out: Any) -> tuple[int, Any] | None:
    """``(bytes, future)`` for a CPU all-gather's staging copy (``out``: the operator's result, its
    outputs then a ``Work``; the future of that work completes after gloo freed the copy), else None."""
    if func.name().split(".", 1)[0] not in GATHERS or not isinstance(out, tuple) or len(out) < 2:
        return None
    nbytes = _cpu_bytes(out[0])
    if not nbytes:
        return None
    try:
        future = torch.distributed.Work.unbox(out[-1]).get_future()
    except (AttributeError, RuntimeError, TypeError):
        return None
    return nbytes, future
