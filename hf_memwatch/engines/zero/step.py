"""The optimizer step DeepSpeed ZeRO really runs: the Trainer's optimizer on the rank's flat fp32 partitions.

Under ZeRO-1/2/3 the Trainer's optimizer never sees the model's parameters: DeepSpeed hands it one
flat fp32 partition per parameter group (``single_partition_of_fp32_groups`` /
``fp32_partitioned_groups_flat``, ``ceil(group numel / N)`` elements on each of N ranks) and steps
it group by group. What the step holds then is that optimizer's on those tensors, not a share of the
per-parameter step the single-process replay runs:

- states: bitsandbytes' 8-bit AdamW keeps one byte per element and state of a flat partition over
  its 4,096-element threshold, whatever the parameters in it (the Trainer's 32-bit override of the
  embeddings names the embedding tensors, not the partition);
- temporaries: its CPU kernel dequantizes both states and builds the update in fp32 over the whole
  partition (5 x 4 B per element at its high), where the per-parameter step's high was the largest
  parameter's.

Measured on 2 gloo ranks (test GPT-2, 590,336 fp32 parameters; ``tests/engines/test_deepspeed_zero.py``): the
8-bit states of the two partitions (293,376 and 1,792 elements) 612,304 B, exactly what
:func:`flat_step` counts; the planned ZeRO-2 step peaked at 12.5 MB where the per-parameter step
predicted 8.5 MB.

:func:`flat_step` runs the Trainer's optimizer class (the same class and kwargs as the Trainer
builds) over fake flat partitions under an :class:`EstimateTracker`, with bitsandbytes' CPU
kernels replayed, and returns its resident states and the step's high above them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ...compat.torch_internals import FakeTensorMode, disable_current_modes
from ...core.categories import AFTER_OPTIMIZER, STEP_END
from ...estimation.fake_dispatch import EstimateTracker
from ...estimation.optim import BNB_OPTIMS, optimizer_class_and_kwargs, param_groups
from ...measure.saved_tensors import SavedTensorRegistry
from .backward import FLOW_DTYPES, flow_applies, planned_partition
from .split import zero3_gathered_bytes


@dataclass(frozen=True)
class FlatStep:
    """What the optimizer holds on the rank's flat partitions: states (resident) and the step's temporaries."""

    partitions: tuple[int, ...]  # elements of each group's partition on this rank
    states: int
    temporaries: int


def rank_partitions(model: torch.nn.Module, world_size: int) -> tuple[int, ...]:
    """Elements of each (non-empty) Trainer parameter group's flat partition on one of ``world_size`` ranks.

    Example:
        >>> rank_partitions(torch.nn.Linear(10, 10), 2)  # weight (decay) 100, bias (no decay) 10
        (50, 5)
    """
    sizes = [sum(p.numel() for p in group["params"]) for group in param_groups(model)]
    return tuple(-(-size // world_size) for size in sizes if size > 0)


def flat_step(model: torch.nn.Module, world_size: int, optim: str, device: str = "cpu") -> FlatStep:
    """The Trainer's ``optim`` stepped on fake fp32 flat partitions of ``model`` over ``world_size`` ranks.

    Two steps (the first creates the states); the temporaries are the second step's high above what
    was live before it (partitions, their gradients, the states).
    """
    partitions = rank_partitions(model, world_size)
    cls, kwargs = optimizer_class_and_kwargs(optim, None)
    with disable_current_modes():
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode:
            flats = [torch.nn.Parameter(torch.zeros(n, dtype=torch.float32)) for n in partitions]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer = cls([{"params": [flat]} for flat in flats], **kwargs)  # decay allocates nothing
        tracker = EstimateTracker("cpu", SavedTensorRegistry(),
                                  bnb_cpu_kernels=(device == "cpu" and optim in BNB_OPTIMS))
        with fake_mode, tracker:
            tracker.register(flats)
            for flat in flats:
                flat.grad = torch.zeros_like(flat)
            optimizer.step()  # creates the states
            held = tracker.allocated
            tracker.reset_peak()
            optimizer.step()
            temporaries = tracker.peak - held
        states = held - sum(4 * 2 * n for n in partitions)  # less the partitions and their gradients
    return FlatStep(partitions, states, temporaries)


def zero_optimizer_step(per_phase: dict[str, dict[str, int]], model: torch.nn.Module, engine: Any, optim: str,
                        device: str, notes: list[str]) -> dict[str, dict[str, int]]:
    """``per_phase`` (per-rank classes) with the optimizer DeepSpeed steps: states and step temporaries on
    the flat partitions instead of the per-parameter step's share. Other engines: unchanged.

    The states of every phase holding them become the flat step's (plus the fp32 master partition
    :func:`~hf_memwatch.engines.zero.split.engine_classes` counted). The optimizer phase (DeepSpeed
    steps inside the last micro-step's backward) holds the flat step's temporaries, the fp32 copy of
    the gradient partition ZeRO flattens for it (without offload; with offload the host partition,
    already counted, is stepped) and, on ZeRO-3, the weight partitions alone (the gathered ones are
    released by the backward). Measured (2 gloo ranks, planned 8-bit AdamW, GPT-2 of the module doc):
    ZeRO-2 step 8,346,636 B above the resident set = gradients 1,305,600 + copy 1,173,504 + kernel
    5,867,520; ZeRO-3 7,024,668 B = copy + kernel (within 16 kB).
    """
    if engine is None or engine.kind != "deepspeed" or engine.zero_stage not in (1, 2, 3) or engine.world_size < 2 \
            or engine.engine_optimizer or AFTER_OPTIMIZER not in per_phase:
        return per_phase
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable or any(p.dtype not in FLOW_DTYPES for p in trainable):
        return per_phase  # DeepSpeed's fp16 runs: the mixed-precision rules in shard.py
    if engine.cpu_optimizer and optim != "adamw_torch":  # accelerate's DeepSpeedCPUAdam: fp32 moments + step
        notes.append(f"offload optimizer: accelerate steps DeepSpeedCPUAdam, not {optim} "
                     "(zero_force_ds_cpu_optimizer true); its states as fp32 AdamW's")
        optim = "adamw_torch"
    step = flat_step(model, engine.world_size, optim, device)
    master = sum(4 * n for n in step.partitions)
    stepped = per_phase[AFTER_OPTIMIZER]["optimizer_states"]
    out = {}
    for phase, classes in per_phase.items():
        classes = dict(classes)
        if classes["optimizer_states"] >= stepped:  # the states exist at that phase (primed)
            classes["optimizer_states"] = master + step.states
        out[phase] = classes
    at_step = out[AFTER_OPTIMIZER]
    at_step["temporaries"] = step.temporaries
    size = trainable[0].element_size()  # the kept partition's dtype: the parameters' (bf16 under DeepSpeed's bf16)
    # offload: the host fp32 gradient partition is the one stepped, resident already (split.engine_classes)
    if engine.offload_optimizer == "none" and flow_applies(engine, model):
        # the replay left no gradient: the kept partition DeepSpeed flattens
        at_step["gradients"] = size * planned_partition(model, engine.world_size).numel + 4 * max(step.partitions)
    elif engine.offload_optimizer == "none":
        at_step["gradients"] += 4 * max(step.partitions)
    if engine.zero_stage == 3:  # gathered parameters are released by the backward's end
        at_step["weights"] -= zero3_gathered_bytes(model, engine)
        if STEP_END in out:  # and nothing is freed by zero_grad: the replay's .grad were in the partition
            out[STEP_END]["weights"] -= zero3_gathered_bytes(model, engine)
            out[STEP_END]["temporaries"] = 0
    notes.append(f"zero{engine.zero_stage}: {optim} steps the flat fp32 partitions "
                 f"({', '.join(str(n) for n in step.partitions)} elements; states {step.states} bytes, "
                 f"step temporaries {step.temporaries} bytes, + the fp32 gradient copy of a partition)")
    return out
