"""Per-rank division of model states under data parallelism (DDP, DeepSpeed ZeRO, FSDP).

Kept deliberately simple; every rule is applied to the class split of each phase's high:

- ``none`` with ``world_size > 1`` (DDP): gradients are copied into communication buckets as large
  as the trainable parameters, allocated when the model is wrapped and live at every phase
  (accelerate's default ``gradient_as_bucket_view=False``; measured on a 2-rank gloo run).
- ``zero1``: optimizer states / N.
- ``zero2``: optimizer states / N and gradients / N.
- ``zero3`` and ``fsdp`` (full shard): optimizer states, gradients and weights / N, plus the
  all-gathered working copy the engines hold: the largest layer's full parameters twice (the
  layer being computed and the next one prefetched).

Activations and temporaries are per-rank already (each rank runs its own micro-batch).
"""

from __future__ import annotations

import torch


def largest_layer_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes of the largest repeated block (a decoder/encoder layer), else the largest module.

    The embedding counts too: FSDP/ZeRO-3 gather it as one unit when it is the biggest.
    """
    best = 0
    for module in model.modules():
        children = list(module.children())
        if isinstance(module, torch.nn.ModuleList):
            for child in children:
                best = max(best, sum(p.numel() * p.element_size() for p in child.parameters()))
        elif not children:
            best = max(best, sum(p.numel() * p.element_size() for p in module.parameters(recurse=False)))
    return best


def shard_classes(classes: dict[str, int], model: torch.nn.Module, world_size: int, shard: str,
                  notes: list[str]) -> dict[str, int]:
    """The per-rank split of ``classes`` under ``shard`` across ``world_size`` ranks.

    Example:
        >>> shard_classes({"weights": 8, "gradients": 8, "optimizer_states": 16, "activations": 4,
        ...                "temporaries": 0, "other": 0}, torch.nn.Linear(1, 1), 4, "zero2", [])["optimizer_states"]
        4
    """
    if world_size <= 1:
        return dict(classes)
    out = dict(classes)
    if shard == "none":
        # DDP's reducer allocates its flat buckets (the trainable parameters' bytes) when the model
        # is wrapped and keeps them for the whole run, with or without .grad at that moment.
        buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        out["gradients"] = classes["gradients"] + buckets
        _note(notes, f"DDP: gradient buckets of the trainable parameters' size ({buckets} bytes), always live")
        return out
    out["optimizer_states"] = _ceil_div(classes["optimizer_states"], world_size)
    if shard in ("zero2", "zero3", "fsdp"):
        out["gradients"] = _ceil_div(classes["gradients"], world_size)
    if shard in ("zero3", "fsdp"):
        gathered = 2 * largest_layer_bytes(model)
        out["weights"] = _ceil_div(classes["weights"], world_size) + gathered
        _note(notes, f"{shard}: weights / {world_size} + 2 x largest layer all-gathered ({gathered} bytes)")
    return out


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)
