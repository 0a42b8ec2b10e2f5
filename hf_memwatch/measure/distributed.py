"""Distributed runs: per-rank accounting and decisions agreed through the process group.

Everything here uses the process group the user's launcher already set up (``torchrun``,
``accelerate launch``, DeepSpeed) through ``torch.distributed``; nothing is launched or created.
Without an initialized process group every helper degrades to the single-process answer.

* :func:`world`, :func:`gather_ints`, :func:`max_over_ranks` — small collectives.
* :func:`agree_plan` / :func:`decide_across_ranks` — the rank that needs the most memory decides
  for all; :func:`agree_unavailable` unions the remedies some rank cannot apply;
  :func:`share_failure` / :class:`PeerFailure` — a rank that fails while planning makes every rank
  leave the agreement together instead of leaving them waiting in a collective.
* :func:`ddp_bucket_sizes`, :func:`ddp_gradient_buckets` — DDP's reducer keeps its own flat
  gradient buckets (as large as the gradients with the default ``gradient_as_bucket_view=False``);
  they are gradients.
* :func:`deepspeed_storages` — what a DeepSpeed ZeRO rank holds outside ``model.parameters()``
  (fp32 master, gradient and reduce-bucket partitions, ZeRO-3 ``ds_tensor`` s).
* :class:`EngineStorages` — what the engine holds, contributed to the rank's :class:`~hf_memwatch.measure.monitor.StepMonitor`.

FSDP2 parameters, gradients and optimizer states are ``DTensor`` s whose local shard is what
:func:`~hf_memwatch.measure.storage.plain_tensors` unwraps (measured with ``fully_shard`` on gloo: each
of 2 ranks holds half); what ``model.parameters()`` does not show while a module is unsharded (its
shards, the all-gathered parameters, FSDP2's kept all-gather and reduce-scatter buffers) is counted by
:class:`~hf_memwatch.measure.fsdp2.Fsdp2Storages`. FSDP2 frees its all-gathered parameters with
``UntypedStorage.resize_(0)``: the storage tracker and the saved-tensor registry read sizes when
asked (``StorageTracker.watch_resizes``, ``SavedTensorRegistry.storages``). FSDP1 parameters are views
of the rank's flat shard (not run here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..compat.deepspeed import zero_partitions_named
from ..core.categories import STEP_BEGIN
from .fsdp2 import Fsdp2Storages, fsdp2_param_groups
from .held_models import HeldModels, held_models
from .monitor import StepMonitor
from .storage import collect_storages, nested_tensors

# DeepSpeed ZeRO optimizer attributes holding rank-local tensors, by memory class. Read from
# DeepSpeed's ``runtime/zero/stage_1_and_2.py`` and ``stage3.py`` (checked on 0.19.8, 2 gloo ranks
# through the Trainer); the fp32 master partitions count as optimizer states, as in the ZeRO paper's
# "K = 12 bytes per parameter" (master, m, v). ``all_grad_tensors`` holds ZeRO-1/2's gradients
# accumulated between micro-steps, ``averaged_gradients`` the flat partition the step consumes;
# ``ipg_buckets`` (dtype -> bucket whose ``.buffer`` is a list of flat tensors) the reduce buckets.
_DEEPSPEED_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "weights": ("bit16_groups_flat", "fp16_partitioned_groups_flat"),
    "gradients": (
        "averaged_gradients", "all_grad_tensors", "ipg_buckets", "ipg_buffer",
        "grad_partitions_flat_buffer", "grads_in_partition",
        # ZeRO-1/2 with the optimizer offloaded: two staging buffers of the largest parameter's numel, made
        # with the optimizer (stage_1_and_2.py, ``__init__``; both on the host on CPU ranks)
        "temp_grad_buffer_for_cpu_offload", "temp_grad_buffer_for_gpu_offload",
    ),
    "optimizer_states": ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"),
}


# -- process group ------------------------------------------------------------------------------
def is_distributed() -> bool:
    """True when a ``torch.distributed`` process group is up with more than one rank."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` without one.

    Example:
        >>> world()  # no process group in a doctest
        (0, 1)
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (a collective: every rank must call it).

    Uses ``torch.distributed.all_gather_object``, which picks the device the backend needs (CPU
    for gloo, the current CUDA device for NCCL).
    """
    if not is_distributed():
        return [value]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def gather_ints(value: int | None) -> list[int | None]:
    """Every rank's integer (``None`` where a rank has no figure), in rank order.

    Example:
        >>> gather_ints(7)
        [7]
    """
    return [None if v is None else int(v) for v in gather_objects(None if value is None else int(value))]


def max_over_ranks(value: int | None) -> int | None:
    """The largest of every rank's ``value`` (ranks without a figure are ignored).

    Example:
        >>> max_over_ranks(5)
        5
    """
    known = [v for v in gather_ints(value) if v is not None]
    return max(known) if known else None


class PeerFailure(RuntimeError):
    """Another rank failed while the ranks were agreeing; every rank stops agreeing together.

    ``fatal`` says the failing rank raised a :class:`~hf_memwatch.core.errors.PlanError` or a
    configuration error (every rank should stop with ``message``) rather than an internal fault
    (every rank falls back to training as configured).
    """

    def __init__(self, message: str, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


def _exchange(payload: Any) -> list[Any]:
    """All ranks' payloads; raises :class:`PeerFailure` when some rank sent a failure instead.

    Every agreement goes through here with the same envelope, so a rank that fails at any point
    sends exactly one failure envelope (:func:`share_failure`) which meets its peers' next
    exchange, whatever it is: all ranks leave the protocol after the same number of collectives.
    """
    envelopes = gather_objects(("ok", payload))
    for rank, (kind, body) in enumerate(envelopes):
        if kind == "failed":
            message, fatal = body
            raise PeerFailure(f"rank {rank}: {message}", fatal)
    return [body for _, body in envelopes]


def share_failure(exc: BaseException, fatal: bool) -> None:
    """Tell the other ranks, at their next agreement, that this rank failed (a collective).

    Call it once, from the rank that failed, unless the failure is a :class:`PeerFailure` (then
    every rank already knows). A no-op without a process group.
    """
    if is_distributed() and not isinstance(exc, PeerFailure):
        gather_objects(("failed", (f"{type(exc).__name__}: {exc}", bool(fatal))))


@dataclass(frozen=True)
class Agreement:
    """The outcome of :func:`decide_across_ranks`: the plan every rank applies and who chose it."""

    plan: dict[str, Any]
    decider: int
    needs: list[int]


def decide_across_ranks(local_plan: Mapping[str, Any], need_bytes: int) -> Agreement:
    """The plan of the rank that needs the most bytes (ties: the lowest rank), on every rank.

    ``need_bytes`` is how much the rank must cut from the configured run to fit its budget (its
    predicted peak minus its usable budget, negative when it fits): the rank under the most pressure
    chooses, and its plan fits every rank whose budget is larger. One ``all_gather_object``: every
    rank must call it once at the same point, and every rank then holds the same answer.
    """
    entries = _exchange((int(need_bytes), dict(local_plan)))
    needs = [need for need, _ in entries]
    decider = max(range(len(entries)), key=lambda rank: (needs[rank], -rank))
    return Agreement(plan=dict(entries[decider][1]), decider=decider, needs=needs)


def agree_plan(local_plan: Mapping[str, Any], need_bytes: int) -> dict[str, Any]:
    """All ranks get the plan of the rank that needs the most (see :func:`decide_across_ranks`).

    Example:
        >>> agree_plan({"micro_batch_size": 4}, need_bytes=10)
        {'micro_batch_size': 4}
    """
    return decide_across_ranks(local_plan, need_bytes).plan


def agree_unavailable(local_unavailable: Mapping[str, str]) -> dict[str, str]:
    """Remedy name -> reason for every remedy that cannot apply on at least one rank.

    A remedy unavailable anywhere must be excluded everywhere before planning, so the agreed plan
    can be applied by all ranks (a collective: every rank must call it).

    Example:
        >>> agree_unavailable({"8-bit AdamW": "bitsandbytes is not installed"})
        {'8-bit AdamW': 'bitsandbytes is not installed'}
    """
    gathered = _exchange(dict(local_unavailable))
    merged: dict[str, str] = {}
    for rank, unavailable in enumerate(gathered):
        for remedy, reason in unavailable.items():
            merged.setdefault(remedy, f"rank {rank}: {reason}" if len(gathered) > 1 else reason)
    return merged


# -- DDP ----------------------------------------------------------------------------------------
def find_ddp(module: Any) -> torch.nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` wrapper in ``module`` (itself or a wrapper's ``.module``)."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            return module
        inner = getattr(module, "module", None)
        if inner is None or inner is module:
            return None
        module = inner
    return None


def ddp_bucket_sizes(ddp: torch.nn.parallel.DistributedDataParallel) -> list[int]:
    """Bytes of each gradient bucket of DDP's reducer, from DDP's own logging data (no allocation).

    After the first iteration the reducer may rebuild its buckets in gradient-ready order; the
    rebuilt sizes then replace the initial ones.
    """
    data = ddp._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return [int(s) for s in str(sizes).split(",") if s.strip()]


def ddp_gradient_buckets(
    model: Any, live: Mapping[int, torch.UntypedStorage] | None = None
) -> list[torch.Tensor]:
    """DDP's gradient bucket storages, as tensors, where they can be found.

    With ``gradient_as_bucket_view=True`` the parameters' ``.grad`` (when set) are views of the
    buckets and stand for them. Otherwise, and for buckets whose ``.grad`` views were set to None,
    the reducer keeps the buckets to itself: ``live`` (storage key -> storage, e.g. the CPU
    tracker's live storages) is searched for storages of exactly a bucket's size that are not
    parameters or gradients. Buckets not found are counted by :class:`EngineStorages` by size.
    """
    ddp = find_ddp(model)
    if ddp is None:
        return []
    params = [p for p in ddp.parameters() if p.requires_grad]
    wanted = ddp_bucket_sizes(ddp)
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    if getattr(ddp, "gradient_as_bucket_view", False):
        for grad in (p.grad for p in params if p.grad is not None):
            storage = grad.untyped_storage()
            if storage._cdata not in seen and storage.nbytes() in wanted:
                seen.add(storage._cdata)
                wanted.remove(storage.nbytes())
                found.append(grad)
    if not live or not wanted:
        return found
    known = set(collect_storages(params)) | set(collect_storages(p.grad for p in params)) | seen
    for key, storage in live.items():
        if key in known or storage.nbytes() not in wanted:
            continue
        wanted.remove(storage.nbytes())
        found.append(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
    return found


def expected_ddp_bucket_bytes(trainer: Any) -> int:
    """Bytes DDP's reducer will hold on this rank once ``trainer`` wraps its model (0 without DDP).

    For planning before ``train()``: the Trainer wraps the model in DDP when it runs one process per
    device without FSDP or DeepSpeed, and DDP's buckets hold every trainable parameter's gradient.
    """
    from transformers.training_args import ParallelMode

    args = getattr(trainer, "args", None)
    if args is None or not is_distributed() or args.parallel_mode != ParallelMode.DISTRIBUTED:
        return 0
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        return 0
    model = getattr(trainer, "model", None)
    if model is None:
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


# -- DeepSpeed ----------------------------------------------------------------------------------
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


# -- what an engine holds on a rank ---------------------------------------------------------------
class EngineStorages:
    """What a distributed engine holds on this rank, contributed to the rank's :class:`StepMonitor`.

    * DDP gradient buckets are gradients. Where a bucket storage cannot be reached (the reducer
      keeps it in C++) it enters the split as its size under a placeholder key — live bytes of the
      rank — and, on a tracked CPU step, is added to ``allocated`` and ``peak``, which the tracker
      cannot see before DDP first writes into the bucket. The CPU tracker counts a bucket it first
      sees in that write as alive since the window opened (``StorageTracker.resident_aliases``), so
      the window's peak counts it once. (Before: the bound ``peak + buckets`` was taken in that
      window, +4.1% and +17.2% over the profiler on step 1 of a 2-rank GPT-2 run with accumulation 2,
      8-bit AdamW resp. checkpointing.)
    * DDP rebuilds its buckets once, in the first forward after the first synchronized backward,
      when it does not look for unused parameters (the Trainer's choice under gradient
      checkpointing): the initial buckets are freed, new ones allocated in that forward (seen by the
      tracker). Its logging data lists the rebuilt sizes only from the next synchronized forward on;
      until then no placeholder is counted for the initial sizes (before: they were, +9.6% on that
      step), and the new buckets are ``other``.
    * DeepSpeed ZeRO partitions: see :func:`deepspeed_storages`. They are registered with the
      tracker at each tracked step (the fp32 master and ZeRO-3 gradient partitions are allocated at
      engine start, before tracking). Measured with DeepSpeed 0.19.8, ZeRO-1/2/3 on 2 gloo ranks:
      each class equals what DeepSpeed holds on the rank. Under DeepSpeed the optimizer step runs
      inside ``accelerator.backward`` (``engine.step()``), so the last micro-step's
      ``after_backward`` window contains the step and ``after_optimizer`` is an empty window.
    """

    def __init__(self, wrapped_model: Any = None) -> None:
        self.ddp = find_ddp(wrapped_model)
        self.unseen_bytes = 0

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
        held = {name: dict(shards[name]) for name in ("weights", "gradients", "optimizer_states")}
        self.unseen_bytes_before, self.unseen_bytes = self.unseen_bytes, 0
        if self.ddp is not None:
            self.unseen_bytes = self._add_buckets(held["gradients"], monitor)
        return held

    def _add_buckets(self, grads: dict[int, int], monitor: StepMonitor) -> int:
        """Put the DDP buckets into ``grads``; returns the bytes no tracked storage stands for."""
        assert self.ddp is not None
        tracker = getattr(monitor.backend, "tracker", None)
        if tracker is not None:
            tracker.resident_aliases = True
        if rebuilt_sizes_unlogged(self.ddp):
            return 0
        live = monitor.backend.live_storage_objects()
        found = collect_storages(ddp_gradient_buckets(self.ddp, live), monitor.device)
        grads.update(found)
        sizes = ddp_bucket_sizes(self.ddp)
        for nbytes in found.values():
            if nbytes in sizes:
                sizes.remove(nbytes)
        for index, nbytes in enumerate(sizes):
            grads[-(index + 1)] = nbytes  # placeholder key: storage keys are addresses, never < 0
        return sum(sizes)

    def adjust(self, record: dict[str, Any], monitor: StepMonitor, phase: str, window_peak: int | None) -> None:
        # Buckets the tracker had not seen when this window closed were alive all along. One first
        # seen inside the window (DDP's first write) the CPU tracker counted from the window's start
        # (``resident_aliases``); elsewhere the bound on the safe side is taken in that window.
        before = getattr(self, "unseen_bytes_before", 0)
        tracker = getattr(monitor.backend, "tracker", None)
        if tracker is not None and tracker.resident_aliases:
            unseen = self.unseen_bytes
        else:
            unseen = max(before, self.unseen_bytes) if phase != STEP_BEGIN else self.unseen_bytes
        if unseen and monitor.backend.live_storages() is not None and window_peak is not None:
            record["peak"] = max(record["peak"], window_peak + unseen)
            floor = record["allocated"]
            if monitor.previous_allocated is not None:
                floor = max(floor, monitor.previous_allocated)
            record["spike"] = max(0, record["peak"] - floor)


def rebuilt_sizes_unlogged(ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether DDP has rebuilt its buckets but its logging data still lists the initial sizes.

    ``_pre_forward`` updates the logging data (synchronized forwards only) *before* it rebuilds, so
    from the rebuild to the next synchronized forward the sizes read are those of freed buckets.
    """
    if not getattr(ddp, "_has_rebuilt_buckets", False):
        return False
    return not ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes")


def make_monitor(backend: Any, writer: Any, rank: int, trainer: Any = None) -> StepMonitor:
    """The monitor for this process; under DDP, DeepSpeed or FSDP2 it also counts what the engine holds."""
    monitor = StepMonitor(backend, writer, rank=rank)
    wrapped = getattr(trainer, "model_wrapped", None) if trainer is not None else None
    if find_ddp(wrapped) is not None or getattr(trainer, "is_deepspeed_enabled", False):
        monitor.add_contributor(EngineStorages(wrapped))
    elif groups := fsdp2_param_groups(wrapped):  # FSDP2: shards and all-gathers outside model.parameters()
        monitor.add_contributor(Fsdp2Storages(groups))
    held = held_models(trainer) if trainer is not None else {}
    if held:  # TRL's reference model, a teacher: frozen weights, shown apart
        monitor.add_contributor(HeldModels(held))
    return monitor
