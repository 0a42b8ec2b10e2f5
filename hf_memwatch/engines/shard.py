"""The per-rank division of model states shared by the sharding engines, and its helpers.

Each engine owns its split (``EngineRules.split``: DDP's in ``engines/ddp/split.py``, ZeRO's in
``engines/zero/split.py``); what they share lives here: the full-shard division
(:func:`shard_classes`, applied to the class split of each phase's high) and the largest layer's bytes.

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
    """The per-rank split of ``classes`` under the full-shard division ``shard`` (``zero1/2/3``, ``fsdp``)
    across ``world_size`` ranks; other shards and one rank: unchanged.

    Example:
        >>> shard_classes({"weights": 8, "gradients": 8, "optimizer_states": 16, "activations": 4,
        ...                "temporaries": 0, "other": 0}, torch.nn.Linear(1, 1), 4, "zero2", [])["optimizer_states"]
        4
    """
    if world_size <= 1 or shard not in ("zero1", "zero2", "zero3", "fsdp"):
        return dict(classes)
    out = dict(classes)
    out["optimizer_states"] = ceil_div(classes["optimizer_states"], world_size)
    if shard in ("zero2", "zero3", "fsdp"):
        out["gradients"] = ceil_div(classes["gradients"], world_size)
    if shard in ("zero3", "fsdp"):
        gathered = 2 * largest_layer_bytes(model)
        out["weights"] = ceil_div(classes["weights"], world_size) + gathered
        add_note(notes, f"{shard}: weights / {world_size} + 2 x largest layer all-gathered ({gathered} bytes)")
    return out


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def add_note(notes: list[str], text: str) -> None:
    """``text`` appended to ``notes`` once."""
    if text not in notes:
        notes.append(text)
