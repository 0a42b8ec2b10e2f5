"""DeepSpeed ZeRO-1/2's gradient flow, replayed inside the step's backward on the fake model.

Under ZeRO-1/2 (``deepspeed/runtime/zero/stage_1_and_2.py``, fp32, ``contiguous_gradients`` on,
``overlap_comm`` off: DeepSpeed's defaults for these stages) a gradient never stays a ``.grad``
for long. A hook on each parameter (``register_post_accumulate_grad_hook``) copies it into the
*reduce bucket* (``torch.empty(reduce_bucket_size)``, allocated at the first gradient of every
backward) and frees it; when the bucket would overflow it is reduced and the gradients of the
parameters this rank owns are copied into ``grads_in_partition`` (one buffer of the numel of
every parameter that overlaps the rank's partition, allocated in full at the first reduction),
the others dropped (ZeRO-2). At the end of the backward (the epilogue) the rank's gradients are
kept across micro-steps (``all_grad_tensors``, views of that buffer; later micro-steps add theirs
into them), the bucket and the buffer's name are released and every ``.grad`` set to ``None``.

So a micro-step after the first holds, at its backward's high, the kept partition of the earlier
micro-steps *and* the new ``grads_in_partition`` once the first bucket was reduced *and* the bucket
— measured on 2 gloo ranks (test GPT-2, 590,336 fp32 parameters, buckets of 100,000 elements, 4 x
2 with checkpointing, ``tests/engines/test_deepspeed_zero.py``): two 1,305,600 B buffers (326,400 elements:
rank 0's parameters overlapping its partition) and the 400,000 B bucket live in the second
micro-step's backward, where dividing the single-process gradients by 2 counted 1,180,672 B. When
the high is at the backward's start (no checkpointing: the loss's gradients), the new buffer does
not exist yet. Which of the two a step meets depends on the order gradients arrive in, so the
flow is replayed, not added: :class:`ZeroGradientFlow` hooks the fake model's parameters and does
what DeepSpeed does, on fake tensors the estimate's tracker counts.

ZeRO-1 sets up the bucket at every backward's first gradient too (``process_gradients``; measured:
gradients 2,761,344 B after the first micro-step = the whole ``.grad`` + the 400,000 B bucket) but
keeps whole ``.grad`` between micro-steps and reduces them only at the boundary, after the
backward (``reduce_gradients``), through the same bucket into the same buffer.

The replay's micro-step after the first starts with every ``.grad`` resident (the earlier
micro-steps'); at the model's forward the flow turns them into what ZeRO keeps: ZeRO-2 the kept
partition (the rank's own on live ranks, else each rank's in turn, the estimate the highest:
:func:`planned_partition`; 329,472 elements on rank 1 of the run above), ZeRO-1 the whole ``.grad`` and the earlier backward's bucket. The
replayed micro-step is the step's last (the boundary). With the flow, the estimate divides no
gradient class and adds no bucket (:func:`~hf_memwatch.engines.zero.split.engine_classes`); the
optimizer step holds the kept partition and its flat fp32 copy (:mod:`~hf_memwatch.engines.zero.step`).
Measured against MemWatch on the 2-rank runs: ZeRO-1 4 x 2 predicted 14,734,232 B, measured
14,735,268; ZeRO-2 4 x 2 13,290,776 vs 13,279,524 / 13,291,812 (ranks 0 / 1); 1 x 8 + checkpointing
10,741,772 vs 10,734,116 / 10,746,404 (the branch that frees first; gloo's race below). Each reduction's
flat copy (``torch.cat`` of the bucket's slices, :func:`flat_copies`) or, for a one-slice chunk, the bucket
may outlive it, held by gloo's worker threads: the worst branch keeps the last two collectives' tensors
until more are issued, across an earlier micro-step's end into the next forward (:meth:`ZeroGradientFlow._issued`;
the earlier micro-step replayed as it runs), so the plan covers the run-to-run spread it makes; NCCL's
ranks meet no such race.
Not modelled: ``overlap_comm`` (a second bucket),
``contiguous_gradients: false``, ``round_robin_gradients``, 16-bit ZeRO and offload (other paths).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...compat.torch_internals import (
    autograd_engine_replayable,
    current_dispatch_modes,
    queue_backward_callback,
)
from ...estimation.branches import earlier_micro_step_wanted, last_micro_step, race_held, report_race
from ...estimation.classify import refs
from ...estimation.fake_dispatch import EstimateTracker
from ...estimation.optim import param_groups
from ..gloo_staging import HELD_WORKS, gloo_ranks

# The parameters' dtypes the flow replays: fp32, and bf16 where DeepSpeed cast the module (:mod:`.half`).
FLOW_DTYPES = (torch.float32, torch.bfloat16)
# DeepSpeed's default ``reduce_bucket_size`` (elements) when the JSON leaves it out.
DEFAULT_REDUCE_BUCKET = 500_000_000


@dataclass(frozen=True)
class RankPartition:
    """The parameters whose gradients one rank keeps under ZeRO-1/2, and their elements."""

    rank: int
    kept: tuple[torch.nn.Parameter, ...]
    numel: int


def rank_partition(groups: list[list[torch.nn.Parameter]], world_size: int, rank: int) -> RankPartition:
    """``params_in_partition`` of ``rank`` (``get_partition_info``): each group flattened, padded to a
    multiple of 2 x world size, cut in equal partitions; a parameter overlapping the rank's range is kept whole.

    Example:
        >>> a, b = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(5))
        >>> rank_partition([[a, b]], 2, 0).numel, rank_partition([[a, b]], 2, 1).numel  # partitions of 6: b straddles
        (10, 5)
    """
    kept: list[torch.nn.Parameter] = []
    for group in groups:
        total = sum(p.numel() for p in group)
        align = 2 * world_size
        size = -(-total // align) * align // world_size
        start, end, index = size * rank, size * (rank + 1), 0
        for param in group:
            if start <= index < end or index < start < index + param.numel():
                kept.append(param)
            index += param.numel()
    return RankPartition(rank, tuple(kept), sum(p.numel() for p in kept))


def _groups(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """The optimizer's parameter groups DeepSpeed flattens (the non-empty ones)."""
    return [list(group["params"]) for group in param_groups(model) if group["params"]]


def widest_partition(model: torch.nn.Module, world_size: int) -> RankPartition:
    """The rank that keeps the most gradient elements (a rank unknown plans for it)."""
    groups = _groups(model)
    return max((rank_partition(groups, world_size, rank) for rank in range(world_size)), key=lambda r: r.numel)


def live_rank(world_size: int) -> int | None:
    """This process's rank where the run's ``world_size`` ranks are live (None: they are not)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size:
        return dist.get_rank()
    return None


def planned_partition(model: torch.nn.Module, world_size: int) -> RankPartition:
    """The partition the estimate replays: this rank's own where the run's ranks are live (each rank's estimate
    is its own; the auto mode's agreement plans for the rank that must cut most), else the rank of
    :func:`replaying_rank` (the estimate replays each rank of a layout asked for without its ranks, the CLI's,
    and keeps the highest: :data:`MAX_RANKS_REPLAYED`), else the widest (:func:`widest_partition`). The ranks'
    figures differ by the gradients each keeps and by when its buffer is made: the two-rank sweep's seed 2 (OPT,
    ZeRO-2, bf16) keeps 97,344 elements on rank 0 and 66,112 on rank 1, whose profiler peak is 62,464 B
    (31,232 x 2 B) under rank 0's (planned for rank 0's partition, rank 1's estimate read +3.13%); seed 28
    (Phi, ZeRO-2 with the optimizer offloaded) keeps fewer on rank 1, which peaks 13% higher (its kept
    parameters' gradients arrive first in the backward), so the widest partition is not the highest rank."""
    rank = live_rank(world_size)
    if rank is None:
        rank = _REPLAYED_RANK.get()
    if rank is not None and rank < world_size:
        return rank_partition(_groups(model), world_size, rank)
    return widest_partition(model, world_size)


# Ranks replayed one by one where none is live (the widest partition alone beyond): each replay is a whole
# step's, so the estimate's cost grows with the count.
MAX_RANKS_REPLAYED = 8
_REPLAYED_RANK: contextvars.ContextVar[int | None] = contextvars.ContextVar("hf_memwatch_zero_rank", default=None)


@contextlib.contextmanager
def replaying_rank(rank: int | None) -> Iterator[None]:
    """Within, :func:`planned_partition` is ``rank``'s where no rank is live (None: as without)."""
    token = _REPLAYED_RANK.set(rank)
    try:
        yield
    finally:
        _REPLAYED_RANK.reset(token)


def replayed_ranks(engine: Any, model: torch.nn.Module, precision: str) -> list[int | None]:
    """The ranks an estimate replays one by one: every rank of a ZeRO-1/2 flow whose ranks are not live, up
    to :data:`MAX_RANKS_REPLAYED`; else ``[None]`` (the live rank's own, or the widest)."""
    if engine is None or not flow_applies(engine, model, precision) or live_rank(engine.world_size) is not None:
        return [None]
    return list(range(engine.world_size)) if engine.world_size <= MAX_RANKS_REPLAYED else [None]


def flow_applies(engine: Any, model: torch.nn.Module, precision: str = "fp32") -> bool:
    """Whether :class:`ZeroGradientFlow` replays this engine: DeepSpeed ZeRO-1/2 over 2+ ranks, trainable
    parameters of one dtype (fp32, or bf16: DeepSpeed's bf16 replays the module cast, ``precision`` fp32:
    :mod:`.half`), the Trainer's optimizer, no offload or ZeRO-2's optimizer offload (:class:`ZeroGradientFlow`)."""
    if engine is None or engine.kind != "deepspeed" or engine.zero_stage not in (1, 2) or engine.world_size < 2:
        return False
    if engine.engine_optimizer or precision in ("bf16", "fp16"):
        return False
    if engine.offload != "none" and (engine.offload_optimizer == "none" or engine.zero_stage != 2):
        return False  # ZeRO-2 with the optimizer offloaded is replayed (its host path); ZeRO-1's is not
    if engine.offload_optimizer != "none" and engine.cpu_optimizer:
        return False  # accelerate's DeepSpeedCPUAdam: the rules
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not (bool(trainable) and len({p.dtype for p in trainable}) == 1 and trainable[0].dtype in FLOW_DTYPES):
        return False
    return autograd_engine_replayable()  # the backward's epilogue (probed, warned once)


class ZeroGradientFlow:
    """The context that replays ZeRO-1/2's gradient handling on ``model``'s backward (see the module doc).

    ZeRO-2 with the optimizer offloaded (``stage_1_and_2.py``, ``cpu_offload``; contiguous gradients forced)
    fills and reduces the same bucket, but keeps no ``grads_in_partition``: at the boundary each kept
    gradient's slice in the rank's partition is cast to fp64 for its norm (``set_norm_for_param_grad_in_gpu``,
    ``get_norm_dtype()``: a transient of the slice's elements x 8 B, its scalar kept), checked for inf/nan
    and copied into the host fp32 gradient partition (resident, :func:`~.split.engine_classes`), then
    dropped; a gradient larger than the bucket is cloned first (``_offload_gradient_safety_enabled``). With
    accumulation each earlier micro-step copied its kept gradients into ``accumulated_grads_in_cpu`` (a
    buffer of each kept parameter's elements, made once and kept) and the boundary adds them back in place
    through the staging buffer. Measured on 2 gloo ranks (the two-rank sweep's ZeRO-2 + offload draws,
    ``benchmarks/results/sweep.md``): MemWatch's peak tensors at the step's high are the embedding's
    64,000-element fp64 norm copy, the 100,000-element bucket, the 16-bit host buffer, the fp32 master and
    gradient partitions and the two staging buffers; the rules that stood in for this flow read -4.0..-8.0%.
    """

    def __init__(self, model: torch.nn.Module, engine: Any, gloo: bool = True) -> None:
        self.model, self.stage, self.gloo = model, engine.zero_stage, gloo
        self.partition = planned_partition(model, engine.world_size)
        self.keep = {id(p) for p in self.partition.kept}
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.bucket_numel = int(engine.reduce_bucket_size or DEFAULT_REDUCE_BUCKET)
        self.bucket: torch.Tensor | None = None
        self.filled = 0
        self.pending: list[torch.nn.Parameter] = []
        self.buffer: torch.Tensor | None = None  # grads_in_partition
        self.world_size = engine.world_size
        self.spans = _partition_spans(self.params, model, engine.world_size)
        self.work_held: list[torch.Tensor] = []  # the last collectives' tensors gloo's workers hold (a race)
        self.multi_rank = engine.multi_rank_bucket_allreduce  # one all-reduce per bucket (flat_copies)
        self.largest_copy = 0  # bytes of the largest block a collective holds in the race's worst branch
        self.offset = 0
        self.accumulated: torch.Tensor | None = None  # all_grad_tensors: the kept partition across micro-steps
        self.started = False  # a backward is running (its bucket set up)
        self.offload = engine.offload_optimizer != "none"  # ZeRO-2's host path (see the class doc)
        self.offload_accumulated: torch.Tensor | None = None  # accumulated_grads_in_cpu, kept across steps
        self.norms: list[torch.Tensor] = []  # norm_for_param_grads: one fp64 scalar per kept parameter
        self._handles: list[Any] = []
        self._earlier = contextlib.ExitStack()

    def __enter__(self) -> ZeroGradientFlow:
        self._handles = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self.params]
        self._handles.append(self.model.register_forward_pre_hook(self._on_forward))
        if self.stage == 2 and not self.offload and self.gloo and race_held():  # the works an earlier backward leaves (_issued)
            self._earlier.enter_context(earlier_micro_step_wanted())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._earlier.close()
        for handle in self._handles:
            handle.remove()
        if self.largest_copy:  # the race of :meth:`_issued`
            report_race(f"zero{self.stage}: each reduction's flat copy or bucket (up to {self.largest_copy:,} "
                        f"bytes), which gloo's thread lets go after or before the training thread's next allocations")
        self._handles, self.work_held = [], []
        self.bucket = self.buffer = self.accumulated = self.offload_accumulated = None
        self.pending, self.started, self.norms = [], False, []

    def _on_forward(self, *_: Any) -> None:
        """A micro-step begins: gradients left resident by the earlier ones become what ZeRO keeps —
        ZeRO-2 the kept partition; ZeRO-1 the whole ``.grad`` and the bucket of the earlier backward
        (it releases the bucket only at the boundary's reduction)."""
        if all(p.grad is None for p in self.params):
            return
        ref = self.params[0]
        if self.offload:  # the earlier micro-steps' kept gradients went to the host buffers, .grad cleared
            for param in self.params:
                param.grad = None
            if self.offload_accumulated is None:
                self.offload_accumulated = _held(torch.empty(sum(p.numel() for p in self.partition.kept),
                                                             dtype=ref.dtype, device=ref.device))
            _restart_high()
            return
        if self.stage == 1:
            for param in self.params:  # gradients while they live, though not .grad when the phase closes
                if param.grad is not None:
                    _held(param.grad)
            if self.bucket is None:
                self.bucket = _held(torch.empty(self.bucket_numel, dtype=ref.dtype, device=ref.device))
            return
        if self.accumulated is None:
            for param in self.params:
                param.grad = None
            self.accumulated = _held(torch.empty(self.partition.numel, dtype=ref.dtype, device=ref.device))
            _restart_high()  # the whole .grad resident a moment ago never coexisted with the partition

    def _on_gradient(self, param: torch.nn.Parameter) -> None:
        """The hook: ``setup_buckets`` at the backward's first gradient; ZeRO-2 reduces through the bucket
        (``reduce_independent_p_g_buckets_and_remove_grads``), ZeRO-1 only at the boundary, after the backward."""
        if not self.started:
            self.started = True
            self.bucket = None  # bucket.buffer.clear(), then a new one
            self.bucket = _held(torch.empty(self.bucket_numel, dtype=param.dtype, device=param.device))
            queue_backward_callback(self._epilogue)
        if self.stage == 2:
            self._into_bucket(param)

    def _into_bucket(self, param: torch.nn.Parameter) -> None:
        numel = param.numel()
        if self.filled + numel > self.bucket_numel:
            self._reduce()
        if numel > self.bucket_numel and self.offload:  # reduced from a clone of its own gradient
            param.grad = param.grad.detach().clone(memory_format=torch.contiguous_format)
        if numel <= self.bucket_numel:  # larger ones are reduced from their own gradient
            view = self.bucket.narrow(0, self.filled, numel)
            view.copy_(param.grad.reshape(-1))
            param.grad = view.view_as(param)
        self.pending.append(param)
        self.filled += numel

    def _reduce(self) -> None:
        """``reduce_ipg_grads``: the rank's gradients into ``grads_in_partition``, ZeRO-2 drops the others;
        each collective's flat copy or bucket may outlive it (see :meth:`_issued`)."""
        for copy in chunk_copies(self.pending, self.spans, self.world_size, self.bucket_numel, self.multi_rank):
            ref = self.pending[0]
            if copy:  # made for the all-reduce either way (torch.cat of the chunk's slices)
                self._issued(torch.empty(copy, dtype=ref.dtype, device=ref.device))
            elif self.bucket is not None and ref.numel() <= self.bucket_numel:  # the slice's view: the bucket
                self._issued(self.bucket)
            elif ref.grad is not None:  # a parameter larger than the bucket, reduced from its own gradient
                self._issued(ref.grad)
        for param in self.pending:
            if param.grad is None:
                continue
            if id(param) in self.keep and self.offload:
                self._to_host(param)
            elif id(param) in self.keep:
                if self.buffer is None:
                    self.buffer = _held(torch.empty(self.partition.numel, dtype=param.dtype, device=param.device))
                    self.offset = 0
                view = self.buffer.narrow(0, self.offset, param.numel())
                view.copy_(param.grad.reshape(-1))
                param.grad = view.view_as(param)
                self.offset += param.numel()
            elif self.stage == 2:
                param.grad = None
        self.pending, self.filled = [], 0

    def _issued(self, tensor: torch.Tensor) -> None:
        """A collective issued on ``tensor`` (DeepSpeed's ``allreduce_bucket``: the chunk's flat copy, else the
        slice's view of the bucket or of a larger parameter's gradient). Its gloo work holds it until the worker
        that ran it takes the next (``ProcessGroupGloo::runLoop``, as under FSDP2:
        :meth:`~hf_memwatch.engines.fsdp2.replay.Fsdp2Flow._issued`): the worst branch (:func:`race_held`) keeps
        the last :data:`~hf_memwatch.engines.gloo_staging.HELD_WORKS` collectives' tensors alive until more are
        issued — across an earlier micro-step's end into the next one's forward, where no collective runs
        between (the step's last lets them go at its end: the gradient norm's all-reduce follows; not replayed
        past it). Measured on the two-rank sweep's seed 2 (``benchmarks/results/sweep.md``, OPT, ZeRO-2 bf16,
        accumulation 2, buckets of 100,000 elements): rank 0 peaked at 2,114,756 B in 1 of 3 launches, the
        replay's forward high 1,913,728 B + the 200,000 B bf16 bucket, a view of which the earlier micro-step's
        last all-reduce held (its last chunk one slice). Before: the largest flat copy alone, until the
        backward's end (-3.50% under that launch)."""
        if not self.gloo:  # NCCL: the training thread's wait releases the work's tensors (no race)
            return
        self.largest_copy = max(self.largest_copy, tensor.untyped_storage().nbytes())
        self.work_held = [*self.work_held, tensor][-HELD_WORKS:] if race_held() else []

    def _to_host(self, param: torch.nn.Parameter) -> None:
        """``copy_grads_in_partition`` under offload at the boundary: the norm of the rank's slice in fp64,
        the inf/nan check (``has_inf_or_nan``), the copy into the host fp32 partition (resident), dropped."""
        index, size = self.spans[id(param)]
        rank = self.partition.rank
        low, high = max(index, rank * size), min(index + param.numel(), (rank + 1) * size)
        flat = param.grad.reshape(-1)
        if high > low:
            self.norms.append(flat.narrow(0, low - index, high - low).to(torch.float64).norm(2))
        torch.isfinite(flat.amax()).logical_and(torch.isfinite(flat.amin())).logical_not()
        param.grad = None

    def _epilogue(self) -> None:
        """The backward's end (``independent_gradient_partition_epilogue``; ZeRO-1 first reduces every
        gradient, ``reduce_gradients``): keep the rank's gradients, release the rest."""
        self.started = False
        if self.stage == 1:
            for param in self.params:
                if param.grad is not None:
                    self._into_bucket(param)
        self._reduce()
        if self.buffer is not None:
            if self.accumulated is None:
                self.accumulated = self.buffer
            else:
                self.accumulated.add_(self.buffer)
        self.bucket = self.buffer = None
        for param in self.params:
            param.grad = None
        if last_micro_step():
            # The step's last: DeepSpeed flattens the kept partition for its optimizer step (engines/zero/step.py
            # counts both there) and frees it; its gradient norm's all-reduce comes next (:meth:`_issued`).
            self.accumulated = None
            self.work_held = []


def _partition_spans(params: list[torch.nn.Parameter], model: torch.nn.Module,
                     world_size: int) -> dict[int, tuple[int, int]]:
    """Per trainable parameter: its element offset in its group's flat buffer and the group's
    partition size (:func:`rank_partition`'s layout)."""
    spans: dict[int, tuple[int, int]] = {}
    for group in param_groups(model):
        members = [p for p in group["params"] if p.requires_grad]
        total = sum(p.numel() for p in members)
        align = 2 * world_size
        size = -(-total // align) * align // world_size
        index = 0
        for param in members:
            spans[id(param)] = (index, size)
            index += param.numel()
    return {key: spans[key] for key in map(id, params) if key in spans}


def _slices(pending: list[torch.nn.Parameter], spans: dict[int, tuple[int, int]],
            world_size: int) -> list[tuple[int, int]]:
    """``(elements, destination rank)`` of each slice ``average_tensor`` reduces, in the bucket's order,
    consecutive slices of one destination merged as DeepSpeed merges them."""
    out: list[tuple[int, int]] = []
    for param in pending:
        if id(param) not in spans:
            continue
        offset, size = spans[id(param)]
        for rank in range(world_size):
            low, high = max(offset, rank * size), min(offset + param.numel(), (rank + 1) * size)
            if high <= low:
                continue
            if out and out[-1][1] == rank:
                out[-1] = (out[-1][0] + high - low, rank)
            else:
                out.append((high - low, rank))
    return out


def flat_copies(pending: list[torch.nn.Parameter], spans: dict[int, tuple[int, int]], world_size: int,
                bucket_numel: int, multi_rank: bool = True) -> list[int]:
    """Elements of each flat copy DeepSpeed makes to reduce one bucket (``allreduce_bucket``'s flatten).

    With ``use_multi_rank_bucket_allreduce`` (DeepSpeed 0.19's default) every slice of the bucket goes
    into one all-reduce (``allreduce_and_scatter``), else each destination's slices into one reduce
    (``allreduce_no_retain``); either cuts its list into chunks, closing one where the elements
    gathered pass ``reduce_bucket_size``, and flattens each chunk: ``torch.cat`` of its slices, or no
    copy for a chunk of one slice (``flatten_dense_tensors`` returns that slice's view). Gloo's work
    object holds the copy too, and its worker thread drops it after the training thread went on: the
    block is freed a moment later, at a time that depends on how the threads are scheduled (a race).
    Measured on 2 gloo ranks (the two-rank sweep's seed 12: Qwen2, ZeRO-2 with the optimizer
    offloaded, buckets of 100,000 elements; ``benchmarks/results/sweep.md``): rank 1's step-2 peak was
    3,120,740 B in one launch and 3,508,836 B in two — 388,096 B, the 97,024-element ``aten.cat`` of
    the reduction before the high (the embedding's 64,000 elements and the layer's: 14,464 for rank 0,
    82,560 for rank 1), still held at the high (MemWatch's peak tensors). The worst branch keeps the
    last two collectives' tensors (:meth:`ZeroGradientFlow._issued`), which the plan covers; a direct
    estimate replays the other too (:func:`~hf_memwatch.estimation.branches.races`).
    (Before: the largest destination's slices alone, 82,560 elements: 1.68% under that launch.)

    Example:
        >>> a, b = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(5))
        >>> spans = {id(a): (0, 6), id(b): (5, 6)}  # b straddles the partition boundary at 6
        >>> flat_copies([a, b], spans, 2, bucket_numel=100)  # one all-reduce of the slices 6 + 4
        [10]
        >>> flat_copies([a, b], spans, 2, bucket_numel=100, multi_rank=False)  # each rank's slices: one view
        []
        >>> flat_copies([a, b], spans, 2, bucket_numel=8)  # 6 + 4 passes 8: one chunk of both
        [10]
    """
    return [n for n in chunk_copies(pending, spans, world_size, bucket_numel, multi_rank) if n > 0]


def chunk_copies(pending: list[torch.nn.Parameter], spans: dict[int, tuple[int, int]], world_size: int,
                 bucket_numel: int, multi_rank: bool = True) -> list[int]:
    """One entry per collective DeepSpeed issues to reduce one bucket, in order: the elements of its flat
    copy, 0 where its chunk is one slice (the collective runs on that slice's view: :func:`flat_copies`).

    Example:
        >>> a, b = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(5))
        >>> chunk_copies([a, b], {id(a): (0, 6), id(b): (5, 6)}, 2, bucket_numel=100, multi_rank=False)
        [0, 0]
    """
    slices = _slices(pending, spans, world_size)
    lists = [[n for n, _ in slices]] if multi_rank else [
        [n for n, rank in slices if rank == dst] for dst in dict.fromkeys(rank for _, rank in slices)]
    copies: list[int] = []
    for numels in lists:
        total, count = 0, 0  # the chunk being gathered (DeepSpeed's ``numel`` and ``small_bucket``)
        for numel in numels:
            total, count = total + numel, count + 1
            if total > bucket_numel:
                copies.append(total if count > 1 else 0)
                total, count = 0, 0
        if count:
            copies.append(total if count > 1 else 0)
    return copies


def _trackers() -> list[EstimateTracker]:
    return [mode for mode in current_dispatch_modes() if isinstance(mode, EstimateTracker)]


def _restart_high() -> None:
    """Restart the estimate tracker's phase high at the live set now."""
    for tracker in _trackers():
        tracker.reset_peak()


def _held(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, counted as gradients while it lives (the estimate tracker's ``engine_gradients``)."""
    for tracker in _trackers():
        tracker.engine_gradients.update(refs(tracker, [tensor]))
    return tensor


def zero_gradient_flow(model: torch.nn.Module, engine: Any, precision: str = "fp32", device: str = "cpu") -> Any:
    """A :class:`ZeroGradientFlow` where :func:`flow_applies`, else a context that does nothing (``device``:
    the ranks', whose collectives are gloo's or NCCL's: :func:`~hf_memwatch.engines.gloo_staging.gloo_ranks`)."""
    if not flow_applies(engine, model, precision):
        return contextlib.nullcontext()
    return ZeroGradientFlow(model, engine, gloo_ranks(device))
