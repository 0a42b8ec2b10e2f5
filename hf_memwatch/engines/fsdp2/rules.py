"""FSDP2's rules (accelerate's ``fsdp_version: 2``): the registry's entry for ``shard`` ``fsdp``.

The replay runs the rank's own step on its shards (:mod:`.replay` over :mod:`.units`) where it applies
(:func:`~.replay.fsdp_applies`: fp32 or bf16, no offload); elsewhere ``fsdp`` is the full-shard division of
:func:`~hf_memwatch.engines.shard.shard_classes`. On a live rank :mod:`.live` counts its shards,
gathered units and communication buffers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..engine import Engine
from ..rules import EngineRules
from .live import Fsdp2Storages, fsdp2_param_groups
from .replay import fsdp_applies, fsdp_flow


class Fsdp2Rules(EngineRules):
    """FSDP2 as accelerate builds it (full shard by default, the model's ``_no_split_modules`` wrapped)."""

    name = "fsdp2"
    label = "FSDP2"
    shards = ("fsdp",)

    def engine_of_options(self, args: Any) -> Any:
        """``--shard fsdp``: FSDP2 as accelerate builds it by default (full shard, the model's
        ``_no_split_modules`` wrapped), replayed by the estimator as the auto mode's prediction is
        (``engines/fsdp2/replay.py``); None for other shards."""
        if args.shard != "fsdp" or int(args.world_size) < 2:
            return None
        return Engine(kind="fsdp", world_size=int(args.world_size), fsdp_version=2, fsdp_strategy="FULL_SHARD")

    def contributor(self, trainer: Any, wrapped: Any) -> Any:
        groups = fsdp2_param_groups(wrapped)  # shards and all-gathers outside model.parameters()
        return Fsdp2Storages(groups) if groups else None

    def flow(self, model: torch.nn.Module, engine: Any, trainer: Any, request: Any) -> Any:
        flow = fsdp_flow(model, engine, trainer, request.precision, request.device)
        return super().flow(model, engine, trainer, request) if flow is None else flow

    def per_rank(self, model: torch.nn.Module, engine: Any, request: Any) -> bool:
        return fsdp_applies(engine, model, request.precision)

    def rank_classes(self, phase_classes: Mapping[str, dict[str, int]], model: torch.nn.Module, engine: Any,
                     request: Any, notes: list[str], windows: Mapping[str, list] | None = None
                     ) -> dict[str, dict[str, int]]:
        if not fsdp_applies(engine, model, request.precision):
            return super().rank_classes(phase_classes, model, engine, request, notes)
        # the replay held the rank's shards and gathers (replay.py)
        notes.append(f"FSDP2 x {request.world_size}: the rank's shards, all-gathers, prefetch and reduce-scatters "
                     "replayed")
        return {phase: dict(classes) for phase, classes in phase_classes.items()}

    def eight_bit_unavailable(self, run: Any) -> str | None:
        if run.engine is not None and run.engine.kind == "fsdp" and run.engine.fsdp_version == 2:
            # Run on 2 gloo ranks through the Trainer (bitsandbytes 0.50.2, torch 2.13), without hf-memwatch:
            # the first step fails, "Operator bitsandbytes.optimizer_update_32bit.default does not have a
            # sharding strategy registered" (and dequantize_blockwise: "got mixed torch.Tensor and DTensor").
            return "bitsandbytes' 8-bit AdamW cannot step FSDP2's DTensor parameters (no DTensor sharding rule)"
        return None
