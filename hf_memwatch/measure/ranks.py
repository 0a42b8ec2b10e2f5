"""Distributed runs: the rank collectives and the decisions agreed through the process group.

Everything here uses the process group the user's launcher already set up (``torchrun``,
``accelerate launch``, DeepSpeed) through ``torch.distributed``; nothing is launched or created.
Without an initialized process group every helper degrades to the single-process answer. What an
engine holds on a rank (DDP buckets, ZeRO partitions, FSDP2 shards) is each engine's, in
:mod:`hf_memwatch.engines`.

* :func:`world`, :func:`gather_ints`, :func:`max_over_ranks` — small collectives.
* :func:`agree_plan` / :func:`decide_across_ranks` — the rank that needs the most memory decides
  for all; :func:`agree_unavailable` unions the remedies some rank cannot apply;
  :func:`share_failure` / :class:`PeerFailure` — a rank that fails while planning makes every rank
  leave the agreement together instead of leaving them waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


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

    plan: Any  # as the deciding rank passed it (the auto mode's PlanRecord, pickled across ranks)
    decider: int
    needs: list[int]


def decide_across_ranks(local_plan: Any, need_bytes: int) -> Agreement:
    """The plan of the rank that needs the most bytes (ties: the lowest rank), on every rank.

    ``need_bytes`` is how much the rank must cut from the configured run to fit its budget (its
    predicted peak minus its usable budget, negative when it fits): the rank under the most pressure
    chooses, and its plan fits every rank whose budget is larger. One ``all_gather_object``: every
    rank must call it once at the same point, and every rank then holds the same answer.
    """
    entries = _exchange((int(need_bytes), local_plan))
    needs = [need for need, _ in entries]
    decider = max(range(len(entries)), key=lambda rank: (needs[rank], -rank))
    return Agreement(plan=entries[decider][1], decider=decider, needs=needs)


def agree_plan(local_plan: Any, need_bytes: int) -> Any:
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
