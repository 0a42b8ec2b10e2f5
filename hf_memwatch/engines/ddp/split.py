"""DDP's per-rank split (``shard`` ``none`` over 2+ ranks): the reducer's gradient buckets beside the model.

Gradients are copied into communication buckets as large as the trainable parameters, allocated when the
model is wrapped and live at every phase (accelerate's default ``gradient_as_bucket_view=False``; measured
on a 2-rank gloo run). Activations and temporaries are per-rank already (each rank runs its own micro-batch).
"""

from __future__ import annotations

import torch

from ..shard import add_note


def ddp_split(classes: dict[str, int], model: torch.nn.Module, world_size: int, notes: list[str]) -> dict[str, int]:
    """The per-rank split of ``classes`` under DDP over ``world_size`` ranks.

    Example:
        >>> ddp_split({"weights": 8, "gradients": 8, "optimizer_states": 16, "activations": 4,
        ...            "temporaries": 0, "other": 0}, torch.nn.Linear(1, 1), 2, [])["gradients"]
        16
    """
    if world_size <= 1:
        return dict(classes)
    out = dict(classes)
    # DDP's reducer allocates its flat buckets (the trainable parameters' bytes) when the model
    # is wrapped and keeps them for the whole run, with or without .grad at that moment.
    buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    out["gradients"] = classes["gradients"] + buckets
    add_note(notes, f"DDP: gradient buckets of the trainable parameters' size ({buckets} bytes), always live")
    return out
