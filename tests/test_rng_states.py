"""Activation checkpointing's saved CPU RNG state is counted, live and estimated (hf_memwatch/measure/rng_states.py).

Before: every checkpointed draw of the seeded sweep was under the profiler by 5,056 B per checkpointed layer,
in MemWatch's live step peaks and in the estimate alike (the state is made by no operator).
"""

from __future__ import annotations

import torch

from hf_memwatch.measure.tracker import StorageTracker
from hf_memwatch.testing.sweep import draw, run_draw


def test_the_state_is_counted_on_a_cpu_tracker_only() -> None:
    cpu, cuda_target = StorageTracker("cpu"), StorageTracker("cpu")
    cuda_target.gpu = "a CUDA target's card"  # an estimate for a CUDA target: the state is host memory there
    with cpu, cuda_target:
        state = torch.get_rng_state()
    assert cpu.allocated == state.untyped_storage().nbytes() == 5056
    assert cuda_target.allocated == 0


def test_a_checkpointed_run_is_exact_live_and_estimated() -> None:
    result = run_draw(draw(7))  # GPTBigCode, 3 layers, reentrant checkpointing, 1 x 16, accumulation 2
    assert result.draw.checkpointing == "reentrant" and result.error is None
    assert abs(result.estimate - result.truth) <= 64, (result.estimate, result.truth)  # was -15,172 B
    assert all(abs(a - b) <= 64 for a, b in zip(result.live, result.live_truth, strict=True)), (
        result.live, result.live_truth)  # was -15,168 B at both steps


def test_torch_get_rng_state_is_torch_s_own_once_no_tracker_is_entered() -> None:
    own = torch.get_rng_state
    outer, inner = StorageTracker("cpu"), StorageTracker("cpu")
    with outer:
        assert getattr(torch.get_rng_state, "_hf_memwatch_counted", False)
        with inner:
            pass
        assert getattr(torch.get_rng_state, "_hf_memwatch_counted", False)  # the outer one still counts
    assert torch.get_rng_state is own
    try:
        with StorageTracker("cpu"):
            raise RuntimeError("the body fails")
    except RuntimeError:
        pass
    assert torch.get_rng_state is own
