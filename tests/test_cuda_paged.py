"""bitsandbytes' paged optimizer states (hf_memwatch/estimation/cuda_paged.py): cudaMallocManaged memory,
out of torch's reserve, in the device total."""

from __future__ import annotations

import pytest
import torch

from hf_memwatch.estimation.cuda_paged import (
    PAGED_MIN_NUMEL,
    PagedKey,
    mark_paged,
    recording_cuda_allocations,
    split_paged,
)
from hf_memwatch.measure.tracker import StorageTracker

pytest.importorskip("bitsandbytes")


class _Paged:
    is_paged = True

    def get_state_buffer(self, p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros_like(p, dtype=dtype)


def test_the_buffers_cuda_would_page_leave_the_replayed_sequence():
    """Only a paged optimizer's buffers of parameters of 1e5 elements or more (bitsandbytes' rule), only for
    a CUDA target; their allocation and free events re-labelled, their bytes the step's paged bytes."""
    big, small = torch.zeros(PAGED_MIN_NUMEL), torch.zeros(PAGED_MIN_NUMEL - 1)
    with recording_cuda_allocations() as traces:
        tracker = StorageTracker("cpu", round_to=512)
        with tracker:
            for optimizer in (mark_paged(_Paged(), "cuda"), mark_paged(_Paged(), "cpu")):
                states = [optimizer.get_state_buffer(big, torch.uint8), optimizer.get_state_buffer(small, torch.uint8)]
                del states
    paged = [(type(key), nbytes) for key, nbytes in traces[0] if isinstance(key, PagedKey)]
    assert paged == [(PagedKey, 100_352), (PagedKey, 0)]  # the CUDA one's big buffer: alloc (512-rounded), free
    kept, nbytes = split_paged(traces)
    assert nbytes == 100_352 and len(kept[0]) == len(traces[0]) - 2
    assert mark_paged(object(), "cuda") is not None  # not a bitsandbytes optimizer: left as it is


def test_paged_states_count_in_the_device_total_not_in_the_reserve():
    """paged_adamw_8bit against adamw_bnb_8bit on the same model: the same allocated peak (the replay holds
    both as torch tensors), the reserve without the paged states, device_bytes with them. The tied
    word embeddings (2,000 x 64 = 128,000 elements) keep 32-bit states (the Trainer's override for
    embeddings): two fp32 states, 1,024,000 B paged; every other parameter is under 1e5 elements."""
    from transformers import GPT2Config

    from hf_memwatch.estimation.estimate import estimate

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=2000, n_positions=64)
    common = dict(task="causal-lm", micro_batch_size=2, seq_len=16, device="cuda", gpu="T4")
    plain = estimate(config, optim="adamw_bnb_8bit", **common)
    paged = estimate(config, optim="paged_adamw_8bit", **common)
    assert paged.peak_bytes == plain.peak_bytes
    assert paged.device_overheads["paged_optimizer_states"] == 2 * 4 * 128_000
    assert "paged_optimizer_states" not in plain.device_overheads
    assert paged.reserved_bytes <= plain.reserved_bytes - 2 * 4 * 128_000 + 2 * (1 << 20)  # out of the segments
    overheads = paged.device_overheads["cuda_context"] + paged.device_overheads["nccl_buffers"]
    assert paged.device_bytes == paged.reserved_bytes + overheads + 2 * 4 * 128_000
    assert any(note.startswith("bitsandbytes' paged optimizer states") for note in paged.notes)
