"""What a CUDA training step holds on the card: the allocator's reserve, the context, NCCL's buffers.

``estimate(..., device="cuda")`` predicts allocated bytes by replaying the step on fake tensors; an
out-of-memory error happens at the device's limit, which counts

* the caching allocator's **reserved** bytes: :func:`predict_reserved` replays the rules of
  :mod:`~hf_memwatch.estimation.cuda_allocator` over the allocation sequence the estimator's tracker
  recorded (weights as registered, optimizer states as the priming step creates them, the step),
  with this process's ``PYTORCH_CUDA_ALLOC_CONF``, the cuBLAS workspaces of the target's card among them
  (:mod:`~hf_memwatch.estimation.cuda_libs`: two, held from the first step on). Where the step was simulated at two short depths and extrapolated, the reserve is
  extrapolated on the same line;
* the **CUDA context** and library handles, measured once on this machine's device
  (:func:`~hf_memwatch.measure.cuda_context.cuda_overheads`; ``None`` without CUDA);
* **NCCL buffers** per rank for ``world_size > 1`` (:func:`nccl_buffer_bytes`): a prior from NCCL's
  documented settings, not measured.

``device_bytes`` = reserved + context + NCCL: what ``mem_get_info`` shows this process using at the
step's highest, to compare with the card's memory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from .cuda_allocator import AllocatorConfig, replay

CUBLAS_WORKSPACE_KEY = "cublas_workspace"
# NCCL's documented defaults (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html):
# NCCL_BUFFSIZE, the buffer per peer connection and channel, is 4 MiB; the channels NCCL opens
# depend on the topology (NCCL_MIN/MAX_NCHANNELS): 16 is taken where they are not set.
NCCL_DEFAULT_BUFFSIZE = 4 << 20
NCCL_DEFAULT_CHANNELS = 16


def nccl_buffer_bytes(world_size: int, environ: dict[str, str] | None = None) -> int:
    """NCCL's communication buffers per rank: channels × 2 ring peers (send, receive) × NCCL_BUFFSIZE.

    A prior from the documented settings (``NCCL_BUFFSIZE``, ``NCCL_MAX_NCHANNELS``), not a
    measurement: NCCL also keeps protocol buffers (LL, LL128) and, with NVLink SHARP, more.

    Example:
        >>> nccl_buffer_bytes(1, {}), nccl_buffer_bytes(8, {}) >> 20, nccl_buffer_bytes(2, {"NCCL_BUFFSIZE": "1048576"}) >> 20
        (0, 128, 32)
    """
    if world_size <= 1:
        return 0
    env = os.environ if environ is None else environ
    buffsize = _int(env.get("NCCL_BUFFSIZE"), NCCL_DEFAULT_BUFFSIZE)
    channels = _int(env.get("NCCL_MAX_NCHANNELS"), NCCL_DEFAULT_CHANNELS)
    return channels * 2 * buffsize


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text else default
    except ValueError:
        return default


def predict_reserved(traces: Sequence[Sequence[tuple[object, int]]], *, extrapolated_peak: int | None = None,
                     workspace: int = 0, config: AllocatorConfig | None = None) -> int | None:
    """The caching allocator's peak reserved bytes over the recorded step.

    ``traces``: the allocation sequences of the step's simulations, in order; the last is the step.
    ``extrapolated_peak``: the step was simulated at two short depths and its allocated peak
    extrapolated to the full depth. The reserve is not linear in depth — a deeper step reuses
    blocks the shallower one left cached (measured on a Llama-3.2-1B shape, 1 x 2048, bf16: from 2
    to 3 layers reserved grows 936 MiB where allocated grows 1,065 MiB) — so the gap between
    reserved and allocated at the deeper short depth is carried to the full depth (the same shape
    replayed at all 16 layers: gap 562 MiB; carried from 3 layers: 569 MiB).
    ``workspace``: a block held from the first matmul (cuBLAS), placed first.

    Example:
        >>> MiB = 1 << 20
        >>> step = [("w", 12 * MiB), ("a", 3 * MiB), ("a", 0)]   # 12 MiB segment, then a 20 MiB one for 3 MiB
        >>> predict_reserved([step]) // MiB
        32
        >>> predict_reserved([step, step], extrapolated_peak=100 * MiB) // MiB   # the 17 MiB gap carried
        117
    """
    if not traces:
        return None
    config = config or AllocatorConfig.from_env()
    head = [(CUBLAS_WORKSPACE_KEY, workspace)] if workspace > 0 else []
    result = replay([*head, *traces[-1]], config)
    if extrapolated_peak is None:
        return result.peak_reserved
    gap = result.peak_reserved - (result.peak_allocated - max(0, workspace))
    return extrapolated_peak + max(0, gap)


@dataclass(frozen=True)
class DeviceTotal:
    """The step's highest on the card: reserved + context + NCCL (``device`` None when the context is unknown)."""

    reserved: int
    context: int | None
    nccl: int
    device: int | None
    total_memory: int | None

    def overheads(self) -> dict[str, int | None]:
        return {"cuda_context": self.context, "nccl_buffers": self.nccl, "device_total_memory": self.total_memory}


def device_total(reserved: int, world_size: int, overheads: object | None) -> DeviceTotal:
    """Add the measured context (``overheads``: a :class:`~hf_memwatch.measure.cuda_context.CudaOverheads`
    or None) and NCCL's buffers to the predicted reserve.

    Example:
        >>> device_total(1000, 1, None)
        DeviceTotal(reserved=1000, context=None, nccl=0, device=None, total_memory=None)
    """
    nccl = nccl_buffer_bytes(world_size)
    context = getattr(overheads, "context", None)
    total = getattr(overheads, "total_memory", None)
    return DeviceTotal(reserved, context, nccl, None if context is None else reserved + context + nccl, total)


def cuda_step_reserve(traces: Sequence[Sequence[tuple[object, int]]], *, peak: int, extrapolated: bool,
                      world_size: int | None, shard: str | None, held_bytes: int,
                      notes: list[str]) -> tuple[int | None, int | None, dict[str, int | None]]:
    """``(reserved_bytes, device_bytes, device_overheads)`` of a CUDA estimate; notes say what is not in them.

    ``traces`` as recorded around the step's simulations (the step's is the last); ``extrapolated``:
    the estimate's ``peak`` was extrapolated from two short depths. ``held_bytes``: weights of models
    the Trainer holds besides (resident: added as they are).
    """
    from ..measure.cuda_context import cuda_overheads

    world = world_size or 1
    if world > 1 and shard not in (None, "none"):
        notes.append("CUDA reserve: not predicted for sharded states (the replay is of one unsharded rank)")
        return None, None, {}
    overheads = cuda_overheads("cuda")
    # the cuBLAS workspaces are in the step's trace (estimation/cuda_libs.py, by the target's card)
    reserved = predict_reserved(traces, extrapolated_peak=peak - held_bytes if extrapolated else None)
    if reserved is None:
        return None, None, {}
    total = device_total(reserved + held_bytes, world, overheads)
    if total.context is None:
        notes.append("CUDA: reserved bytes predicted by replaying the caching allocator; the CUDA context "
                     "(~0.3-1 GiB per process) is measured only where a CUDA device is at hand, so device_bytes is unknown")
    return total.reserved, total.device, total.overheads()
