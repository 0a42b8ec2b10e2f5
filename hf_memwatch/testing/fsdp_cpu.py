"""FSDP2 (and FSDP1) through the ``Trainer`` on CPU ranks, for the suite and the benchmarks only.

accelerate turns ``fsdp=`` on for accelerator device types only (``AcceleratorState.__init__``: the
``DistributedType.FSDP`` branch lists ``MULTI_GPU``, ``MULTI_XPU``, ... and not ``MULTI_CPU``), so on
CPU ranks a ``TrainingArguments(fsdp=...)`` run is DDP. Everything below that switch runs on CPU
with gloo: accelerate's ``fsdp2_prepare_model`` (the auto-wrap policy, ``fully_shard`` on every
wrapped block and the root), FSDP2's all-gathers and reduce-scatters, the Trainer's loop. The one
change made here is that switch: where the Trainer passes an ``fsdp_plugin`` and the ranks are CPU
ranks, the state is FSDP, as it would be on GPUs. Nothing else in accelerate, torch or transformers
is replaced.

Call :func:`allow_fsdp_on_cpu_ranks` before building ``TrainingArguments``/``Trainer`` in the
launched script; it returns a function that undoes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def allow_fsdp_on_cpu_ranks() -> Callable[[], None]:
    """Let accelerate build FSDP (the plugin the Trainer passes) on CPU ranks; returns the undo."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "_hf_memwatch_fsdp_on_cpu", False):
        return lambda: None

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        # Every later ``AcceleratorState()`` (the Trainer makes some during ``train()``) copies
        # PartialState's MULTI_CPU over the shared state: keep FSDP while the shared state holds a plugin.
        plugin = fsdp_plugin if fsdp_plugin is not None else getattr(self, "fsdp_plugin", None)
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if fsdp_plugin is not None and self.mixed_precision != "no":
                # what the accelerator-device branch does with the plugin (state.py, AcceleratorState.__init__):
                # FSDP2's MixedPrecisionPolicy(param_dtype=reduce_dtype=output_dtype=bf16/fp16)
                fsdp_plugin.set_mixed_precision(self.mixed_precision)
            self.fsdp_plugin = plugin

    init._hf_memwatch_fsdp_on_cpu = True  # type: ignore[attr-defined]
    AcceleratorState.__init__ = init  # type: ignore[method-assign]

    def undo() -> None:
        AcceleratorState.__init__ = original  # type: ignore[method-assign]

    return undo


def allow_fsdp1_on_cpu_ranks() -> Callable[[], None]:
    """:func:`allow_fsdp_on_cpu_ranks`, and FSDP1 (``fsdp_version: 1``) given the CPU as accelerate names it.

    accelerate hands FSDP1 ``device_id=self.device`` (``cpu:0`` on a CPU rank), which torch 2.13's
    ``_get_compute_device`` (``torch/distributed/fsdp/_init_utils.py``) finds inconsistent with the CPU
    its device handle reports (``cpu``); without a ``device_id`` it refuses the CPU ("FSDP needs a non-CPU
    accelerator device"). Here the ``device_id`` FSDP1 receives is the index-less ``cpu``. The run must
    also set ``fsdp_config={"sync_module_states": False}``: accelerate's plugin asks an accelerator's
    current device for it (``FullyShardedDataParallelPlugin.__post_init__``).
    """
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    undo_switch = allow_fsdp_on_cpu_ranks()
    original = FullyShardedDataParallel.__init__
    if getattr(original, "_hf_memwatch_fsdp_on_cpu", False):
        return undo_switch

    def init(self: Any, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
        if device_id is not None and torch.device(device_id).type == "cpu":
            device_id = torch.device("cpu")
        original(self, *args, device_id=device_id, **kwargs)

    init._hf_memwatch_fsdp_on_cpu = True  # type: ignore[attr-defined]
    FullyShardedDataParallel.__init__ = init  # type: ignore[method-assign]

    def undo() -> None:
        FullyShardedDataParallel.__init__ = original  # type: ignore[method-assign]
        undo_switch()

    return undo
