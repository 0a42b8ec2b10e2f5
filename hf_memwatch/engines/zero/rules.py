"""DeepSpeed ZeRO-1/2/3 (± offload)'s rules: the registry's entry for ``shard`` ``zero1``/``zero2``/``zero3``.

Each method hands over to the module that holds the rule: the live partitions (:mod:`.live`), the
replayed backward (:mod:`.backward`), the per-rank split (:mod:`.split`), the flat
optimizer step (:mod:`.step`), ZeRO-3's gathering moment on gloo (:mod:`.gather`) and the advice
(:mod:`.advice`); the CLI's ``--shard zero*``/``--offload``/bucket flags become the JSON DeepSpeed reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from ...core.advice import Advice
from ...core.categories import AFTER_FORWARD
from ...core.errors import MemWatchConfigError
from ...estimation.classify import forward_windows_wanted
from ..engine import engine_from_deepspeed_config
from ..rules import EngineRules
from .advice import no_fit_reasons, zero_advice
from .backward import (
    MAX_RANKS_REPLAYED,
    flow_applies,
    live_rank,
    replayed_ranks,
    replaying_rank,
    zero_gradient_flow,
)
from .gather import gathering_replayed, gloo_gather_staging, zero3_forward_gathering
from .half import deepspeed_half, half_module, replay_request
from .live import ZeroPartitions
from .split import engine_classes, zero_split
from .step import zero_optimizer_step

# The CLI's bucket flags and the DeepSpeed JSON keys they set (elements).
BUCKET_FLAGS = (("reduce_bucket_size", "reduce_bucket_size"), ("prefetch_bucket_size", "stage3_prefetch_bucket_size"),
                ("max_live_parameters", "stage3_max_live_parameters"),
                ("max_reuse_distance", "stage3_max_reuse_distance"))


class ZeroRules(EngineRules):
    """DeepSpeed ZeRO as accelerate builds it from the Trainer's ``deepspeed=`` JSON."""

    name = "zero"
    label = "ZeRO"
    shards = ("zero1", "zero2", "zero3")

    def engine_of_options(self, args: Any) -> Any:
        """The DeepSpeed engine ``--shard zero1/2/3`` with ``--offload`` and the bucket flags describe
        (the JSON the auto mode reads, built from the flags; None for other shards)."""
        if not str(args.shard).startswith("zero") or int(args.world_size) < 2:
            if getattr(args, "offload", "none") != "none":
                raise MemWatchConfigError("--offload needs --shard zero1/zero2/zero3 and --world-size >= 2")
            return None
        zero: dict[str, Any] = {"stage": int(args.shard[-1])}
        for flag, key in BUCKET_FLAGS:
            value = getattr(args, flag, None)
            if value is not None:
                if value < 0:
                    raise MemWatchConfigError(f"--{flag.replace('_', '-')} must be >= 0; got {value}")
                zero[key] = int(value)
        if args.offload == "params" and zero["stage"] != 3:
            raise MemWatchConfigError("--offload params needs --shard zero3 (DeepSpeed offloads parameters in ZeRO-3 only)")
        if args.offload in ("optimizer", "params"):
            zero["offload_optimizer"] = {"device": "cpu"}
        if args.offload == "params":
            zero["offload_param"] = {"device": "cpu"}
        return engine_from_deepspeed_config({"zero_optimization": zero}, int(args.world_size))

    def split(self, classes: dict[str, int], model: torch.nn.Module, world_size: int, shard: str, notes: list[str],
              precision: str = "fp32") -> dict[str, int]:
        return zero_split(classes, model, world_size, shard, notes, precision)

    def contributor(self, trainer: Any, wrapped: Any) -> Any:
        return ZeroPartitions() if getattr(trainer, "is_deepspeed_enabled", False) else None

    def flow(self, model: torch.nn.Module, engine: Any, trainer: Any, request: Any) -> Any:
        stack = contextlib.ExitStack()
        if gathering_replayed(engine, request.device):
            stack.enter_context(forward_windows_wanted())  # ZeRO-3's gathering per module call (.gather)
        if deepspeed_half(engine, request.precision):  # DeepSpeed's bf16: the fp32 flow on the module cast
            stack.enter_context(half_module(model))
            stack.enter_context(zero_gradient_flow(model, engine, device=request.device))  # none under ZeRO-3
            return stack
        stack.enter_context(zero_gradient_flow(model, engine, request.precision, request.device))  # ZeRO-1/2's buckets
        return stack

    def ranks(self, model: torch.nn.Module, engine: Any, request: Any) -> list[int | None]:
        precision = "fp32" if deepspeed_half(engine, request.precision) else request.precision  # .half: the cast module
        return replayed_ranks(engine, model, precision)

    def for_rank(self, rank: int | None) -> Any:
        return replaying_rank(rank)

    def replay_request(self, request: Any, engine: Any) -> Any:
        if gathering_replayed(engine, request.device):
            # the forward's windows at the model's depth: every layer replayed unless asked otherwise (a line
            # through two short depths keeps no window); a peak census takes the windows away
            # (estimation.classify.forward_windows): the figure kept, the tensors' listing given up (a note says so)
            request = request.replace(top_tensors=0, extrapolate_layers=request.extrapolate_layers or False)
        return replay_request(request) if deepspeed_half(engine, request.precision) else request

    def rank_classes(self, phase_classes: Mapping[str, dict[str, int]], model: torch.nn.Module, engine: Any,
                     request: Any, notes: list[str], windows: Mapping[str, list] | None = None
                     ) -> dict[str, dict[str, int]]:
        """The ZeRO split, what the engine holds beyond it, its flat optimizer step and ZeRO-3's gathering
        (replayed over the forward's ``windows`` where they are at hand, :mod:`.gather`); DeepSpeed's bf16:
        the same on the module cast to bf16 (:mod:`.half`)."""
        if not deepspeed_half(engine, request.precision):
            return self._rank_classes(phase_classes, model, engine, request, notes, windows)
        notes.append("DeepSpeed bf16: the module cast to bf16 and replayed without autocast; fp32 master partitions")
        with half_module(model):
            return self._rank_classes(phase_classes, model, engine, replay_request(request), notes, windows)

    def _rank_classes(self, phase_classes: Mapping[str, dict[str, int]], model: torch.nn.Module, engine: Any,
                      request: Any, notes: list[str], windows: Mapping[str, list] | None
                      ) -> dict[str, dict[str, int]]:
        world_size, precision, device = request.world_size, request.precision, request.device
        flowed = flow_applies(engine, model, precision)  # the replay held ZeRO-1/2's gradients as the rank does
        if flowed and replayed_ranks(engine, model, precision) == [None] and live_rank(world_size) is None:
            notes.append(f"zero{engine.zero_stage} without live ranks on {world_size} ranks (more than "
                         f"{MAX_RANKS_REPLAYED} replayed): the partition that keeps the most elements replayed "
                         f"alone; another rank may peak higher")
        divided = "zero1" if flowed else request.shard

        def held(classes: dict[str, int], said: list[str]) -> dict[str, int]:
            return engine_classes(self.split(classes, model, world_size, divided, said, precision),
                                  model, engine, said, precision, device, flowed)[0]

        per_phase = {phase: held(classes, notes) for phase, classes in phase_classes.items()}
        forward = (windows or {}).get(AFTER_FORWARD) or []
        # each window of the forward as the rank holds it: the same split, states and step as the phases'
        keyed = {(AFTER_FORWARD, i, j): held(classes, []) for i, interval in enumerate(forward)
                 for j, (_, classes) in enumerate(interval)}
        stepped = zero_optimizer_step({**per_phase, **keyed}, model, engine, request.optim, device, notes)
        per_phase = {phase: stepped[phase] for phase in per_phase}
        intervals = [[(label, stepped[(AFTER_FORWARD, i, j)]) for j, (label, _) in enumerate(interval)]
                     for i, interval in enumerate(forward)]
        replayed = zero3_forward_gathering(per_phase, intervals, model, engine, device, notes)
        if gathering_replayed(engine, device) and request.top_tensors:
            notes.append("peak tensors not listed: ZeRO-3 on CPU ranks replays its gathering at each module call, "
                         "which a census of the tensors at the phase's high cannot follow")
        return replayed if replayed is not None else gloo_gather_staging(per_phase, model, engine, device, notes)

    def advice(self, run: Any, classes: Mapping[str, int], peak: int, peak_phase: str | None) -> list[Advice]:
        return zero_advice(run, classes, peak, peak_phase)

    def no_fit_reasons(self, run: Any, peak_phase: str) -> list[str] | None:
        return no_fit_reasons(run, peak_phase)

    def eight_bit_unavailable(self, run: Any) -> str | None:
        engine = run.engine
        if engine is not None and engine.engine_optimizer:
            return "the DeepSpeed config builds its own optimizer (its 'optimizer' section): the Trainer's optim is not used"
        if engine is not None and engine.cpu_optimizer:
            # Run on 2 gloo ranks (ZeRO-3, offload_optimizer cpu, the JSON without zero_force_ds_cpu_optimizer):
            # adamw_bnb_8bit configured by hand trained with DeepSpeedCPUAdam's fp32 states, 13,249,436 B a
            # rank where 8-bit states were predicted at 11,776,558 (over a budget of 12,096,114).
            return ("under offload_optimizer accelerate replaces the Trainer's optimizer by DeepSpeedCPUAdam "
                    "(zero_force_ds_cpu_optimizer is true, DeepSpeed's default): 8-bit AdamW would not run")
        return None
