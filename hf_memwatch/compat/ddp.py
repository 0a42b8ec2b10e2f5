"""DDP's private names the DDP engine (:mod:`hf_memwatch.engines.ddp`) relies on, each with its probe.
Verified on torch 2.13 (``torch/nn/parallel/distributed.py``, ``torch/distributed/distributed_c10d.py``).

=======================================  ================================  ==================================
private thing (``guards``)                what relies on it                 without it (``off``)
=======================================  ================================  ==================================
``DistributedDataParallel.               the reducer's bucket sizes on a   no bucket is counted beside the
_get_ddp_logging_data``,                  live rank (``engines/ddp/live``)  gradients (an under-count of DDP's
``_has_rebuilt_buckets``                                                    buckets, said once)
``torch.distributed.                      a CUDA target's DDP buckets as    no DDP bucket beside the replayed
_compute_bucket_assignment_by_size``,     torch groups them                 step in the CUDA reserve
``_DEFAULT_FIRST_BUCKET_BYTES``           (``engines/ddp/replay``)
=======================================  ================================  ==================================
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .probes import Probe, holds

_LOGGING = Probe("torch", "DistributedDataParallel._get_ddp_logging_data",
                 "DDP's gradient buckets on a live rank (not counted)",
                 lambda: hasattr(torch.nn.parallel.DistributedDataParallel, "_get_ddp_logging_data"))
_ASSIGNMENT = Probe("torch", "torch.distributed._compute_bucket_assignment_by_size",
                    "DDP's buckets in a CUDA target's reserve",
                    lambda: all(hasattr(dist, name) for name in (
                        "_compute_bucket_assignment_by_size", "_DEFAULT_FIRST_BUCKET_BYTES")))


def ddp_logging_data(ddp: Any) -> dict[str, Any]:
    """DDP's own logging data (``bucket_sizes``, ``rebuilt_bucket_sizes``); empty where the probe fails."""
    return dict(ddp._get_ddp_logging_data()) if holds(_LOGGING) else {}


def has_rebuilt_buckets(ddp: Any) -> bool:
    """Whether DDP's reducer has rebuilt its buckets (in the first forward after a synchronized backward)."""
    return bool(getattr(ddp, "_has_rebuilt_buckets", False))


def bucket_assignment(params: list[Any], first_cap: int | None, cap: int) -> list[list[int]] | None:
    """torch's grouping of ``params`` (in ready order) into DDP buckets of at most ``[first_cap, cap]``
    bytes (``first_cap`` None: DDP's default first bucket); None where the probe fails."""
    if not holds(_ASSIGNMENT):
        return None
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if first_cap is None else first_cap
    buckets, _ = dist._compute_bucket_assignment_by_size(params, [first, cap], [False] * len(params))
    return buckets
