"""DDP's rules: the registry's entry for ``shard`` ``none`` over 2+ ranks.

A rank holds the reducer's flat gradient buckets beside the model: counted live by :mod:`.live`,
divided in by :mod:`.split`, placed by the CUDA
allocator's replay through :mod:`.replay`. Its advice is the engine that partitions the states: ZeRO-1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...core.advice import Advice
from ..rules import EngineRules
from ..zero.advice import ddp_to_zero1
from .live import DdpBuckets, find_ddp
from .replay import ddp_resident
from .split import ddp_split


class DdpRules(EngineRules):
    """``DistributedDataParallel`` as the Trainer wraps the model on 2+ ranks without FSDP or DeepSpeed."""

    name = "ddp"
    label = "DDP"

    def answers(self, shard: str, world_size: int, engine: Any = None) -> bool:
        return shard == "none" and world_size > 1

    def split(self, classes: dict[str, int], model: torch.nn.Module, world_size: int, shard: str, notes: list[str],
              precision: str = "fp32") -> dict[str, int]:
        return ddp_split(classes, model, world_size, notes)

    def contributor(self, trainer: Any, wrapped: Any) -> Any:
        return DdpBuckets(wrapped) if find_ddp(wrapped) is not None else None

    def resident(self, model: torch.nn.Module, request: Any, trainer: Any) -> list[int]:
        return ddp_resident(model, request.world_size, request.shard, trainer)

    def advice(self, run: Any, classes: Mapping[str, int], peak: int, peak_phase: str | None) -> list[Advice]:
        return ddp_to_zero1(run, classes)
