"""torch.distributed's DDP bucket rule the CUDA replay reads, with its probe. Verified on torch 2.13.0.

``estimation/cuda_device.ddp_bucket_bytes`` sizes DDP's gradient buckets as the reducer forms them:
``torch.distributed._compute_bucket_assignment_by_size`` over the parameters in reverse order, the first
bucket capped at ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) and the others at
``bucket_cap_mb``. Without them (:data:`BUCKETS` failed) the buckets are sized by the documented rule
in Python (the same caps, parameters taken whole in reverse order; no split by dtype or device).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .probes import Probe, holds

DOCUMENTED_FIRST_BUCKET_BYTES = 1024 * 1024

BUCKETS = Probe("torch", "torch.distributed._compute_bucket_assignment_by_size, _DEFAULT_FIRST_BUCKET_BYTES",
                "DDP's bucket assignment as the reducer computes it (sized by the documented rule instead)",
                lambda: callable(getattr(dist, "_compute_bucket_assignment_by_size", None))
                and isinstance(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", None), int))


def default_first_bucket_bytes() -> int:
    return dist._DEFAULT_FIRST_BUCKET_BYTES if holds(BUCKETS) else DOCUMENTED_FIRST_BUCKET_BYTES


def bucket_assignment(params: list[Any], limits: list[int]) -> list[list[int]]:
    """Indices of ``params`` in each bucket (``limits``: the first bucket's cap, then the others')."""
    if holds(BUCKETS):
        buckets, _ = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
        return [list(bucket) for bucket in buckets]
    buckets: list[list[int]] = [[]]
    size = 0
    for index, param in enumerate(params):
        cap = limits[min(len(buckets) - 1, len(limits) - 1)]
        buckets[-1].append(index)
        size += param.numel() * param.element_size()
        if size >= cap:
            buckets.append([])
            size = 0
    return [bucket for bucket in buckets if bucket]
