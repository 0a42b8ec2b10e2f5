"""The profiler truth when another thread frees a block (hf_memwatch/testing/truth.py, ``reconcile``): what
gloo's worker threads do to a collective's tensors under DeepSpeed, here with a plain Python thread."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_memwatch.testing.truth import alive_storages, cpu_memory_deltas, cpu_memory_profile

# Above the allocator's per-thread cache, below its mmap threshold: an address freed on another thread
# is reused by the next allocation of its size — mostly. In a long-lived worker whose heap holds other
# free chunks, 20 trials at 64 KiB once reused none (the test skipped), so other sizes are tried too.
SIZES = (65536, 98304, 40960, 131072)


def _trials(nbytes: int, trials: int = 20):
    """``trials`` blocks of ``nbytes`` read here and freed on another thread, each followed by a new
    allocation of the same size; the profile and how many of those reused the freed address."""
    reused = 0
    held: dict[str, torch.Tensor] = {}
    with cpu_memory_profile(record_shapes=True) as prof:
        for _ in range(trials):
            held["block"] = torch.ones(nbytes, dtype=torch.uint8)
            ptr = held["block"].data_ptr()
            held["block"].sum()  # its last reader on this thread
            freer = threading.Thread(target=lambda: held.pop("block"))
            freer.start()
            freer.join()
            again = torch.empty(nbytes, dtype=torch.uint8)
            reused += again.data_ptr() == ptr
            del again
    return prof, reused


def test_a_free_on_another_thread_is_reconciled_at_the_blocks_last_reader():
    """A block read on this thread and freed on another: the raw sum keeps it for good; reconciled, its
    free is placed where its address was reused (checked over trials: the allocator reuses some)."""
    trials = 20
    for nbytes in SIZES:
        prof, reused = _trials(nbytes, trials)
        if reused:
            break
    else:
        pytest.skip(f"the allocator reused no address at {SIZES} bytes: nothing shows the frees")
    raw = sum(d for _, d in cpu_memory_deltas(prof) if abs(d) == nbytes)
    reconciled = sum(d for _, d in cpu_memory_deltas(prof, reconcile=True) if abs(d) == nbytes)
    assert raw == trials * nbytes  # no free of the other thread is reported: every block counted for good
    assert 0 <= reconciled <= (trials - reused) * nbytes, (reconciled, reused)


def test_a_block_freed_on_another_thread_and_never_reused_is_found_by_what_is_alive_at_the_end():
    """A 1 MiB block (its own mapping: its address is not reused) read here and freed on another thread:
    only the storages alive when the window closes tell it was freed; a block still held is kept."""
    held: dict[str, torch.Tensor] = {}
    with cpu_memory_profile(record_shapes=True) as prof:
        kept = torch.ones(1 << 20, dtype=torch.uint8)
        held["block"] = torch.ones(1 << 20, dtype=torch.uint8)
        held["block"].sum()
        freer = threading.Thread(target=lambda: held.pop("block"))
        freer.start()
        freer.join()
    alive = alive_storages()
    sizes = (1 << 20,)
    raw = sum(d for _, d in cpu_memory_deltas(prof) if abs(d) in sizes)
    without = sum(d for _, d in cpu_memory_deltas(prof, reconcile=True) if abs(d) in sizes)
    reconciled = sum(d for _, d in cpu_memory_deltas(prof, reconcile=True, alive=alive) if abs(d) in sizes)
    assert raw == without == 2 << 20  # the free on the other thread is not reported
    assert reconciled == 1 << 20  # `kept` alone
    assert kept.untyped_storage().data_ptr() in alive
