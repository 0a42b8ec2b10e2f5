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
- DeepSpeed ZeRO in mixed precision (``zero1/2/3`` with bf16/fp16) holds the model in 16 bits and
  keeps an fp32 master copy and fp32 gradient partitions with the optimizer, as DeepSpeed's own
  estimators count (``estimate_zero2_model_states_mem_needs``: 2 B/param + 18 B/param / N;
  ``estimate_zero3_model_states_mem_needs``: 4 B x largest layer + 18 B/param / N). The Trainer's
  single-process mixed precision (fp32 weights, autocast) is what the other rules divide.

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
                  notes: list[str], precision: str = "fp32") -> dict[str, int]:
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
    if shard.startswith("zero") and precision in ("bf16", "fp16"):
        return _deepspeed_mixed_precision(classes, model, world_size, shard, notes)
    out["optimizer_states"] = _ceil_div(classes["optimizer_states"], world_size)
    if shard in ("zero2", "zero3", "fsdp"):
        out["gradients"] = _ceil_div(classes["gradients"], world_size)
    if shard in ("zero3", "fsdp"):
        gathered = 2 * largest_layer_bytes(model)
        out["weights"] = _ceil_div(classes["weights"], world_size) + gathered
        _note(notes, f"{shard}: weights / {world_size} + 2 x largest layer all-gathered ({gathered} bytes)")
    return out


def _deepspeed_mixed_precision(classes: dict[str, int], model: torch.nn.Module, world_size: int, shard: str,
                                notes: list[str]) -> dict[str, int]:
    """DeepSpeed ZeRO with bf16/fp16: 16-bit model and gradients, fp32 master and gradient partitions.

    ``classes`` come from a single-process estimate with fp32 weights and gradients (4 B/param).

    Example:
        >>> P = 1000  # 4 kB of fp32 weights, trainable, AdamW: 8 kB of states
        >>> c = {"weights": 4 * P, "gradients": 4 * P, "optimizer_states": 8 * P, "activations": 0,
        ...      "temporaries": 0, "other": 0}
        >>> s = shard_classes(c, torch.nn.Linear(P, 1, bias=False), 2, "zero2", [], precision="bf16")
        >>> s["weights"] + s["gradients"] + s["optimizer_states"] == 2 * P + 18 * P // 2
        True
    """
    out = dict(classes)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fp32_partitions = 8 * trainable  # fp32 master weights + fp32 gradient partition, 4 B/param each
    half_weights, half_grads = classes["weights"] // 2, classes["gradients"] // 2
    out["optimizer_states"] = _ceil_div(classes["optimizer_states"] + fp32_partitions, world_size)
    if shard in ("zero1", "zero2"):
        out["weights"] = half_weights
        # ZeRO-2 reduces the 16-bit gradients into partitions; ZeRO-1 keeps them whole.
        out["gradients"] = _ceil_div(half_grads, world_size) if shard == "zero2" else half_grads
        _note(notes, f"{shard} (DeepSpeed, 16-bit): the model in 16 bits on every rank; fp32 master, fp32 "
                     f"gradients and optimizer states / {world_size}")
        return out
    gathered = largest_layer_bytes(model)  # two 16-bit copies of the largest layer's fp32 bytes / 2
    out["weights"] = _ceil_div(half_weights, world_size) + gathered
    out["gradients"] = 0  # 16-bit gradients live only in the gathered layer's reduce buffers
    _note(notes, f"zero3 (DeepSpeed, 16-bit): weights / {world_size} in 16 bits + the largest layer gathered "
                 f"twice ({gathered} bytes); fp32 master, gradients and optimizer states / {world_size}")
    return out


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)
