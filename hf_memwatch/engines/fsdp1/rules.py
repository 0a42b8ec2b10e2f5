"""FSDP1's rules (accelerate's ``fsdp_version: 1``, ``FullyShardedDataParallel``): the registry's entry for
``shard`` ``fsdp`` under an FSDP1 engine.

A rank holds its flat shard of the parameters, gradients and optimizer states and, while a wrapped
block computes, that block's parameters all-gathered, with the next one prefetched: the full-shard
division of :func:`~hf_memwatch.engines.shard.shard_classes` (states / N, gradients / N, weights / N + 2 x
the largest layer), applied to the replayed single-process step. Not replayed unit by unit as FSDP2 is.

Measured (``tests/engines/test_fsdp1.py``; torch 2.13, accelerate 1.15, 2 gloo ranks through the Trainer,
test GPT-2 of 590,336 fp32 parameters, ``full_shard auto_wrap`` on ``GPT2Block``, AdamW, 4 x 64 tokens, the
profiler's reconciled step peaks): the step with the optimizer states peaks at 17,273,508 / 17,273,472 B on
ranks 0 / 1; the estimate made on the Trainer before ``train()`` is 18,049,612 B (+4.5%).

On a live rank FSDP1's parameters are views of its ``FlatParameter`` (``use_orig_params``, accelerate's
default): the monitor counts them through ``model.parameters()``, without a contributor (not measured).
The CLI has no FSDP1 flag (``--shard fsdp`` is FSDP2, accelerate's default): FSDP1 is read from the
Trainer's accelerator, its arguments or the launcher's environment (:mod:`hf_memwatch.engines.engine`).
"""

from __future__ import annotations

from typing import Any

from ..rules import EngineRules


class Fsdp1Rules(EngineRules):
    """``FullyShardedDataParallel`` as accelerate builds it with ``fsdp_version: 1``."""

    name = "fsdp1"
    label = "FSDP1"
    shards = ("fsdp",)

    def answers(self, shard: str, world_size: int, engine: Any = None) -> bool:
        return shard in self.shards and engine is not None and engine.kind == "fsdp" and (engine.fsdp_version or 1) == 1
