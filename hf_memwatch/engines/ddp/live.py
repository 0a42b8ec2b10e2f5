"""DDP on a live rank: the reducer's flat gradient buckets, contributed to the rank's monitor.

* :func:`ddp_bucket_sizes`, :func:`ddp_gradient_buckets` — DDP's reducer keeps its own flat
  gradient buckets (as large as the gradients with the default ``gradient_as_bucket_view=False``);
  they are gradients.
* :class:`DdpBuckets` — what the reducer holds, contributed to the rank's :class:`~hf_memwatch.measure.monitor.StepMonitor`.

FSDP2 parameters, gradients and optimizer states are ``DTensor`` s whose local shard is what
:func:`~hf_memwatch.measure.storage.plain_tensors` unwraps (measured with ``fully_shard`` on gloo: each
of 2 ranks holds half); what ``model.parameters()`` does not show while a module is unsharded (its
shards, the all-gathered parameters, FSDP2's kept all-gather and reduce-scatter buffers) is counted by
:class:`~hf_memwatch.engines.fsdp2.live.Fsdp2Storages`. FSDP2 frees its all-gathered parameters with
``UntypedStorage.resize_(0)``: the storage tracker and the saved-tensor registry read sizes when
asked (``StorageTracker.watch_resizes``, ``SavedTensorRegistry.storages``). FSDP1 parameters are views
of the rank's flat shard (not run here). DeepSpeed ZeRO's partitions: :mod:`hf_memwatch.engines.zero.live`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...compat.ddp import ddp_logging_data, has_rebuilt_buckets
from ...compat.torch_internals import storage_key
from ...core.categories import STEP_BEGIN
from ...core.records import Snapshot
from ...measure.attribution import spike_above
from ...measure.monitor import StepMonitor
from ...measure.ranks import is_distributed
from ...measure.storage import collect_storages


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
    data = ddp_logging_data(ddp)
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
    parameters or gradients. Buckets not found are counted by :class:`DdpBuckets` by size.
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
            if storage_key(storage) not in seen and storage.nbytes() in wanted:
                seen.add(storage_key(storage))
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


# -- what the reducer holds on a rank ---------------------------------------------------------------
class DdpBuckets:
    """What DDP's reducer holds on this rank, contributed to the rank's :class:`StepMonitor`.

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
    """

    def __init__(self, wrapped_model: Any = None) -> None:
        self.ddp = find_ddp(wrapped_model)
        self.unseen_bytes = 0

    def known_tensors(self, monitor: StepMonitor) -> list[torch.Tensor | None]:
        return []  # the buckets are allocated when the model is wrapped: found in the live storages

    def class_storages(self, monitor: StepMonitor) -> dict[str, dict[int, int]]:
        held: dict[str, dict[int, int]] = {"weights": {}, "gradients": {}, "optimizer_states": {}}
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

    def adjust(self, record: Snapshot, monitor: StepMonitor, phase: str, window_peak: int | None) -> None:
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
            record.peak = max(record.peak, window_peak + unseen)
            record.spike = spike_above(record.peak, record.allocated, monitor.previous_allocated)


def rebuilt_sizes_unlogged(ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether DDP has rebuilt its buckets but its logging data still lists the initial sizes.

    ``_pre_forward`` updates the logging data (synchronized forwards only) *before* it rebuilds, so
    from the rebuild to the next synchronized forward the sizes read are those of freed buckets.
    """
    if not has_rebuilt_buckets(ddp):
        return False
    return not ddp_logging_data(ddp).get("rebuilt_bucket_sizes")
