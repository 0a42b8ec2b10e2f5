"""DDP in the replay: the reducer's gradient buckets a rank holds, for a CUDA target's reserve.

On the CPU the buckets enter the per-rank split as the trainable parameters' bytes
(:func:`~hf_memwatch.engines.ddp.split.ddp_split`, ``none`` over 2+ ranks); for a CUDA target the
caching allocator also sees them as the blocks the Reducer allocates (:func:`ddp_bucket_bytes`), resident
beside the replayed step (:func:`~hf_memwatch.estimation.cuda_device.cuda_step_reserve`'s ``resident``).
"""

from __future__ import annotations

from typing import Any

from ...compat.ddp import bucket_assignment
from ...estimation.cuda_device import MiB


def ddp_bucket_bytes(model: Any, bucket_cap_mb: float | None = None) -> list[int]:
    """DDP's gradient buckets on each rank from the second step on, in the order the Reducer allocates them.

    torch 2.13's ``DistributedDataParallel`` (``_ddp_init_helper``, ``BucketCapacityConfig``) puts every
    parameter in one bucket for the first step when neither ``static_graph`` nor
    ``find_unused_parameters`` is set, then ``Reducer::rebuild_buckets`` (reducer.cpp) regroups them in
    the order their gradients became ready, by ``compute_bucket_assignment_by_size`` with the limits
    ``[first_bucket_bytes_cap, bucket_bytes_cap]`` (1 MiB then 25 MiB by default; ``bucket_cap_mb`` sets
    both), one dtype per bucket, and ``initialize_buckets`` allocates one flat tensor per bucket: the
    sum of its parameters' bytes. The ready order is taken as the reverse of ``_build_params_for_reducer``'s
    (DDP's own approximation for its first buckets: "approximate the order in which their gradients
    are produced"); the grouping is torch's own function, run on the model's parameters.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(3)))  # 4,100 KiB each
        >>> [n >> 10 for n in ddp_bucket_bytes(model)]  # a bucket closes once past its cap: 1 MiB, then 25 MiB
        [4100, 8200]
    """
    import torch.distributed as dist

    if not dist.is_available():
        return []
    seen: set[int] = set()
    params = []
    for _, module in model.named_modules():
        for _, param in module.named_parameters(recurse=False):
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    if not params:
        return []
    cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * MiB)
    ready = params[::-1]
    buckets = bucket_assignment(ready, None if bucket_cap_mb is None else cap, cap)
    if buckets is None:
        return []
    return [sum(ready[i].numel() * ready[i].element_size() for i in bucket) for bucket in buckets]


def ddp_resident(model: Any, world_size: int | None, shard: str | None, trainer: Any = None) -> list[int]:
    """The rank's DDP buckets where the run is DDP (``shard`` none over 2+ ranks), else none; the cap
    from the Trainer's ``ddp_bucket_cap_mb`` when set."""
    if (world_size or 1) < 2 or shard not in (None, "none"):
        return []
    return ddp_bucket_bytes(model, getattr(getattr(trainer, "args", None), "ddp_bucket_cap_mb", None))
