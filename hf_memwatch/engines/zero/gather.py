"""ZeRO-3's gathering in the forward on CPU ranks (gloo): what DeepSpeed's coordinator holds at each module.

DeepSpeed 0.19.8's ``PartitionedParameterCoordinator`` (``partitioned_param_coordinator.py``), once the first
forward and backward recorded the trace of module calls, runs at every module's pre-forward (containers
included): the module's own parameters not yet gathered are all-gathered as one coalesced bucket, each of its
parameters in flight is waited, then the next parameters of the trace are prefetched as one more bucket of at
least ``stage3_prefetch_bucket_size`` elements (``_fetch_sub_module_impl``), so the prefetch runs ahead one
bucket per module call. A bucket (``_all_gather_dtype``, ``AllGatherCoalescedHandle``) is one flat output
(every parameter padded to a multiple of the ranks); its first wait copies every parameter of the bucket out
of it (``torch.cat``: the gathered parameter is a new tensor), and the flat output lives while any of its
parameters is still in the coordinator's registry, i.e. until the module of its last parameter is fetched.
Under gloo the worker thread gathers into a staging copy of the whole output while the collective runs
(:mod:`hf_memwatch.engines.gloo_staging`), at most two at once (its default two worker threads).

:class:`ForwardGathering` replays that over the forward's module calls (the estimate's forward split at each
module's pre-forward: ``phase_windows``), and :func:`zero3_forward_gathering` sets the forward's high at the
highest window: the replay's classes there, with the gathered parameters, flat outputs and staging copies
that window holds in place of the whole model gathered. Measured on 2 gloo ranks (the sweep's seed 45: a
StableLM of 3 layers in bf16, prefetch bucket 100,000 elements, ZeRO-3 + offload, step 2, rank 0): DeepSpeed
issued two all-gathers a forward, 101,120 and 138,368 elements, both before ``embed_tokens`` ran; MemWatch's census
at the step's high (3,599,400 B, in layer 0's attention) held the first bucket's copies (202,240 B) and flat output
(202,240 B), the second's flat output (276,736 B) and 285,184 B of staging copies. The estimate now reads
3,605,272 B against reconciled truths of 3,556,457..3,617,577 B over five launches, where the rule it replaces
(every parameter gathered, two staging copies of the largest leaf module plus the prefetch bucket) read
3,730,392 B (+3.1..+4.9%); the sweep's 12 ZeRO-3 draws read -0.50..+0.60% (``benchmarks/results/sweep.md``). The
test launch checks the replay's buckets against the all-gathers DeepSpeed issued
(``tests/engines/test_deepspeed_zero.py``). The backward gathers nothing (every parameter stays gathered to the
end of the forward, DeepSpeed's default reuse distance). The first forward, which records the trace (one
module's parameters at a time, no prefetch), is not modelled: the steady state's buckets hold more. Not replayed
either: a race of gloo's worker, which still holds a finished work (its output) after the training thread let
go of it. On the test GPT-2 at 1 x 8 + checkpointing, 32 tokens (2 launches of 2 ranks, 2026-12-06) the
forward's high ranged 10,141,785..10,568,605 B (reconciled; MemWatch's live peaks up to 10,655,580 B, whose
census held one bucket's flat output, 459,776 B, past its last parameter's wait); the estimate, 10,441,044 B,
lies inside (the rule it replaces: 10,491,284 B); + offload: 11,322,453..11,749,273 B against 11,621,716 B. Every layer is replayed (a line through two short depths keeps no window). Where the windows are
not at hand (depth extrapolation asked for) or the settings release parameters in the forward
(``stage3_max_live_parameters`` or ``stage3_max_reuse_distance`` under the model's size), the bound of
:func:`gloo_gather_staging` stays; with a peak census (``top_tensors``) the figure is the replay's and the
tensors are not listed.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch

from ...core.categories import AFTER_FORWARD, STEP_END
from ...estimation.classify import MODULE_WINDOW
from ..engine import ZERO_DEFAULTS
from .split import zero3_gathered_bytes

GLOO_THREADS = 2  # ProcessGroupGloo's default worker threads: collectives running at once


def gather_bound(model: torch.nn.Module, engine: Any) -> int:
    """Bytes of one coalesced ZeRO-3 all-gather at most: the largest leaf module's parameters plus
    the prefetch bucket, never above the model.

    Example:
        >>> from hf_memwatch.engines.engine import Engine
        >>> zero3 = Engine(kind="deepspeed", world_size=2, zero_stage=3, prefetch_bucket_size=10)
        >>> gather_bound(torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2)), zero3)
        480
    """
    params = list(model.parameters())
    full = sum(p.numel() * p.element_size() for p in params)
    size = params[0].element_size() if params else 4
    leaf = max((sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                for m in model.modules() if not list(m.children())), default=0)
    prefetch = int(engine.prefetch_bucket_size or 0) * size
    return min(full, leaf + prefetch)


def gloo_gather_staging(per_phase: dict[str, dict[str, int]], model: torch.nn.Module, engine: Any, device: str,
                        notes: list[str]) -> dict[str, dict[str, int]]:
    """``per_phase`` with, on ZeRO-3 CPU ranks (gloo), the forward's gathering moment by a bound: the
    resident set of the step's end, the parameters gathered and the staging copies of two all-gathers in
    flight, each bounded by the largest leaf module plus the prefetch bucket (temporaries), where that is
    above the forward's high. Other engines and devices: unchanged. Used where the forward's windows are
    not replayed (:func:`zero3_forward_gathering`).

    Measured on 2 gloo ranks (DeepSpeed 0.19.8, test GPT-2, prefetch bucket 100,000 elements, 1 x 8 +
    checkpointing, step 2, rank 0): gathers of 1,024 to 594,944 B; at the profiler's peak (10,568,605 B,
    reconciled; in the forward) copies of 594,944 and 528,896 B were alive; without them the step's high was
    the backward's (10,131,624 B); the bound here is the embedding, 512,000 B, + 400,000 B. The gathers run
    before the forward's activations accumulate: the configured run (4 x 2, no checkpointing) peaked in its
    backward (14,735,272 B) with the copies counted, where adding them to the forward's high predicted
    16,048,316 B (+8.9%).
    """
    if engine is None or engine.kind != "deepspeed" or engine.zero_stage != 3 or engine.world_size < 2 \
            or device != "cpu" or AFTER_FORWARD not in per_phase or STEP_END not in per_phase:
        return per_phase
    staging = GLOO_THREADS * gather_bound(model, engine)
    gathering = {**per_phase[STEP_END]}
    gathering["weights"] += zero3_gathered_bytes(model, engine)
    gathering["temporaries"] = gathering.get("temporaries", 0) + staging
    notes.append(f"zero3 on gloo: the forward's gathering bounded (its module calls not replayed): every parameter "
                 f"gathered and {staging} bytes of flat copies gloo stages for {GLOO_THREADS} all-gathers in flight")
    if sum(gathering.values()) <= sum(per_phase[AFTER_FORWARD].values()):
        return per_phase
    return {**per_phase, AFTER_FORWARD: gathering}


@dataclass(frozen=True)
class GatherMoment:
    """What ZeRO-3's gathering holds at most through one window of the forward (from a module's pre-forward
    to the next module's): the gathered parameters' bytes, the flat outputs still held and the staging
    copies of the all-gathers that may be running on gloo's workers."""

    copies: int
    flats: int
    staging: int

    @property
    def total(self) -> int:
        return self.copies + self.flats + self.staging


class _Bucket:
    """One coalesced all-gather: its parameters, its flat output's bytes, its parameters still in the
    registry, whether it was waited (its parameters copied out)."""

    def __init__(self, params: list[int], flat: int) -> None:
        self.params, self.flat, self.pending, self.waited = params, flat, len(params), False
        # one parameter: gathered into its own buffer, which becomes its data (``_all_gather_sequential``)
        self.single = len(params) == 1


class ForwardGathering:
    """DeepSpeed's coordinator over one forward with a complete trace (the module doc), on sizes alone.

    ``numel``/``itemsize``: per parameter index; ``persistent``: the indices gathered for good at the
    engine's start (``stage3_param_persistence_threshold``); ``staging_slots``: all-gathers whose staging copy
    may be alive at once (gloo's workers; 0 without one). Nothing is released in the forward: for settings
    whose reuse distance and live limit cover the model.

    A bucket of one parameter is gathered into a buffer that becomes the parameter's data (nothing copied).

    Example (two 100-element parameters, then one of 300, a bucket of 150 elements, 2 ranks, fp32):
        >>> gathering = ForwardGathering([100, 100, 300], [4, 4, 4], set(), world_size=2, bucket=150,
        ...                              max_live=10**9, staging_slots=2)
        >>> [m.total for m in gathering.moments([[], [0], [1], [2]])]   # a root, then a module a parameter
        [1600, 4000, 3200, 2000]
    """

    def __init__(self, numel: list[int], itemsize: list[int], persistent: set[int], world_size: int, bucket: int,
                 max_live: int, staging_slots: int) -> None:
        self.numel, self.itemsize, self.persistent, self.world = numel, itemsize, persistent, world_size
        self.bucket, self.max_live, self.slots = bucket, max_live, staging_slots

    def _padded(self, p: int) -> int:
        # a parameter padded to a multiple of the ranks (its partition: ceil(numel / N) elements)
        return -(-self.numel[p] // self.world) * self.world

    def _flat(self, params: list[int]) -> int:
        return sum(self._padded(p) * self.itemsize[p] for p in params)

    def resident(self) -> int:
        """The persistent parameters' bytes: gathered at every moment."""
        return sum(self.numel[p] * self.itemsize[p] for p in self.persistent)

    def moments(self, trace: list[list[int]]) -> list[GatherMoment]:
        """One :class:`GatherMoment` per module call of ``trace`` (each call's own parameter indices)."""
        return self._run(trace)[0]

    def buckets(self, trace: list[list[int]]) -> list[int]:
        """The all-gathers issued over ``trace``, in order: each output's elements (padded)."""
        return self._run(trace)[1]

    def _run(self, trace: list[list[int]]) -> tuple[list[GatherMoment], list[int]]:
        run = _Coordinator(self, trace)
        return [run.fetch(step, params) for step, params in enumerate(trace)], run.issued

    def padded(self, params: list[int]) -> int:
        """Elements of the flat output of a bucket of ``params``: each padded to a multiple of the ranks."""
        return sum(self._padded(p) for p in params)


class _Coordinator:
    """One forward's state in :class:`ForwardGathering` (``_fetch_sub_module_impl``, step by step)."""

    def __init__(self, owner: ForwardGathering, trace: list[list[int]]) -> None:
        self.owner = owner
        self.queue = collections.deque((p, step) for step, params in enumerate(trace) for p in params)
        self.available = set(owner.persistent)
        self.registry: dict[int, _Bucket] = {}
        self.fetched_for: dict[int, int] = {}
        self.running: list[_Bucket] = []  # issued, not waited: may be running on a worker
        self.issued: list[int] = []  # each all-gather's output elements, in order
        self.copies, self.flats, self.numel_available = owner.resident(), 0, 0

    def now(self) -> GatherMoment:
        staged = sorted((bucket.flat for bucket in self.running), reverse=True)[:self.owner.slots]
        return GatherMoment(self.copies, self.flats, sum(staged))

    def issue(self, params: list[int]) -> None:
        bucket = _Bucket(params, self.owner._flat(params))
        self.issued.append(self.owner.padded(params))
        for p in params:
            self.registry[p] = bucket
        self.flats += bucket.flat
        self.numel_available += sum(self.owner.numel[p] for p in params)
        self.running.append(bucket)

    def gathered(self, p: int) -> bool:
        return p in self.available or p in self.registry

    def fetch(self, step: int, params: list[int]) -> GatherMoment:
        owner, seen = self.owner, []  # what held before this call belongs to the window before
        current = sorted({p for p in params if not self.gathered(p)})
        if current:
            self.issue(current)
            seen.append(self.now())
        for p in params:
            bucket = self.registry.pop(p, None)
            if bucket is None:
                continue
            if not bucket.waited:  # the work completed (gloo freed its copy first); every parameter copied out
                bucket.waited = True
                self.running.remove(bucket)
                self.available.update(bucket.params)
                if bucket.single:  # its buffer is the parameter's data: nothing copied
                    self.flats -= bucket.flat
                    self.copies += bucket.flat
                else:
                    self.copies += sum(owner.numel[q] * owner.itemsize[q] for q in bucket.params)
                seen.append(self.now())
            bucket.pending -= 1
            if bucket.pending == 0 and not bucket.single:
                self.flats -= bucket.flat
        # the queue's entries of this call's parameters, then the prefetch of the next ones
        wanted = {p for p in params if self.fetched_for.get(p, -1) < step}
        discarded: set[int] = set()
        while self.queue and len(discarded) < len(wanted):
            p, last = self.queue.popleft()
            self.fetched_for[p] = last
            discarded.add(p)
        limit = min(owner.max_live - self.numel_available, owner.bucket)
        chosen: dict[int, None] = {}
        numel = 0
        while self.queue and numel < limit:
            p, last = self.queue.popleft()
            if not self.gathered(p) and p not in chosen:
                chosen[p] = None
                numel += owner.numel[p]
            self.fetched_for[p] = max(self.fetched_for.get(p, -1), last)
        if chosen:
            self.issue(list(chosen))
        seen.append(self.now())
        return max(seen, key=lambda moment: moment.total)


def gathering_replayed(engine: Any, device: str) -> bool:
    """Whether the forward's gathering is replayed per module call: DeepSpeed ZeRO-3 on CPU ranks (gloo)."""
    return (engine is not None and engine.kind == "deepspeed" and engine.zero_stage == 3 and engine.world_size >= 2
            and device == "cpu")


def _setting(engine: Any, field: str, key: str) -> int:
    value = getattr(engine, field, None)
    return int(ZERO_DEFAULTS[key] if value is None else value)


def forward_gathering(model: torch.nn.Module, engine: Any, device: str) -> tuple[ForwardGathering, dict[int, int]] | None:
    """The :class:`ForwardGathering` of ``model`` under ZeRO-3 ``engine`` with each parameter's index (by
    ``id``), in the parameters' dtypes as they are now; None where it does not apply (parameters released
    in the forward)."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    if _setting(engine, "max_reuse_distance", "stage3_max_reuse_distance") < total \
            or _setting(engine, "max_live_parameters", "stage3_max_live_parameters") < total:
        return None
    threshold = _setting(engine, "param_persistence_threshold", "stage3_param_persistence_threshold")
    gathering = ForwardGathering(
        [p.numel() for p in params], [p.element_size() for p in params],
        {i for i, p in enumerate(params) if p.numel() <= threshold}, engine.world_size,
        _setting(engine, "prefetch_bucket_size", "stage3_prefetch_bucket_size"),
        _setting(engine, "max_live_parameters", "stage3_max_live_parameters"), GLOO_THREADS if device == "cpu" else 0)
    return gathering, {id(p): i for i, p in enumerate(params)}


def zero3_forward_gathering(per_phase: dict[str, dict[str, int]], windows: list[list[tuple[Any, dict[str, int]]]] | None,
                            model: torch.nn.Module, engine: Any, device: str, notes: list[str]
                            ) -> dict[str, dict[str, int]] | None:
    """``per_phase`` with the forward's high replayed from its ``windows`` (each interval's, in time order:
    ``"head"`` then one a module call, labelled ``(MODULE_WINDOW, name)``; their classes the rank's as
    ``per_phase``'s, every parameter counted gathered): at each window the parameters gathered, the flat
    outputs held and the staging copies of :class:`ForwardGathering` in place of the whole model gathered.
    None where it does not apply (not ZeRO-3 on CPU ranks, no windows, parameters released in the forward)."""
    if not gathering_replayed(engine, device) or not windows or AFTER_FORWARD not in per_phase:
        return None
    found = forward_gathering(model, engine, device)
    if found is None:
        return None
    gathering, index = found
    whole = zero3_gathered_bytes(model, engine)
    best: tuple[int, dict[str, int], GatherMoment] | None = None
    for interval in windows:
        labels = [label for label, _ in interval]
        if labels[:1] != ["head"] or any(not (isinstance(label, tuple) and label[:1] == (MODULE_WINDOW,))
                                         for label in labels[1:]):
            return None
        trace = [sorted({index[id(p)] for p in model.get_submodule(label[1]).parameters(recurse=False)})
                 for label in labels[1:]]
        moments = [GatherMoment(gathering.resident(), 0, 0), *gathering.moments(trace)]
        for (_, classes), moment in zip(interval, moments):
            held = dict(classes)
            held["weights"] += moment.copies - whole
            held["temporaries"] = held.get("temporaries", 0) + moment.flats + moment.staging
            if best is None or sum(held.values()) > best[0]:
                best = (sum(held.values()), held, moment)
    if best is None:
        return None
    _, held, moment = best
    notes.append(f"zero3 on gloo: the forward's gathering replayed (prefetch bucket "
                 f"{gathering.bucket:,} elements): at its high {moment.copies:,} B of parameters gathered, "
                 f"{moment.flats:,} B of coalesced all-gather outputs and {moment.staging:,} B of gloo's "
                 f"staging copies")
    return {**per_phase, AFTER_FORWARD: held}
