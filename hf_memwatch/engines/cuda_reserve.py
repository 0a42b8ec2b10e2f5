"""A sharded rank's CUDA reserve where its shares are taken after the replay: the replayed step's cache
gap carried onto the rank's peak.

ZeRO's shares (parameters, gradients, optimizer states divided over the ranks, its buckets and flat
step) and the full-shard division of FSDP1 and of FSDP2 where its replay does not apply (fp16, CPU
offload, no engine named: :func:`~hf_memwatch.engines.shard.shard_classes`) are taken after the
replay (the engines' ``rank_classes``), so the allocation sequence the estimator recorded is one
unsharded process's: replayed as it is through the caching-allocator model it would give that
process's reserve, not the rank's. What the rank's reserve adds to its allocated peak comes from the
blocks the step frees and allocates again (activations, their gradients, the step's temporaries: the
same on every rank, neither engine divides them) and the segments their sizes round up to. So the
recorded sequence is replayed through the allocator model (torch's rules:
:mod:`hf_memwatch.estimation.cuda_allocator`) without the card's limit — the unsharded process may pass
a card its ranks fit — and its gap, peak reserved less peak allocated, is carried onto the rank's
predicted peak: the same carry as an extrapolated depth's
(:func:`~hf_memwatch.estimation.cuda_device.replay_reserve`'s ``extrapolated_peak``). FSDP2's replay,
where it applies, records the rank's own sequence and replays it instead (``per_rank``).

Measured on tests/test_cuda_allocator.py's case (a 2-layer GPT-2, 64 wide, vocab 1000, 2 x 16 tokens,
AdamW, fp32, ZeRO-2 over 2 ranks, T4): rank peak 25,292,288 B, reserved 30,012,416 B (gap 4.5 MiB:
the cuBLAS workspaces and the step's rounding). What the gap cannot hold: a rank whose divided
states fragment other segments than the whole process's did (ZeRO's flat partitions are single
blocks allocated once, so they seldom do; FSDP1's all-gathered units, allocated and freed per unit,
are not in the recorded sequence), and no GPU has checked it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MiB = 1 << 20


def carried_reserve(replay: Callable[[int], Any], rank_peak: int, notes: list[str], engine: str) -> Any:
    """``replay(rank_peak)``: the recorded sequence's reserve gap carried onto the rank's peak, noted with
    the ``engine`` whose shares were taken after the replay.

    Example:
        >>> from types import SimpleNamespace
        >>> notes = []
        >>> carried_reserve(lambda peak: SimpleNamespace(reserved=peak + 4 * MiB), 20 * MiB, notes, "zero").reserved // MiB
        24
        >>> notes[0].startswith("CUDA reserve per rank: 24 MiB")
        True
    """
    prediction = replay(rank_peak)
    if prediction is not None:
        notes.append(f"CUDA reserve per rank: {prediction.reserved / MiB:,.0f} MiB, the rank's peak "
                     f"{rank_peak / MiB:,.0f} MiB plus the replayed step's cache gap (reserved less allocated "
                     f"at its peak; {engine}'s shares are taken after the replay: engines/cuda_reserve.py)")
    return prediction
