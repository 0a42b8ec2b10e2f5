"""What a CUDA training step holds on the card: the allocator's reserve, the context, NCCL's buffers.

``estimate(..., device="cuda")`` predicts allocated bytes by replaying the step on fake tensors; an
out-of-memory error happens at the device's limit, which counts

* the caching allocator's **reserved** bytes: :func:`replay_reserve` replays the rules of
  :mod:`~hf_memwatch.estimation.cuda_allocator` over the allocation sequence the estimator's tracker
  recorded (weights as registered, optimizer states as the priming step creates them, the step),
  with this process's ``PYTORCH_CUDA_ALLOC_CONF``, the cuBLAS workspaces of the target's card among them
  (:mod:`~hf_memwatch.estimation.cuda_libs`: two, held from the first step on), under the card's **limit** (its memory less the context and NCCL's buffers): near it
  torch frees its cached segments inside the failed ``cudaMalloc`` and carries on
  (``num_alloc_retries``), or raises the OOM the replay then reports. Where the step was simulated at
  two short depths and extrapolated, the reserve is extrapolated on the same line;
* the **CUDA context** and library images: measured once on this machine's device
  (:func:`~hf_memwatch.measure.cuda_context.cuda_overheads`) when it is the target card, else the
  published measurement of :data:`PUBLISHED_CONTEXTS` that matches the target best
  (:func:`published_context`, noted);
* **NCCL buffers** per rank for ``world_size > 1`` (:func:`nccl_buffer_bytes`): a prior from NCCL's
  documented settings, not measured.

``device_bytes`` = reserved + context + NCCL: what ``mem_get_info`` shows this process using at the
step's highest, to compare with the card's memory.

Published contexts (:data:`PUBLISHED_CONTEXTS`), for a target card with no device of it at hand.
Published measurements only, each the used memory after a first tensor on the card less the caching
allocator's segment for that tensor (the context holds the driver's state and the kernels loaded;
with lazy loading only those used so far, so it grows as the step loads more):

============  ====  =====  ==========  ====================================================================
context       card  CUDA   loading     source
============  ====  =====  ==========  ====================================================================
253.75 MiB    —     11.7   lazy        pytorch/pytorch#86509 (torch 1.13, the PR that made torch set
                                       ``CUDA_MODULE_LOADING=LAZY``): ``torch.randn(20, 16, 50, 100).cuda()``
                                       then ``cudaMemGetInfo`` total - free = 287,047,680 B, less its
                                       20 MiB (kLargeBuffer) segment. The card is not named; CUDA 11.7+
                                       (the saving needs lazy loading, first in 11.7; 1.13 shipped cu117).
615.75 MiB    —     11.7   eager       the same PR, ``CUDA_MODULE_LOADING=DEFAULT`` (eager under CUDA
                                       11.7): 666,632,192 B less 20 MiB.
1,685 MiB     sm_86 11.1   eager       pytorch/pytorch#55277 (comment of 2022-04-12): torch 1.8.2+cu111 on
                                       an RTX 3090, nvidia-smi after ``torch.Tensor(1).cuda()``: 1,687 MiB
                                       less the 2 MiB small-pool segment.
719 MiB       sm_61 10.1   eager       the same comment: torch 1.8.2+cu101 on a GTX 1080, 721 MiB less 2.
1,341 MiB     sm_70 11.2   eager       transformers' perf_train_gpu_one guide (v4.18-v4.21): Tesla V100-SXM2
                                       16 GB, driver 460.91.03 (its nvidia-smi's CUDA 11.2; the torch build's
                                       is not stated), pynvml used after ``torch.ones((1, 1)).to("cuda")``:
                                       1,343 MiB less the 2 MiB small-pool segment.
256 MiB       sm_86 12.8   lazy        invoke-ai/InvokeAI#9413: torch 2.7.1+cu128 on an RTX 3090, driver
                                       610.43.03, nvidia-smi's per-process figure of a process that had made
                                       no tensor (its context came from ``torch.cuda.mem_get_info``, PR #9447).
426 MiB       sm_89 13.0   lazy        unslothai/unsloth-zoo#1053: torch 2.10.0+cu130 on an RTX 6000 Ada,
                                       nvidia-smi after ``torch.cuda.mem_get_info(0)``, allocated and
                                       reserved 0.
============  ====  =====  ==========  ====================================================================

The maintainers' statements agree on the order of the lazy figure (pytorch/pytorch#107667: "~300MB"
with CUDA >= 11.7; #109888: "around 400MB") but name no card or exact figure, so they are not
entries. The two lazy figures of CUDA 12.8/13.0 are contexts before a first kernel was loaded: a
step's own kernels come on top. Left out for want of a published measurement: any figure for T4,
A100, A10G, H100 or H200 under CUDA 12, the device memory of cuBLAS/cuDNN handles outside the
allocator (the cuBLAS workspace lives in the caching allocator and is replayed there), and the kernel
images a training step loads after the first tensor under lazy loading: no source sizes them per card
and CUDA (#86509 and the lazy entries measure the context before the step's kernels; NVIDIA's Lazy
Loading guide gives no sizes), so they are not modelled; the eager entry of the same card bounds them
(benchmarks/results/cuda_published.md, "The lazy-loading gap"). A target
without its own entry gets the entry of its loading mode tied to no other card (noted).

Sharded runs: the replayed sequence must be the rank's own. It is for FSDP2 where
:func:`~hf_memwatch.engines.fsdp2.replay.fsdp_applies` (the fake step runs on the rank's shards,
all-gathers, reshards and reduce-scatters, the optimizer on the shards: ``per_rank``). It is not for
ZeRO-1/2/3 or FSDP1: their optimizer states and step (``zero_step.flat_step``), ZeRO-3's gathers
and the division of weights and gradients are applied to the per-phase totals after the replay, so
the recorded sequence holds one unsharded process's tensors and its reserve is not the rank's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .cuda_allocator import AllocatorConfig, AllocatorOOM, ReplayResult, replay
from .cuda_paged import paged_note, split_paged

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


MiB = 1 << 20


@dataclass(frozen=True)
class PublishedContext:
    """One published measurement of what a CUDA process holds outside the caching allocator.

    ``context``: bytes (the source's figure less the caching allocator's segment for the tensor it
    created, by :func:`~hf_memwatch.estimation.cuda_allocator.allocation_size`); ``sm``: the card's
    capability as one number (None: the source names no card); ``cuda``: the CUDA version of the
    torch build; ``lazy``: ``CUDA_MODULE_LOADING=LAZY``.
    """

    context: int
    sm: int | None
    cuda: str
    lazy: bool
    measured: str
    source: str


# The table and its sources: the module docstring's "Published contexts".
PUBLISHED_CONTEXTS: tuple[PublishedContext, ...] = (
    PublishedContext(287_047_680 - 20 * MiB, None, "11.7", True,
                     "torch 1.13, cudaMemGetInfo after a first 6.4 MB tensor, CUDA_MODULE_LOADING=LAZY",
                     "https://github.com/pytorch/pytorch/pull/86509"),
    PublishedContext(666_632_192 - 20 * MiB, None, "11.7", False,
                     "torch 1.13, cudaMemGetInfo after a first 6.4 MB tensor, eager loading",
                     "https://github.com/pytorch/pytorch/pull/86509"),
    PublishedContext((1687 - 2) * MiB, 86, "11.1", False,
                     "torch 1.8.2+cu111 on an RTX 3090, nvidia-smi after torch.Tensor(1).cuda()",
                     "https://github.com/pytorch/pytorch/issues/55277"),
    PublishedContext((721 - 2) * MiB, 61, "10.1", False,
                     "torch 1.8.2+cu101 on a GTX 1080, nvidia-smi after torch.Tensor(1).cuda()",
                     "https://github.com/pytorch/pytorch/issues/55277"),
    PublishedContext((1343 - 2) * MiB, 70, "11.2", False,
                     "a Tesla V100-SXM2 16 GB, driver 460.91.03, pynvml used after torch.ones((1, 1)).to('cuda')",
                     "https://huggingface.co/docs/transformers/v4.21.0/perf_train_gpu_one"),
    PublishedContext(256 * MiB, 86, "12.8", True,
                     "torch 2.7.1+cu128 on an RTX 3090, nvidia-smi per process, a context and no tensor",
                     "https://github.com/invoke-ai/InvokeAI/issues/9413"),
    PublishedContext(426 * MiB, 89, "13.0", True,
                     "torch 2.10.0+cu130 on an RTX 6000 Ada, nvidia-smi after torch.cuda.mem_get_info(0)",
                     "https://github.com/unslothai/unsloth-zoo/pull/1053"),
)


def lazy_loading(environ: dict[str, str] | None = None) -> bool:
    """Whether CUDA loads kernels lazily: torch sets ``CUDA_MODULE_LOADING=LAZY`` where it is unset
    (``maybe_set_cuda_module_loading("LAZY")``, aten/src/ATen/cuda/detail/CUDAHooks.cpp); ``EAGER`` turns
    it off (``DEFAULT`` is LAZY from CUDA 12.2 on Linux, NVIDIA's Lazy Loading guide).

    Example:
        >>> lazy_loading({}), lazy_loading({"CUDA_MODULE_LOADING": "EAGER"})
        (True, False)
    """
    env = os.environ if environ is None else environ
    return env.get("CUDA_MODULE_LOADING", "LAZY").strip().upper() != "EAGER"


def published_context(sm: int | None, lazy: bool, cuda: str | None = None) -> PublishedContext:
    """The measurement of :data:`PUBLISHED_CONTEXTS` closest to a target: the same loading mode always
    (eager loads every kernel: 2.4x the lazy figure in #86509), then the same card, the same CUDA, a
    figure tied to no other card, the newest CUDA.

    Example:
        >>> published_context(90, lazy=True).source     # no H100 figure published: the lazy one
        'https://github.com/pytorch/pytorch/pull/86509'
        >>> published_context(86, lazy=False).context >> 20   # the RTX 3090's own
        1685
    """
    candidates = [entry for entry in PUBLISHED_CONTEXTS if entry.lazy == lazy]
    return max(candidates, key=lambda e: (e.sm is not None and e.sm == sm, e.cuda == cuda, e.sm is None,
                                          tuple(int(part) for part in e.cuda.split("."))))


DDP_BUCKET_KEY = "ddp_bucket"  # the key of a resident DDP bucket in the replayed sequence


@dataclass(frozen=True)
class ReservePrediction:
    """The replayed reserve: its peak, the cache flushes torch does at the limit, and whether it runs out."""

    reserved: int
    retries: int  # num_alloc_retries: failed cudaMallocs after which the whole cache was freed
    oom: bool  # past the limit even then: ``reserved`` is what the step asks for


def replay_reserve(traces: Sequence[Sequence[tuple[object, int]]], *, extrapolated_peak: int | None = None,
                   workspace: int = 0, config: AllocatorConfig | None = None, limit: int | None = None,
                   total_memory: int | None = None, resident: Sequence[int] = ()) -> ReservePrediction | None:
    """The caching allocator's peak reserved bytes over the recorded step, under the device ``limit``.

    ``traces``: the allocation sequences of the step's simulations, in order; the last is the step.
    ``extrapolated_peak``: the step was simulated at two short depths and its allocated peak
    extrapolated to the full depth. The reserve is not linear in depth — a deeper step reuses
    blocks the shallower one left cached (measured on a Llama-3.2-1B shape, 1 x 2048, bf16: from 2
    to 3 layers reserved grows 936 MiB where allocated grows 1,065 MiB) — so the gap between
    reserved and allocated at the deeper short depth is carried to the full depth (the same shape
    replayed at all 16 layers: gap 562 MiB; carried from 3 layers: 569 MiB).
    ``workspace``: a block held from the first matmul (cuBLAS), placed first. ``limit``: the bytes the
    allocator may reserve on the card (None: no limit); ``total_memory``: the card's memory.
    ``resident``: blocks held through the step that the recorded sequence lacks (DDP's buckets), placed
    after the workspace.

    Example:
        >>> MiB = 1 << 20
        >>> step = [("x", 30 * MiB), ("x", 0), ("y", 35 * MiB)]   # x's 30 MiB segment cached, then 36 for y
        >>> replay_reserve([step])
        ReservePrediction(reserved=69206016, retries=0, oom=False)
        >>> replay_reserve([step], limit=40 * MiB)                  # the cache freed inside the failed cudaMalloc
        ReservePrediction(reserved=37748736, retries=1, oom=False)
    """
    if not traces:
        return None
    config = config or AllocatorConfig.from_env()
    head = [(CUBLAS_WORKSPACE_KEY, workspace)] if workspace > 0 else []
    head += [((DDP_BUCKET_KEY, i), nbytes) for i, nbytes in enumerate(resident) if nbytes > 0]
    events = [*head, *traces[-1]]
    oom = False
    try:
        result: ReplayResult = replay(events, config, limit, total_memory=total_memory)
    except AllocatorOOM:
        oom, result = True, replay(events, config, total_memory=total_memory)  # what the step asks for
    reserved = result.peak_reserved
    if extrapolated_peak is not None:
        held = max(0, workspace) + sum(resident)  # not in the extrapolated (recorded) peak
        reserved = extrapolated_peak + max(0, result.peak_reserved - (result.peak_allocated - held))
    return ReservePrediction(reserved, result.num_alloc_retries, oom)


def predict_reserved(traces: Sequence[Sequence[tuple[object, int]]], *, extrapolated_peak: int | None = None,
                     workspace: int = 0, config: AllocatorConfig | None = None, limit: int | None = None,
                     total_memory: int | None = None) -> int | None:
    """:func:`replay_reserve`'s peak reserved bytes.

    Example:
        >>> MiB = 1 << 20
        >>> step = [("w", 12 * MiB), ("a", 3 * MiB), ("a", 0)]   # 12 MiB segment, then a 20 MiB one for 3 MiB
        >>> predict_reserved([step]) // MiB
        32
        >>> predict_reserved([step, step], extrapolated_peak=100 * MiB) // MiB   # the 17 MiB gap carried
        117
    """
    prediction = replay_reserve(traces, extrapolated_peak=extrapolated_peak, workspace=workspace, config=config,
                                limit=limit, total_memory=total_memory)
    return None if prediction is None else prediction.reserved


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


def target_context(gpu: Any, overheads: Any, notes: list[str]) -> tuple[int | None, int | None]:
    """``(context, total_memory)`` of the target card: measured where this machine's device is the target
    (``overheads``: a :class:`~hf_memwatch.measure.cuda_context.CudaOverheads`, its memory within 1 % of
    ``gpu``'s), else the published measurement closest to ``gpu`` (a GpuSpec; noted), else unknown."""
    if overheads is not None and (gpu is None or abs(overheads.total_memory - gpu.memory) <= gpu.memory // 100):
        return overheads.context, overheads.total_memory
    if gpu is None:
        return None, None
    entry = published_context(gpu.sm, lazy_loading(), torch.version.cuda)
    notes.append(f"CUDA context: {entry.context / MiB:,.0f} MiB from the published measurements "
                 f"(cuda_device.PUBLISHED_CONTEXTS: {entry.measured}; {entry.source}), none measured on "
                 f"{gpu.name} (sm_{gpu.sm}) here; it grows as the step loads more kernels")
    return entry.context, gpu.memory


# The reserve of a depth-extrapolated step: the short depth's cache gap carried (replay_reserve). Measured on
# the 38 published configurations (benchmarks/results/cuda_published.md, its depth-extrapolation section):
# peak allocated equal to the full-depth replay on all 38, peak reserved -7.80% (Mistral-7B full fine-tune,
# checkpointed, at the A100's limit: the full depth's fragmentation grows with depth) to +5.99% of it.
EXTRAPOLATED_RESERVE_NOTE = (
    "CUDA reserve: the caching allocator replayed at the short depth, its gap to the allocated bytes carried to "
    "the full depth (-7.8%..+6.0% of the full-depth replay's reserve on published configurations; "
    "extrapolate_layers=False replays every layer)")


def cuda_step_reserve(traces: Sequence[Sequence[tuple[object, int]]], *, peak: int, extrapolated: bool,
                      world_size: int | None, shard: str | None, held_bytes: int, notes: list[str],
                      gpu: Any = None, per_rank: bool = False, resident: Sequence[int] = (),
                      carried: Callable[..., Any] | None = None) -> tuple[int | None, int | None, dict[str, int | None]]:
    """``(reserved_bytes, device_bytes, device_overheads)`` of a CUDA estimate; notes say what is not in them.

    ``traces`` as recorded around the step's simulations (the step's is the last); ``extrapolated``:
    the estimate's ``peak`` was extrapolated from two short depths. ``held_bytes``: weights of models
    the Trainer holds besides (resident: added as they are). ``gpu``: the target card (a GpuSpec);
    ``per_rank``: the recorded step is the rank's own under its sharding (FSDP2's replay);
    ``resident``: blocks the rank holds through the step besides the recorded ones (DDP's buckets,
    :func:`~hf_memwatch.engines.ddp.replay.ddp_bucket_bytes`), counted in ``peak`` already.
    ``carried``: for a sharded run whose recorded step is one unsharded process's (ZeRO's shares and the
    full-shard division are taken after the replay), the engine's ``EngineRules.carried_reserve(replay, rank_peak, notes)``: it carries
    that sequence's cache gap onto the rank's peak through ``replay`` (None from it: not predicted).
    bitsandbytes' paged optimizer states (:mod:`.cuda_paged`) leave the replayed sequence and the
    reserve (``cudaMallocManaged``) and count in ``device_bytes``.
    """
    from ..measure.cuda_context import cuda_overheads

    world = world_size or 1
    traces, paged = split_paged(traces)
    sharded = world > 1 and shard not in (None, "none") and not per_rank
    overheads = cuda_overheads("cuda")
    context, total_memory = target_context(gpu, overheads, notes)
    nccl = nccl_buffer_bytes(world)
    limit = None if context is None or total_memory is None else total_memory - context - nccl - held_bytes
    rank_peak = peak - held_bytes - sum(resident) - paged
    if sharded:  # the unsharded process's sequence, replayed without the card's limit, its gap carried
        prediction = None if carried is None else carried(
            lambda carried_peak: replay_reserve(traces, extrapolated_peak=carried_peak, total_memory=total_memory,
                                                resident=resident), rank_peak, notes)
        if prediction is None:
            notes.append("CUDA reserve: not predicted for sharded states (the shares are taken after the "
                         "replay: the recorded sequence is one unsharded process's, not the rank's)")
            return None, None, {}
    else:
        prediction = replay_reserve(traces, extrapolated_peak=rank_peak if extrapolated else None, limit=limit,
                                    total_memory=total_memory, resident=resident)
    if prediction is None:
        return None, None, {}
    card = getattr(gpu, "name", "the card")
    if prediction.oom:
        notes.append(f"CUDA: out of memory on {card}: past the {limit / MiB:,.0f} MiB the allocator may reserve "
                     "(the card less the context and NCCL), freeing the cache inside the failed cudaMalloc does "
                     "not make room; reserved_bytes is what the step asks for")
    elif prediction.retries:
        notes.append(f"CUDA: near {card}'s capacity torch frees its cached segments inside a failed cudaMalloc "
                     f"{prediction.retries} time(s) and carries on (num_alloc_retries): slower steps, replayed")
    elif limit is not None and prediction.reserved > limit:
        notes.append(f"CUDA: the extrapolated reserve passes the {limit / MiB:,.0f} MiB the allocator may reserve "
                     f"on {card}: torch would free its cache and retry, which the short-depth replay does not reach")
    if extrapolated and not sharded:
        notes.append(EXTRAPOLATED_RESERVE_NOTE)
    if context is None:
        notes.append("CUDA: reserved bytes predicted by replaying the caching allocator; the CUDA context "
                     "(~0.3-1 GiB per process) is measured only where a CUDA device is at hand, so device_bytes is unknown")
    reserved = prediction.reserved + held_bytes
    if paged:
        notes.append(paged_note(paged, total_memory))
    total = DeviceTotal(reserved, context, nccl, None if context is None else reserved + context + nccl + paged,
                        total_memory)
    overheads = {**total.overheads(), "paged_optimizer_states": paged} if paged else total.overheads()
    return total.reserved, total.device, overheads
