"""DeepSpeed ZeRO's per-rank split (``shard`` ``zero1``/``zero2``/``zero3``) and what the engine holds beyond it.

:func:`zero_split` divides the classes of one process's step as ZeRO does:

- ``zero1``: optimizer states / N; ``zero2``: optimizer states / N and gradients / N; ``zero3``: optimizer
  states, gradients and weights / N, plus the all-gathered working copy (the largest layer's full parameters
  twice: the layer being computed and the next one prefetched): the full-shard division of
  :func:`~hf_memwatch.engines.shard.shard_classes`;
- DeepSpeed ZeRO in fp16 (the rule still used where no replay applies; bf16 replays the cast module,
  :mod:`.half`) holds the model in 16 bits and keeps an fp32 master copy and fp32 gradient partitions with
  the optimizer, as DeepSpeed's own estimators count (``estimate_zero2_model_states_mem_needs``: 2 B/param +
  18 B/param / N; ``estimate_zero3_model_states_mem_needs``: 4 B x largest layer + 18 B/param / N).

Given the :class:`~hf_memwatch.engines.engine.Engine` DeepSpeed runs (its JSON read by ``RunConfig``),
:func:`engine_classes` adds what the engine itself holds, measured on 2 gloo ranks (test GPT-2,
590,336 fp32 parameters, buckets of 100,000 elements; ``tests/engines/test_deepspeed_zero.py``):

- the fp32 master partition, also in fp32 training (``single_partition_of_fp32_groups`` /
  ``fp32_partitioned_groups_flat``, a copy of the rank's share: 1,180,672 B per rank, counted with
  the optimizer states as in the ZeRO paper);
- ZeRO-1/2/3: the reduce bucket, ``reduce_bucket_size`` elements of the gradients' dtype whatever the
  model (``torch.empty(int(reduce_bucket_size))``: DeepSpeed's default of 5e8 elements is 2 GB in fp32 on a
  tiny model too), live from the first backward on (ZeRO-1/2 without offload: replayed by the flow instead);
- ZeRO-3: gathered parameters are released only when they will not be used again within
  ``stage3_max_reuse_distance`` elements (default 1e9) and fewer than ``stage3_max_live_parameters``
  are live: a model below both stays gathered whole from the forward to the backward that uses it
  (measured: weights 1,180,672 B partition + 2,361,344 B gathered after the forward). Otherwise the
  working set is the layer being computed plus what the prefetch may gather (at most
  ``stage3_prefetch_bucket_size`` elements, at most one more layer), bounded by the live limit;
- ``offload_optimizer``: DeepSpeed keeps an fp32 gradient partition in host memory for the CPU step
  (measured: gradients 2,761,344 B = 1,580,672 B + 1,180,672 B);
- ``offload_optimizer``/``offload_param``: the states (and parameters) live in host RAM. On CPU ranks
  host RAM is the device, so the figures stay; on an accelerator they leave the device classes and
  are reported as host bytes (``host_bytes``), to count against the host limit.
"""

from __future__ import annotations

from typing import Any

import torch

from ..shard import add_note, ceil_div, largest_layer_bytes, shard_classes


def zero_split(classes: dict[str, int], model: torch.nn.Module, world_size: int, shard: str,
               notes: list[str], precision: str = "fp32") -> dict[str, int]:
    """The per-rank split of ``classes`` under ZeRO ``shard`` across ``world_size`` ranks (see the module doc).

    Example:
        >>> zero_split({"weights": 8, "gradients": 8, "optimizer_states": 16, "activations": 4,
        ...             "temporaries": 0, "other": 0}, torch.nn.Linear(1, 1), 4, "zero2", [])["optimizer_states"]
        4
    """
    if world_size > 1 and precision in ("bf16", "fp16"):
        return _deepspeed_mixed_precision(classes, model, world_size, shard, notes)
    return shard_classes(classes, model, world_size, shard, notes)


def _deepspeed_mixed_precision(classes: dict[str, int], model: torch.nn.Module, world_size: int, shard: str,
                                notes: list[str]) -> dict[str, int]:
    """DeepSpeed ZeRO with bf16/fp16: 16-bit model and gradients, fp32 master and gradient partitions.

    ``classes`` come from a single-process estimate with fp32 weights and gradients (4 B/param).

    Example:
        >>> P = 1000  # 4 kB of fp32 weights, trainable, AdamW: 8 kB of states
        >>> c = {"weights": 4 * P, "gradients": 4 * P, "optimizer_states": 8 * P, "activations": 0,
        ...      "temporaries": 0, "other": 0}
        >>> s = zero_split(c, torch.nn.Linear(P, 1, bias=False), 2, "zero2", [], precision="bf16")
        >>> s["weights"] + s["gradients"] + s["optimizer_states"] == 2 * P + 18 * P // 2
        True
    """
    out = dict(classes)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fp32_partitions = 8 * trainable  # fp32 master weights + fp32 gradient partition, 4 B/param each
    half_weights, half_grads = classes["weights"] // 2, classes["gradients"] // 2
    out["optimizer_states"] = ceil_div(classes["optimizer_states"] + fp32_partitions, world_size)
    if shard in ("zero1", "zero2"):
        out["weights"] = half_weights
        # ZeRO-2 reduces the 16-bit gradients into partitions; ZeRO-1 keeps them whole.
        out["gradients"] = ceil_div(half_grads, world_size) if shard == "zero2" else half_grads
        add_note(notes, f"{shard} (DeepSpeed, 16-bit): the model in 16 bits on every rank; fp32 master, fp32 "
                     f"gradients and optimizer states / {world_size}")
        return out
    gathered = largest_layer_bytes(model)  # two 16-bit copies of the largest layer's fp32 bytes / 2
    out["weights"] = ceil_div(half_weights, world_size) + gathered
    out["gradients"] = 0  # 16-bit gradients live only in the gathered layer's reduce buffers
    add_note(notes, f"zero3 (DeepSpeed, 16-bit): weights / {world_size} in 16 bits + the largest layer gathered "
                 f"twice ({gathered} bytes); fp32 master, gradients and optimizer states / {world_size}")
    return out


def engine_classes(classes: dict[str, int], model: torch.nn.Module, engine: Any, notes: list[str],
                   precision: str = "fp32", device: str = "cpu", flowed: bool = False) -> tuple[dict[str, int], int]:
    """(per-rank classes, host bytes) with what DeepSpeed ``engine`` holds beyond the ZeRO split.

    ``classes`` are :func:`zero_split`'s output for ``engine.shard``. Only fp32 ZeRO gains here
    (the 16-bit rules above already count the master copy). ``flowed``: the replay held ZeRO-1/2's
    gradients, bucket included, as the rank does (:mod:`~hf_memwatch.engines.zero.backward`).

    Example:
        >>> from hf_memwatch.engines.engine import Engine
        >>> zero2 = Engine(kind="deepspeed", world_size=2, zero_stage=2, reduce_bucket_size=10)
        >>> c = {"weights": 400, "gradients": 200, "optimizer_states": 400, "activations": 0,
        ...      "temporaries": 0, "other": 0}
        >>> engine_classes(c, torch.nn.Linear(10, 10, bias=False), zero2, [])[0]["optimizer_states"]
        600
    """
    if engine is None or engine.kind != "deepspeed" or engine.zero_stage not in (1, 2, 3) or engine.world_size < 2:
        return dict(classes), 0
    out = dict(classes)
    trainable = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in trainable)
    size = trainable[0].element_size() if trainable else 4
    world, stage = engine.world_size, engine.zero_stage
    if precision not in ("bf16", "fp16"):
        out["optimizer_states"] += ceil_div(4 * numel, world)
        add_note(notes, f"zero{stage} (DeepSpeed, {trainable[0].dtype if trainable else torch.float32} parameters): + the fp32 master partition ({ceil_div(4 * numel, world)} bytes)")
    if stage == 3 and precision not in ("bf16", "fp16"):
        # ZeRO-3 reduces every gradient into its flat partition (``grad_partitions_flat_buffer``,
        # each parameter's ceil(numel / N) elements), allocated with the engine and resident at every
        # phase with the reduce bucket; a ``.grad`` lives only until its hook copies it into the bucket.
        # The bucket is ``torch.empty(reduce_bucket_size)`` (stage3.py, contiguous gradients), whatever the model.
        partition = sum(ceil_div(p.numel(), world) for p in trainable) * size
        bucket = int(engine.reduce_bucket_size or numel) * size
        out["gradients"] = partition + bucket
        add_note(notes, f"zero3: the gradient partition ({partition} bytes) + the reduce bucket ({bucket} bytes), resident")
    elif stage in (1, 2) and not flowed:
        # stage_1_and_2.py ``setup_buckets``: ``torch.empty(int(reduce_bucket_size))`` at each backward's first
        # gradient (contiguous gradients: DeepSpeed's default, forced under offload), ZeRO-1 too, whatever the
        # model. Measured (2 gloo ranks, test GPT-2 of 590,336 parameters, 2 x 16, DeepSpeed's default 5e8
        # elements, offload_optimizer): step peaks 2,010,330,132 B (ZeRO-1) and 2,009,306,128 B (ZeRO-2) by
        # the profiler, where a bucket capped at the trainable parameters predicted 11,494,424 and 12,831,248 B.
        bucket = int(engine.reduce_bucket_size or numel) * size
        out["gradients"] += bucket
        add_note(notes, f"zero{stage}: + the reduce bucket ({bucket} bytes)")
    if stage == 3:
        out["weights"] += zero3_gathered_bytes(model, engine) - 2 * largest_layer_bytes(model)  # shard_classes' 2 layers
        add_note(notes, f"zero3: {zero3_gathered_bytes(model, engine)} bytes of parameters gathered at once")
    host = 0
    if engine.offload_optimizer != "none":
        out["gradients"] += ceil_div(4 * numel, world)
        add_note(notes, f"offload optimizer: + the fp32 gradient partition for the host step ({ceil_div(4 * numel, world)} bytes)")
    if engine.offload_optimizer != "none" and stage in (1, 2) and trainable:
        if flowed:
            # stage_1_and_2.py (__init__): a buffer of the rank's partition in the model's dtype per group, into
            # which the host step's fp32 result is copied (``param_buffer_of_bit16_for_cpu_offload_groups``)
            bit16 = ceil_div(size * numel, world)
            out["weights"] += bit16
            add_note(notes, f"offload optimizer: + the 16-bit host buffer of the rank's partition ({bit16} bytes)")
        # stage_1_and_2.py (__init__): temp_grad_buffer_for_cpu_offload (host) and temp_grad_buffer_for_gpu_offload
        # (the device), each the largest parameter's numel in the model's dtype, resident from the engine on
        staging = max(p.numel() for p in trainable) * size
        out["gradients"] += staging if device != "cpu" else 2 * staging
        host += staging if device != "cpu" else 0
        add_note(notes, f"offload optimizer: + 2 staging buffers of the largest parameter ({staging} bytes each)")
    if engine.offload != "none":
        moved = ["optimizer_states"] + (["weights"] if engine.offload == "params" else [])
        if device != "cpu":
            host += sum(out[name] for name in moved)
            for name in moved:
                out[name] = 0
            add_note(notes, f"offload {engine.offload}: {host} bytes in host RAM, off the device")
        else:
            add_note(notes, f"offload {engine.offload}: on CPU ranks host RAM is the device; the states stay counted")
    return out, host


def zero3_gathered_bytes(model: torch.nn.Module, engine: Any) -> int:
    """Parameter bytes ZeRO-3 holds gathered at once (see the module doc for the rule)."""
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    full = sum(p.numel() * p.element_size() for p in params)
    size = params[0].element_size() if params else 4
    reuse = engine.max_reuse_distance if engine.max_reuse_distance is not None else 1_000_000_000
    live = engine.max_live_parameters if engine.max_live_parameters is not None else 1_000_000_000
    if reuse >= numel and live >= numel:
        return full
    layer = largest_layer_bytes(model)
    prefetch = min(layer, int(engine.prefetch_bucket_size or 0) * size)
    return min(layer + prefetch, max(layer, live * size))
