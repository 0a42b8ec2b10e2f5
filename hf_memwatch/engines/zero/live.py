"""DeepSpeed ZeRO on a live rank: the partitions its optimizer and parameters hold, contributed to the
rank's :class:`~hf_memwatch.measure.monitor.StepMonitor` (:class:`ZeroPartitions`).

* :func:`deepspeed_storages` — what a DeepSpeed ZeRO rank holds outside ``model.parameters()``
  (fp32 master, gradient and reduce-bucket partitions, ZeRO-3 ``ds_tensor`` s).
* They are registered with the tracker at each tracked step (the fp32 master and ZeRO-3 gradient
  partitions are allocated at engine start, before tracking). Measured with DeepSpeed 0.19.8,
  ZeRO-1/2/3 on 2 gloo ranks: each class equals what DeepSpeed holds on the rank. Under DeepSpeed the
  optimizer step runs inside ``accelerator.backward`` (``engine.step()``), so the last micro-step's
  ``after_backward`` window contains the step and ``after_optimizer`` is an empty window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...compat.deepspeed import zero_partitions_named
from ...core.records import Snapshot
from ...measure.monitor import StepMonitor
from ...measure.storage import collect_storages, nested_tensors

# DeepSpeed ZeRO optimizer attributes holding rank-local tensors, by memory class. Read from
# DeepSpeed's ``runtime/zero/stage_1_and_2.py`` and ``stage3.py`` (checked on 0.19.8, 2 gloo ranks
# through the Trainer); the fp32 master partitions count as optimizer states, as in the ZeRO paper's
# "K = 12 bytes per parameter" (master, m, v). ``all_grad_tensors`` holds ZeRO-1/2's gradients
# accumulated between micro-steps, ``averaged_gradients`` the flat partition the step consumes;
# ``ipg_buckets`` (dtype -> bucket whose ``.buffer`` is a list of flat tensors) the reduce buckets.
_DEEPSPEED_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    # ZeRO-1/2 with the optimizer offloaded: a host buffer of the rank's 16-bit partition per group, made with
    # the optimizer (stage_1_and_2.py, ``param_buffer_of_bit16_for_cpu_offload_groups``)
    "weights": ("bit16_groups_flat", "fp16_partitioned_groups_flat", "param_buffer_of_bit16_for_cpu_offload_groups"),
    "gradients": (
        "averaged_gradients", "all_grad_tensors", "ipg_buckets", "ipg_buffer",
        "grad_partitions_flat_buffer", "grads_in_partition",
        # ZeRO-1/2 with the optimizer offloaded: two staging buffers of the largest parameter's numel, made
        # with the optimizer (stage_1_and_2.py, ``__init__``; both on the host on CPU ranks)
        "temp_grad_buffer_for_cpu_offload", "temp_grad_buffer_for_gpu_offload",
    ),
    "optimizer_states": ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"),
}


def deepspeed_storages(
    model: torch.nn.Module | None, optimizer: Any, device: torch.device | None
) -> dict[str, dict[int, int]]:
    """Storages a DeepSpeed ZeRO rank holds outside ``model.parameters()``, by memory class.

    ``optimizer`` is the ZeRO optimizer or any wrapper chain around it (the Trainer's
    ``DeepSpeedOptimizerWrapper``); not the torch optimizer inside it, which hides the partitions.
    ZeRO-3 keeps each parameter's partition in ``param.ds_tensor`` (``param.data`` is empty between
    uses); ZeRO-1/2/3 keep gradient partitions and fp32 master partitions in the ZeRO optimizer.
    The ``.grad`` of an fp32 master partition is a gradient.
    """
    classes: dict[str, dict[int, int]] = {"weights": {}, "gradients": {}, "optimizer_states": {}}
    if model is not None:
        collect_storages((getattr(p, "ds_tensor", None) for p in model.parameters()), device, classes["weights"])
    zero = _zero_optimizer(optimizer)
    if zero is None:
        return classes
    for name, tensors in _zero_tensors(zero).items():
        collect_storages(tensors, device, classes[name])
        # The .grad of an fp32 master partition is the rank's gradient partition.
        collect_storages((t.grad for t in tensors), device, classes["gradients"])
    return classes


def _zero_tensors(zero: Any) -> dict[str, list[torch.Tensor]]:
    """The tensors behind :data:`_DEEPSPEED_ATTRIBUTES` of a ZeRO optimizer, by memory class."""
    zero_partitions_named(zero)  # renamed in this DeepSpeed: warned once, in meta.degraded
    found: dict[str, list[torch.Tensor]] = {}
    for name, attributes in _DEEPSPEED_ATTRIBUTES.items():
        tensors = found.setdefault(name, [])
        for attribute in attributes:
            value = getattr(zero, attribute, None)
            if attribute == "ipg_buckets" and isinstance(value, Mapping):
                value = [getattr(bucket, "buffer", None) for bucket in value.values()]
            if value is not None:
                tensors.extend(nested_tensors(value))
    return found


def _zero_optimizer(optimizer: Any) -> Any:
    """The DeepSpeed ZeRO optimizer in a chain of ``.optimizer`` wrappers, or None."""
    for _ in range(8):
        if optimizer is None:
            return None
        if type(optimizer).__module__.startswith("deepspeed.") and any(
            hasattr(optimizer, a) for attrs in _DEEPSPEED_ATTRIBUTES.values() for a in attrs
        ):
            return optimizer
        inner = getattr(optimizer, "optimizer", None)
        optimizer = None if inner is optimizer else inner
    return None


class ZeroPartitions:
    """What a DeepSpeed ZeRO rank holds outside ``model.parameters()``, contributed to its monitor
    (see the module doc and :func:`deepspeed_storages`)."""

    @staticmethod
    def zero_optimizer(monitor: StepMonitor) -> Any:
        # The monitor keeps the innermost torch optimizer (its ``state``: m and v); the ZeRO
        # optimizer around it, which holds the partitions, is the one the Trainer handed over.
        return _zero_optimizer(monitor.attached_optimizer)

    def known_tensors(self, monitor: StepMonitor) -> list[torch.Tensor | None]:
        # The fp32 master and gradient partitions were allocated at engine initialization, before
        # any tracked step: without registering them the tracker would not count them.
        tensors: list[torch.Tensor | None] = []
        if monitor.model is not None:
            tensors.extend(getattr(p, "ds_tensor", None) for p in monitor.model.parameters())
        zero = self.zero_optimizer(monitor)
        if zero is not None:
            for group in _zero_tensors(zero).values():
                tensors.extend(group)
                tensors.extend(t.grad for t in group)
        return tensors

    def class_storages(self, monitor: StepMonitor) -> dict[str, dict[int, int]]:
        shards = deepspeed_storages(monitor.model, self.zero_optimizer(monitor), monitor.device)
        return {name: dict(shards[name]) for name in ("weights", "gradients", "optimizer_states")}

    def adjust(self, record: Snapshot, monitor: StepMonitor, phase: str, window_peak: int | None) -> None:
        """Nothing: every partition is a storage the monitor counted."""
