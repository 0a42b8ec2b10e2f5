"""DeepSpeed's bf16 under ZeRO: the module cast to bf16 and trained without autocast.

With ``"bf16": {"enabled": true}`` (the Trainer's ``bf16=True`` resolves ``"auto"`` to it) DeepSpeed casts
every floating parameter of the module to bf16 (``engine.py``, ``_cast_module_mixed_precision``; buffers
keep their dtype) and accelerate runs the forward without autocast (``Accelerator.native_amp`` is off under
DeepSpeed). Its ZeRO optimizer keeps the fp32 master partitions (``single_partition_of_fp32_groups``,
ZeRO-1/2; ``fp32_partitioned_groups_flat``, ZeRO-3) and steps the Trainer's optimizer on them, so states
are fp32 and per partition; the gradients are bf16 (``grad_accum_dtype`` defaults to the model's dtype, so
ZeRO-1 runs ``DeepSpeedZeroOptimizer`` too, not ``BF16_Optimizer``), reduced through bf16 buckets into a
bf16 partition, copied to fp32 (``flat_grad_partition.to(fp32)``) only for the step.

So the replay is the fp32 one of :mod:`.backward` and :mod:`.step` on a module cast to bf16: no autocast
(:func:`replay_request`), the parameters in bf16 while the step is replayed and while the rank's share is
counted (:func:`half_module`), every engine buffer in the parameters' dtype, the master and the optimizer
step in fp32. The Trainer's single-process bf16 (fp32 weights, autocast) that the estimate replayed before
counted fp32 weights and gradients and autocast's bf16 copies: on the seeded two-rank sweep's 11 DeepSpeed
bf16 draws (``benchmarks/sweep_ranks.py``) it read +7.3..+27.4% on ZeRO-1/2 and -0.6..-10.8% on ZeRO-3.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ...compat.torch_internals import disable_current_modes

HALF = torch.bfloat16
# the precision DeepSpeed's bf16 section is read from (the Trainer's ``bf16=True``; fp16 keeps the rules of shard.py)
HALF_PRECISION = "bf16"


def deepspeed_half(engine: Any, precision: str) -> bool:
    """Whether the rank runs DeepSpeed ZeRO in bf16 (a cast module, no autocast) over 2+ ranks."""
    return (engine is not None and engine.kind == "deepspeed" and engine.zero_stage in (1, 2, 3)
            and engine.world_size >= 2 and precision == HALF_PRECISION)


def replay_request(request: Any) -> Any:
    """``request`` as the replay runs DeepSpeed's bf16 step: without autocast (the module is cast)."""
    return request.replace(precision="fp32")


@contextlib.contextmanager
def half_module(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model``'s floating parameters in bf16 for the duration (buffers kept, as DeepSpeed leaves them),
    put back after: the same fake model is replayed again (other depths, other plans).

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> with half_module(layer):
        ...     layer.weight.dtype
        torch.bfloat16
        >>> layer.weight.dtype
        torch.float32
    """
    saved = []
    with disable_current_modes():  # a live tracker around the estimate must not count the fake casts
        for param in model.parameters():
            if param.dtype.is_floating_point and param.dtype != HALF:
                saved.append((param, param.data))
                param.data = param.data.to(HALF)
    try:
        yield model
    finally:
        for param, data in saved:
            param.data = data
