"""Watching changes nothing and sees every byte: the same run with and without MemWatch, by PyTorch.

Truth is the profiler's CPU memory events (:mod:`hf_memwatch.testing.truth`); the cases are tiny
real models (:mod:`hf_memwatch.testing.perturbation`), 2 optimizer steps.
"""

from __future__ import annotations

import pytest

from hf_memwatch.testing.perturbation import CASES, compare


@pytest.mark.parametrize("case", ["vit", "whisper"])
def test_live_step_peaks_count_the_batches_the_dataloader_formed(case):
    # Step 1 holds step 2's batch (accelerate fetches one ahead): 7.6% of ViT's peak before.
    result = compare(CASES[case], case, unwatched=False)
    assert len(result.live) == len(result.truth) == 2
    assert result.live_error <= 0.01, (result.live, result.truth)
