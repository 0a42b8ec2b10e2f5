"""ZeRO-3's all-gathers on CPU ranks: the flat copy gloo stages for each one in flight, in the forward.

``ProcessGroupGloo`` gathers into a flat tensor of the whole output on its worker thread and copies
it into DeepSpeed's buffer (:mod:`hf_memwatch.engines.gloo_staging`), so while an all-gather runs the
rank holds its output twice. DeepSpeed fetches a module's parameters coalesced with the prefetch of
the next ones (up to ``stage3_prefetch_bucket_size`` elements) and issues the prefetch while the
current gather runs, and gloo runs two collectives at once (its default two worker threads), so two
staging copies are alive at the forward's high. Measured on 2 gloo ranks (DeepSpeed 0.19.8, test
GPT-2, prefetch bucket 100,000 elements, 1 x 8 + checkpointing, step 2, rank 0): gathers of 1,024 to
594,944 B; at the profiler's peak (10,568,605 B, reconciled; in the forward) copies of 594,944 and
528,896 B were alive; without them the step's high was the backward's (10,131,624 B). Each gather is bounded here
by the largest leaf module plus the prefetch bucket (the embedding, 512,000 B, + 400,000 B); the
backward (its recomputed forward included) kept its gathered parameters and measured no copy.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.categories import AFTER_FORWARD, STEP_END
from .split import zero3_gathered_bytes

GLOO_THREADS = 2  # ProcessGroupGloo's default worker threads: collectives running at once


def gather_bound(model: torch.nn.Module, engine: Any) -> int:
    """Bytes of one coalesced ZeRO-3 all-gather at most: the largest leaf module's parameters plus
    the prefetch bucket, never above the model.

    Example:
        >>> from hf_memwatch.engines.engine import Engine
        >>> zero3 = Engine(kind="deepspeed", world_size=2, zero_stage=3, prefetch_bucket_size=10)
        >>> gather_bound(torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2)), zero3)
        480
    """
    params = list(model.parameters())
    full = sum(p.numel() * p.element_size() for p in params)
    size = params[0].element_size() if params else 4
    leaf = max((sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                for m in model.modules() if not list(m.children())), default=0)
    prefetch = int(engine.prefetch_bucket_size or 0) * size
    return min(full, leaf + prefetch)


def gloo_gather_staging(per_phase: dict[str, dict[str, int]], model: torch.nn.Module, engine: Any, device: str,
                        notes: list[str]) -> dict[str, dict[str, int]]:
    """``per_phase`` with, on ZeRO-3 CPU ranks (gloo), the forward's gathering moment: the resident set
    of the step's end, the parameters gathered and the staging copies of the all-gathers in flight
    (temporaries), where that is above the forward's high. Other engines and devices: unchanged.

    The gathers run before the forward's activations accumulate: the configured run of the module doc
    (4 x 2, no checkpointing) peaked in its backward (14,735,272 B) with the copies counted, where adding
    them to the forward's high predicted 16,048,316 B (+8.9%).
    """
    if engine is None or engine.kind != "deepspeed" or engine.zero_stage != 3 or engine.world_size < 2 \
            or device != "cpu" or AFTER_FORWARD not in per_phase or STEP_END not in per_phase:
        return per_phase
    staging = GLOO_THREADS * gather_bound(model, engine)
    gathering = {**per_phase[STEP_END]}
    gathering["weights"] += zero3_gathered_bytes(model, engine)
    gathering["temporaries"] = gathering.get("temporaries", 0) + staging
    notes.append(f"zero3 on gloo: the forward's gathering holds {staging} bytes of flat copies gloo stages for "
                 f"{GLOO_THREADS} all-gathers in flight")
    if sum(gathering.values()) <= sum(per_phase[AFTER_FORWARD].values()):
        return per_phase
    return {**per_phase, AFTER_FORWARD: gathering}
