"""What FSDP2 (``fully_shard``) holds on a rank, by memory class, read from FSDP2's own objects.

FSDP2 swaps each module's parameters between the rank's shard (a ``DTensor``, ``FSDPParam.sharded_param``)
and the all-gathered unsharded parameter (a plain tensor over ``FSDPParam.all_gather_outputs``, freed with
``UntypedStorage.resize_(0)`` when resharded). ``model.parameters()`` returns whichever is installed, so
while a module is unsharded (the root after the forward: FSDP2 never reshards the root there) its shards
are in no class, and they were counted as ``other``: 387,584 B of the test GPT-2's root on each of 2
gloo ranks (wte, wpe, ln_f). :class:`Fsdp2Storages` counts, on the rank:

* weights: every ``FSDPParam``'s local shard, the unsharded parameters' storages at their current size
  (0 once resharded) and the flat all-gather result FSDP2 keeps in its comm context between a forward
  copy-out and the next (``comm_ctx.all_gather_state``);
* gradients: the sharded gradients, the unsharded ``.grad`` before its reduce-scatter and the kept
  reduce-scatter inputs (``comm_ctx.reduce_scatter_states``) — like DDP's buckets, gradients in transit.

Attribute names checked on torch 2.13 (``torch/distributed/fsdp/_fully_shard/_fsdp_param*.py``); an
attribute missing on another version is skipped (the bytes then stay in ``other``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ...compat.fsdp import fsdp_param_group, unsharded_param
from ...core.records import Snapshot
from ...measure.storage import collect_storages


def fsdp2_param_groups(model: Any) -> list[Any]:
    """The ``FSDPParamGroup`` of every ``fully_shard`` module in ``model`` (empty without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    if not isinstance(model, torch.nn.Module):
        return []
    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = fsdp_param_group(module)
            if group is not None:
                groups.append(group)
    return groups


def _weights(groups: list[Any]) -> Iterator[torch.Tensor]:
    for group in groups:
        for param in group.fsdp_params:
            yield param.sharded_param
            yield from getattr(param, "all_gather_outputs", None) or ()
        state = getattr(group.comm_ctx, "all_gather_state", None)  # set at FSDP2's lazy init
        if state is not None:
            yield state.all_gather_result.all_gather_output


def _gradients(groups: list[Any]) -> Iterator[torch.Tensor | None]:
    for group in groups:
        for param in group.fsdp_params:
            yield param.sharded_param.grad
            unsharded = unsharded_param(param)
            if unsharded is not None:
                yield unsharded.grad
        for state in getattr(group.comm_ctx, "reduce_scatter_states", None) or ():
            yield state.reduce_scatter_input


def _nonzero(storages: dict[int, int]) -> dict[int, int]:
    return {key: nbytes for key, nbytes in storages.items() if nbytes}


class Fsdp2Storages:
    """FSDP2's shards, all-gathered parameters and communication buffers on this rank (a ``StepMonitor``
    contributor; see the module doc)."""

    def __init__(self, groups: list[Any]) -> None:
        self.groups = groups  # fsdp2_param_groups(model), read once: fully_shard has run (prepare())

    def known_tensors(self, monitor: Any) -> list[torch.Tensor | None]:
        return [*_weights(self.groups), *_gradients(self.groups)]

    def class_storages(self, monitor: Any) -> dict[str, dict[int, int]]:
        return {"weights": _nonzero(collect_storages(_weights(self.groups), monitor.device)),
                "gradients": _nonzero(collect_storages(_gradients(self.groups), monitor.device))}

    def adjust(self, record: Snapshot, monitor: Any, phase: str, window_peak: int | None) -> None:
        """Nothing to correct: every storage above is one the tracker sees (or registered)."""
