"""Attribution of live bytes to the memory classes — pure functions over storage maps.

Precedence when one storage belongs to several classes (it counts once, in the first):
weights > gradients > optimizer_states > activations. Saved tensors that are parameters or
buffers stay weights; ``.grad`` views of a DDP bucket are gradients through the bucket storage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..core.categories import MemClass
from .storage import collect_storages, nested_tensors


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` and similar wrappers."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def is_quantized_param(tensor: torch.Tensor) -> bool:
    """A bitsandbytes 4-bit (``Params4bit``) or 8-bit (``Int8Params``) parameter (by class name: no
    bitsandbytes import where it is not installed)."""
    return type(tensor).__name__ in ("Params4bit", "Int8Params")


def quant_state_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a quantized parameter keeps beside its data: absmax, code tables, nested statistics
    (4-bit), the per-row scales (8-bit). Empty for any other tensor. Read from the attributes
    bitsandbytes' layers read, which the estimator's fake twins carry too."""
    found: list[torch.Tensor] = []
    state = getattr(tensor, "quant_state", None)
    while state is not None:  # a nested state holds the statistics of the absmax in state2
        found.extend(t for t in (state.absmax, state.code, getattr(state, "offset", None))
                     if isinstance(t, torch.Tensor))
        state = getattr(state, "state2", None)
    scales = getattr(tensor, "SCB", None)
    if isinstance(scales, torch.Tensor):
        found.append(scales)
    return found


def weight_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers and the quantization state of bitsandbytes-quantized parameters (absmax,
    code tables, scales: resident as long as the weight, yet neither a parameter nor a buffer)."""
    tensors: list[torch.Tensor] = []
    for param in model.parameters():
        tensors.append(param)
        tensors.extend(quant_state_tensors(param))
    tensors.extend(model.buffers())
    return tensors


def weight_storages(model: torch.nn.Module, device: torch.device | None) -> dict[int, int]:
    """Unique storages of the weights (:func:`weight_tensors`; tied weights count once).

    Example:
        >>> m = torch.nn.Linear(4, 2)
        >>> sum(weight_storages(m, None).values())
        40
    """
    return collect_storages(weight_tensors(model), device)


def gradient_storages(
    model: torch.nn.Module, device: torch.device | None, extra: Iterable[torch.Tensor] = ()
) -> dict[int, int]:
    """Unique storages of ``.grad`` of every parameter, plus ``extra`` (DDP gradient buckets).

    Example:
        >>> m = torch.nn.Linear(4, 2); m(torch.ones(1, 4)).sum().backward()
        >>> sum(gradient_storages(m, None).values())
        40
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grads.extend(extra)
    return collect_storages(grads, device)


def optimizer_state_storages(optimizer: Any, device: torch.device | None) -> dict[int, int]:
    """Unique storages of every tensor in ``optimizer.state`` (bitsandbytes 8-bit states included).

    Example:
        >>> p = torch.nn.Parameter(torch.ones(8)); opt = torch.optim.AdamW([p])
        >>> p.grad = torch.ones(8); opt.step()
        >>> sum(optimizer_state_storages(opt, None).values())  # exp_avg, exp_avg_sq, step
        68
    """
    if optimizer is None:
        return {}
    optimizer = unwrap_optimizer(optimizer)
    state = getattr(optimizer, "state", None)
    if not isinstance(state, Mapping):
        return {}
    return collect_storages(nested_tensors(list(state.values())), device)


def split_live(
    allocated: int | None,
    weights: Mapping[int, int],
    gradients: Mapping[int, int],
    optimizer_states: Mapping[int, int],
    saved: Mapping[int, int],
    outputs: Mapping[int, int] | None = None,
) -> dict[str, int | None]:
    """Split ``allocated`` into the five live classes, each storage counted once.

    ``other`` is the remainder (inputs, logits, autocast caches, ...); ``None`` when the
    allocator cannot be read. With ``outputs`` (an evaluation loop's accumulated predictions,
    logits and labels) a sixth class ``outputs`` comes before ``other``.

    Example:
        >>> split_live(100, {1: 40}, {2: 10}, {}, {1: 40, 3: 20})
        {'weights': 40, 'gradients': 10, 'optimizer_states': 0, 'activations': 20, 'other': 30}
    """
    seen: set[int] = set()
    figures: dict[str, int | None] = {}
    for name, storages in (
        (MemClass.WEIGHTS.value, weights),
        (MemClass.GRADIENTS.value, gradients),
        (MemClass.OPTIMIZER_STATES.value, optimizer_states),
        (MemClass.ACTIVATIONS.value, saved),
        *(((MemClass.OUTPUTS.value, outputs),) if outputs is not None else ()),
    ):
        figures[name] = sum(nbytes for key, nbytes in storages.items() if key not in seen)
        seen.update(storages)
    known = sum(v for v in figures.values() if v is not None)
    figures[MemClass.OTHER.value] = None if allocated is None else allocated - known
    return figures


def spike_above(peak: int, allocated: int, previous_allocated: int | None) -> int:
    """The spike of a snapshot window: its peak above the higher of its two ends (the allocated bytes
    now and at the previous snapshot), the temporaries that came and went inside it.

    Example:
        >>> spike_above(900, 500, 700), spike_above(900, 500, None), spike_above(400, 500, None)
        (200, 400, 0)
    """
    floor = allocated if previous_allocated is None else max(previous_allocated, allocated)
    return max(0, peak - floor)


def dominant_class(live: Mapping[str, int | None], spike: int | None) -> str:
    """The class holding the most bytes, the spike counting as ``temporaries``.

    Example:
        >>> dominant_class({"weights": 5, "activations": 7}, spike=9)
        'temporaries'
    """
    candidates = {k: v or 0 for k, v in live.items()}
    candidates[MemClass.TEMPORARIES.value] = spike or 0
    return max(candidates, key=lambda k: candidates[k])
