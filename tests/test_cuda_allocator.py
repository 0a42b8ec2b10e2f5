"""The CUDA caching allocator's replay against the rules of c10/cuda/CUDACachingAllocator.cpp (pure, CPU).

Each test states one documented rule with the sizes that tell it apart from its neighbours; the
last ones check that the estimator records the sequence the replay needs and reports the reserve.
"""

from __future__ import annotations

import pytest
import torch

from hf_memwatch.core.gpus import GpuSpec, gpu_spec
from hf_memwatch.engines.cuda_reserve import carried_reserve
from hf_memwatch.engines.ddp.replay import ddp_bucket_bytes
from hf_memwatch.estimation.cuda_allocator import (
    AllocatorConfig,
    AllocatorOOM,
    CachingAllocator,
    MiB,
    replay,
    round_size,
)
from hf_memwatch.estimation.cuda_device import (
    PUBLISHED_CONTEXTS,
    cuda_step_reserve,
    lazy_loading,
    nccl_buffer_bytes,
    predict_reserved,
    published_context,
)
from hf_memwatch.measure.tracker import StorageTracker, recording_allocations

KiB = 1 << 10


def test_requests_are_rounded_to_512_bytes():
    """round_size: every request up to a multiple of kMinBlockSize (512 B)."""
    assert [round_size(n) for n in (1, 511, 512, 513, 1025)] == [512, 512, 512, 1024, 1536]
    a = CachingAllocator()
    a.malloc("x", 1)
    assert a.allocated == 512


def test_small_requests_are_packed_into_2_mib_segments():
    """get_pool / get_allocation_size: requests of at most kSmallSize (1 MiB) share kSmallBuffer (2 MiB) segments."""
    a = CachingAllocator()
    for i in range(4):
        a.malloc(i, 512 * KiB)
    assert a.reserved == 2 * MiB and a.allocated == 2 * MiB
    a.malloc(4, 1)  # the 2 MiB segment is full: a second one
    assert a.reserved == 4 * MiB
    a.malloc(5, MiB)  # 1 MiB exactly is still small: it fits the second segment's rest
    assert a.reserved == 4 * MiB
    a.malloc(6, MiB)  # 2 MiB - 512 B - 1 MiB left: a third
    assert a.reserved == 6 * MiB


def test_requests_between_1_and_10_mib_share_a_20_mib_segment():
    """get_allocation_size: a request in (1, 10) MiB gets a kLargeBuffer (20 MiB) segment, split by the next."""
    a = CachingAllocator()
    a.malloc("a", MiB + 1)
    assert a.reserved == 20 * MiB
    a.malloc("b", 5 * MiB)  # split off the same segment (more than 1 MiB remained)
    a.malloc("c", 9 * MiB)
    assert a.reserved == 20 * MiB
    a.malloc("d", 5 * MiB)  # 20 - 1 - 5 - 9 = ~5 MiB left, short of 5 MiB by the rounding: a new segment
    assert a.reserved == 40 * MiB


def test_larger_requests_are_rounded_up_to_2_mib():
    """get_allocation_size: at or above kMinLargeAlloc (10 MiB), the request rounded up to kRoundLarge (2 MiB)."""
    a = CachingAllocator()
    a.malloc("a", 10 * MiB)
    assert a.reserved == 10 * MiB
    a.malloc("b", 10 * MiB + 1)
    assert a.reserved == 22 * MiB


def test_a_large_block_is_split_only_when_more_than_1_mib_remains():
    """should_split: a large-pool block is split only when more than kSmallSize (1 MiB) would remain."""
    a = CachingAllocator()
    a.malloc("a", 11 * MiB + 512 * KiB)  # a 12 MiB segment: 512 KiB would remain, so it is not split
    assert a.allocated == 12 * MiB
    b = CachingAllocator()
    b.malloc("a", 10 * MiB + 512 * KiB)  # 1.5 MiB would remain: split
    assert b.allocated == 10 * MiB + 512 * KiB


def test_best_fit_reuses_the_smallest_cached_block_and_freeing_merges_neighbours():
    """get_free_block (the smallest cached block that fits) and free_block / try_merge_blocks."""
    a = CachingAllocator()
    for key in "abc":
        a.malloc(key, 4 * MiB)  # one 20 MiB segment: a b c, 8 MiB free at the end
    a.free("a")
    a.malloc("d", 3 * MiB)  # best fit: a's 4 MiB hole, not the 8 MiB tail
    assert a.reserved == 20 * MiB
    a.malloc("e", 8 * MiB)  # the tail fits exactly
    assert a.reserved == 20 * MiB
    for key in "bcde":
        a.free(key)
    assert a.allocated == 0
    a.empty_cache()  # merged back into one free segment: given back
    assert a.reserved == 0


def test_empty_cache_keeps_segments_that_hold_a_live_block():
    """release_cached_blocks / release_blocks: only segments wholly free (not split) are given back."""
    a = CachingAllocator()
    a.malloc("small", 1)
    a.malloc("big", 30 * MiB)
    a.malloc("other", 30 * MiB)
    a.free("other")
    a.empty_cache()
    assert a.reserved == 2 * MiB + 30 * MiB


def test_max_split_size_keeps_oversized_blocks_for_large_requests():
    """get_free_block: a request below max_split_size never takes a cached block of at least that size."""
    config = AllocatorConfig.parse("max_split_size_mb:20")
    a = CachingAllocator(config)
    a.malloc("a", 30 * MiB)
    a.free("a")
    a.malloc("b", 4 * MiB)  # below max_split_size: never from a block of >= 20 MiB
    assert a.reserved == 30 * MiB + 20 * MiB
    unlimited = CachingAllocator()
    unlimited.malloc("a", 30 * MiB)
    unlimited.free("a")
    unlimited.malloc("b", 4 * MiB)  # without it, the 30 MiB block is split
    assert unlimited.reserved == 30 * MiB


def test_max_split_size_large_requests_take_oversized_blocks_within_20_mib():
    """get_free_block / should_split: a request at or above max_split_size takes a block less than
    max_non_split_rounding_size (20 MiB) larger, whole."""
    config = AllocatorConfig(max_split_size=20 * MiB)
    a = CachingAllocator(config)
    a.malloc("big", 60 * MiB)
    a.free("big")
    a.malloc("x", 30 * MiB)  # 60 >= 30 + 20: refused, a new segment
    assert a.reserved == 90 * MiB
    b = CachingAllocator(config)
    b.malloc("big", 40 * MiB)
    b.free("big")
    b.malloc("x", 30 * MiB)  # 40 < 30 + 20: taken whole (not split: at or above max_split_size)
    assert b.reserved == 40 * MiB and b.allocated == 40 * MiB


def test_expandable_segments_tile_a_slightly_larger_batch_into_one_segment():
    """Note [Expandable Segments] / try_allocate_expandable_block: one segment grown by 20 MiB pages."""
    events = [(i, 12 * MiB) for i in range(5)] + [(i, 0) for i in range(5)] + [(10 + i, 13 * MiB) for i in range(5)]
    assert replay(events).peak_reserved == 5 * 12 * MiB + 5 * 14 * MiB  # freed 12 MiB segments cannot hold 13
    expandable = replay(events, AllocatorConfig(expandable_segments=True))
    assert expandable.peak_reserved == 80 * MiB  # 60 MiB mapped (3 pages of 20), one page more for 65 MiB


def test_over_the_limit_the_cache_is_freed_once_then_it_is_an_oom():
    """malloc: a failed alloc_block, release_cached_blocks, alloc_block(isRetry) (num_alloc_retries), then OOM."""
    a = CachingAllocator(limit=40 * MiB)
    a.malloc("x", 30 * MiB)
    a.free("x")
    a.malloc("y", 35 * MiB)  # 30 cached + 36 new > 40: the cached segment is given back first
    assert (a.reserved, a.num_alloc_retries) == (36 * MiB, 1)
    with pytest.raises(AllocatorOOM):
        a.malloc("z", 10 * MiB)
    assert a.num_ooms == 1


def test_max_non_split_rounding_mb_widens_what_an_oversize_request_may_round_up_to():
    """get_free_block: a request at or above max_split_size takes a block less than
    max_non_split_rounding_size larger (default kLargeBuffer, 20 MiB)."""
    wide = CachingAllocator(AllocatorConfig.parse("max_split_size_mb:20,max_non_split_rounding_mb:40"))
    wide.malloc("big", 60 * MiB)
    wide.free("big")
    wide.malloc("x", 30 * MiB)  # 60 < 30 + 40: taken whole
    assert wide.reserved == 60 * MiB and wide.allocated == 60 * MiB


def test_large_segment_size_mb_sizes_the_segment_of_a_1_to_10_mib_request():
    """get_allocation_size: a request in (1, 10) MiB gets a large_segment_size segment (default 20 MiB)."""
    a = CachingAllocator(AllocatorConfig.parse("large_segment_size_mb:32"))
    a.malloc("x", 3 * MiB)
    assert a.reserved == 32 * MiB
    a.malloc("y", 30 * MiB)  # at or above kMinLargeAlloc: its own size, 2 MiB-rounded, as before
    assert a.reserved == 32 * MiB + 30 * MiB


def test_expandable_best_fit_ranks_the_block_bordering_unmapped_space_by_its_reach():
    """get_free_block's expandable_size: the free tail that borders unmapped space ranks as its size
    plus that space, so a larger hole is taken first and the tail is kept for growth."""
    a = CachingAllocator(AllocatorConfig(expandable_segments=True))
    a.malloc("A", 30 * MiB)  # 2 pages of 20 MiB; 10 MiB free tail
    a.malloc("B", 12 * MiB)  # the tail and one more page: B at 30 MiB, an 18 MiB free tail
    a.free("A")  # a 30 MiB hole at the start
    a.malloc("C", 15 * MiB)  # plain best fit: the 18 MiB tail; torch: the 30 MiB hole (15 MiB left)
    assert a.live["C"].addr == a.live["B"].addr - 30 * MiB
    a.malloc("D", 25 * MiB)  # no block holds 25 MiB: the tail grows by a page (plain best fit: the hole)
    assert a.reserved == 80 * MiB


def test_expandable_release_unmaps_every_whole_free_page_of_the_segment():
    """release_blocks/unmap_block: empty_cache unmaps the whole free pages anywhere in the segment,
    not only at its end; a free block's part-pages stay mapped."""
    a = CachingAllocator(AllocatorConfig(expandable_segments=True))
    a.malloc("A", 30 * MiB)
    a.malloc("B", 50 * MiB)  # B at 30 MiB .. 80 MiB: 4 pages mapped
    a.free("A")  # 0 .. 30 MiB free: one whole page (0 .. 20) and half of the next
    a.empty_cache()
    assert a.reserved == 60 * MiB


def test_expandable_maps_the_lowest_unmapped_hole_first():
    """find_expandable_block: new pages go at the lowest address where free and unmapped space hold
    the request, so an unmapped hole inside the segment is filled before the end grows."""
    a = CachingAllocator(AllocatorConfig(expandable_segments=True))
    for key in "ABC":
        a.malloc(key, 20 * MiB)
    a.free("B")
    a.empty_cache()  # B's page unmapped: a hole between A and C
    assert a.reserved == 40 * MiB
    a.malloc("D", 20 * MiB)
    assert a.live["D"].addr == a.live["A"].addr + 20 * MiB and a.reserved == 60 * MiB


def test_expandable_out_of_memory_unmaps_free_pages_and_maps_again():
    """malloc: a failed map (cuMemCreate out of memory) is followed by release_cached_blocks, which
    unmaps the free pages inside the segment, and one retry (num_alloc_retries)."""
    a = CachingAllocator(AllocatorConfig(expandable_segments=True), limit=120 * MiB)
    a.malloc("A", 30 * MiB)
    a.malloc("B", 50 * MiB)  # 80 MiB mapped
    a.free("A")
    a.malloc("C", 45 * MiB)  # 3 more pages: 140 > 120; A's whole page unmapped (60), then 120 fits
    assert (a.reserved, a.num_alloc_retries) == (120 * MiB, 1)
    with pytest.raises(AllocatorOOM):
        a.malloc("D", 30 * MiB)


def test_release_available_cached_blocks_frees_the_smallest_oversize_block_that_suffices():
    """malloc -> release_available_cached_blocks (max_split_size set): after a failed cudaMalloc the
    smallest cached block of at least max(size, max_split_size) is freed, and cudaMalloc tried again,
    before the whole cache is (num_alloc_retries stays 0)."""
    a = CachingAllocator(AllocatorConfig(max_split_size=40 * MiB), limit=130 * MiB)
    a.malloc("x", 50 * MiB)
    a.malloc("y", 60 * MiB)
    a.free("x")
    a.free("y")
    a.malloc("r", 25 * MiB)  # below max_split_size: no oversize block for it; 110 + 26 > 130
    assert (a.reserved, a.num_alloc_retries) == (60 * MiB + 26 * MiB, 0)  # x freed, y kept


def test_release_available_cached_blocks_frees_oversize_blocks_from_the_largest_down():
    """release_available_cached_blocks: no single block is large enough: oversize blocks are freed
    from the largest down until the request's size is, the smaller ones kept."""
    a = CachingAllocator(AllocatorConfig(max_split_size=40 * MiB), limit=140 * MiB)
    for key, size in (("p", 42), ("q", 44), ("s", 46)):
        a.malloc(key, size * MiB)
    for key in "pqs":
        a.free(key)
    a.malloc("r", 80 * MiB)  # 132 + 80 > 140: 46 and 44 freed (90 >= 80), 42 kept
    assert (a.reserved, a.num_alloc_retries) == (42 * MiB + 80 * MiB, 0)


def test_a_memory_fraction_fails_cudamalloc_past_its_allowance():
    """alloc_block: with set_per_process_memory_fraction, a segment that would take the reserve past
    fraction x the card's memory fails as cudaMalloc would."""
    a = CachingAllocator(total_memory=100 * MiB, memory_fraction=0.5)
    a.malloc("x", 30 * MiB)
    with pytest.raises(AllocatorOOM):
        a.malloc("y", 30 * MiB)  # 60 > 50, though the card has 100
    assert a.reserved == 30 * MiB


def test_garbage_collection_frees_the_oldest_cached_segments_over_the_threshold():
    """garbage_collect_cached_blocks: with a memory fraction and garbage_collection_threshold, a
    malloc that needs a segment while the reserve is over threshold x the allowance first frees the
    large pool's wholly free segments of at least the mean age (get_free_block calls since cached)."""
    config = AllocatorConfig.parse("garbage_collection_threshold:0.5")

    def run(**kwargs):
        a = CachingAllocator(config, **kwargs)
        a.malloc("a", 12 * MiB)
        a.free("a")  # cached at call 1
        a.malloc("b", 14 * MiB)
        a.malloc("c", 16 * MiB)
        a.free("b")
        a.free("c")  # cached at call 3
        a.malloc("d", 18 * MiB)  # 42 MiB reserved, under the 50 MiB threshold: no collection
        a.malloc("e", 22 * MiB)  # 60 > 50 at call 5: ages a 4, b 2, c 2 (mean 2.7): a freed, 12 >= 10
        return a

    collected = run(total_memory=100 * MiB, memory_fraction=1.0)
    assert collected.reserved == 70 * MiB
    assert sorted(size for size, _ in collected.pools[False].free) == [14 * MiB, 16 * MiB]
    assert run().reserved == 82 * MiB  # no fraction set: garbage collection never runs


def test_nccl_buffers_come_from_the_documented_settings():
    assert nccl_buffer_bytes(1, {}) == 0
    assert nccl_buffer_bytes(4, {}) == 16 * 2 * 4 * MiB
    assert nccl_buffer_bytes(4, {"NCCL_MAX_NCHANNELS": "4", "NCCL_BUFFSIZE": str(MiB)}) == 8 * MiB


def test_the_tracker_records_the_sequence_the_replay_needs():
    """A real CPU computation: the recorded sequence replays to the tracker's own live bytes and peak."""
    with recording_allocations() as traces:
        tracker = StorageTracker("cpu", round_to=512)
        with tracker:
            x = torch.randn(300, 300)
            y = (x @ x).relu()
            z = torch.cat([y, x])
            del x, y
            w = z.sum(0)
    result = replay(traces[0])
    assert result.peak_allocated == tracker.peak  # all small blocks: no split rounding
    assert sum(n for _, n in traces[0] if n) > tracker.allocated  # frees were recorded too
    del z, w


def test_the_estimate_predicts_the_reserve_on_cuda_only(monkeypatch):
    from transformers import GPT2Config

    from hf_memwatch.estimation.estimate import estimate

    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)
    cuda = estimate(config, task="causal-lm", micro_batch_size=2, seq_len=32, device="cuda")
    assert cuda.reserved_bytes >= cuda.peak_bytes and cuda.reserved_bytes % (2 * MiB) == 0
    if not torch.cuda.is_available():  # the context from the published table, the card assumed (H100)
        lazy = published_context(90, lazy=True)
        assert cuda.device_overheads["cuda_context"] == lazy.context
        assert cuda.device_bytes == cuda.reserved_bytes + lazy.context
        assert cuda.device_overheads["device_total_memory"] == gpu_spec("H100").memory
        assert any(note.startswith("CUDA context:") and lazy.source in note for note in cuda.notes)
    cpu = estimate(config, task="causal-lm", micro_batch_size=2, seq_len=32, device="cpu")
    assert cpu.reserved_bytes is None and cpu.device_bytes is None and cpu.device_overheads == {}
    assert not any("CUDA" in note for note in cpu.notes)


def test_the_published_contexts_match_by_loading_mode_then_card():
    """published_context: never across loading modes (eager loads every kernel), then the card's own
    figure, then one tied to no other card; every entry has its source."""
    assert all(entry.context > 0 and entry.source.startswith("https://") for entry in PUBLISHED_CONTEXTS)
    lazy = published_context(75, lazy=True)  # no T4 figure: the one tied to no card
    assert lazy.lazy and lazy.context == 287_047_680 - 20 * MiB  # #86509's LAZY figure less its 20 MiB segment
    assert published_context(86, lazy=True).context == 256 * MiB  # the RTX 3090's own under CUDA 12.8
    assert published_context(89, lazy=True).context == 426 * MiB  # sm_89 (L4, RTX 4090): the RTX 6000 Ada's
    assert published_context(70, lazy=False).context == 1341 * MiB  # the V100 of the perf guide
    assert published_context(86, lazy=False).context == 1685 * MiB  # the RTX 3090's own eager figure
    assert published_context(61, lazy=False).context == 719 * MiB
    eager_h100 = published_context(90, lazy=False)  # no H100 figure: the one tied to no card, not the 3090's
    assert eager_h100.sm is None and eager_h100.context == 666_632_192 - 20 * MiB
    assert lazy_loading({}) and lazy_loading({"CUDA_MODULE_LOADING": "LAZY"})
    assert not lazy_loading({"CUDA_MODULE_LOADING": "EAGER"})


def test_device_bytes_are_stated_for_the_named_gpu(monkeypatch):
    """estimate(gpu=...): the card's memory and the table's context for its architecture and loading mode."""
    from transformers import GPT2Config

    from hf_memwatch.estimation.estimate import estimate

    if torch.cuda.is_available():
        pytest.skip("a local card: its context is measured")
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)
    t4 = estimate(config, task="causal-lm", micro_batch_size=2, seq_len=32, device="cuda", gpu="T4")
    eager = published_context(75, lazy=False)
    assert t4.device_overheads == {"cuda_context": eager.context, "nccl_buffers": 0,
                                   "device_total_memory": gpu_spec("T4").memory}
    assert t4.device_bytes == t4.reserved_bytes + eager.context
    assert any("none measured on T4 (sm_75)" in note for note in t4.notes)


def test_the_reserve_is_replayed_under_the_cards_limit(monkeypatch):
    """cuda_step_reserve: the card's memory less the context and NCCL is the allocator's limit: near it
    the cache is freed inside the failed cudaMalloc (a note, the smaller reserve); past it, an OOM note."""
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    context = published_context(90, lazy=True).context
    card = GpuSpec("test-card", context + 40 * MiB, (9, 0))
    cached = [("x", 30 * MiB), ("x", 0), ("y", 35 * MiB)]
    notes: list[str] = []
    reserved, device, _ = cuda_step_reserve([cached], peak=35 * MiB, extrapolated=False, world_size=1, shard=None,
                                            held_bytes=0, notes=notes, gpu=card)
    assert (reserved, device) == (36 * MiB, 36 * MiB + context)  # without the limit: 30 cached + 36
    assert any("num_alloc_retries" in note for note in notes)
    live = [("x", 30 * MiB), ("y", 35 * MiB)]
    notes = []
    reserved, _, _ = cuda_step_reserve([live], peak=65 * MiB, extrapolated=False, world_size=1, shard=None,
                                       held_bytes=0, notes=notes, gpu=card)
    assert reserved == 66 * MiB and any(note.startswith("CUDA: out of memory on test-card") for note in notes)


def test_ddp_buckets_are_torchs_and_held_in_the_replay():
    """ddp_bucket_bytes: torch's compute_bucket_assignment_by_size over the parameters in ready order
    (1 MiB first cap, then 25 MiB), as large as the trainable parameters in all; the DDP estimate's
    reserve holds them (before, it was the single process's)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_memwatch.estimation.estimate import estimate

    config = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=8000, n_positions=128)
    model = GPT2LMHeadModel(config)
    buckets = ddp_bucket_bytes(model)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert sum(buckets) == trainable and len(buckets) > 1
    assert buckets[0] >= MiB and all(b >= 25 * MiB for b in buckets[1:-1])
    assert [b // MiB for b in ddp_bucket_bytes(model, bucket_cap_mb=100)] == [trainable // MiB]
    single = estimate(config, task="causal-lm", micro_batch_size=2, seq_len=32, device="cuda")
    ddp = estimate(config, task="causal-lm", micro_batch_size=2, seq_len=32, device="cuda", world_size=2, shard="none")
    assert ddp.reserved_bytes >= single.reserved_bytes + trainable


def test_fsdp2_gets_its_ranks_reserve_and_zero_and_fsdp1_their_carried_one(monkeypatch):
    """FSDP2's replay records the rank's own sequence (shards, gathers, reshards): its reserve is replayed,
    the sequence peaking at the rank's predicted peak; ZeRO's shares and FSDP1's full-shard division are
    taken after the replay, so the unsharded sequence's gap (reserved less allocated at its peak) is
    carried onto the rank's peak (engines/cuda_reserve.py; FSDP1 had no reserve before); without the
    engines' hook the reserve is not predicted, and said so."""
    from conftest import gpt2_model

    from hf_memwatch.engines.engine import Engine
    from hf_memwatch.estimation import cuda_device
    from hf_memwatch.estimation.estimate import estimate

    replayed = []
    real_replay = cuda_device.replay_reserve

    def keep(traces, **kwargs):
        replayed.append(traces[-1])
        return real_replay(traces, **kwargs)

    monkeypatch.setattr(cuda_device, "replay_reserve", keep)
    fsdp = estimate(gpt2_model(), engine=Engine(kind="fsdp", world_size=2, fsdp_version=2, fsdp_strategy="FULL_SHARD"),
                    shard="fsdp", world_size=2, micro_batch_size=2, seq_len=16, optim="adamw_torch", device="cuda")
    assert any(note.startswith("FSDP2 x 2") for note in fsdp.notes)
    assert fsdp.reserved_bytes is not None and fsdp.reserved_bytes >= fsdp.peak_bytes
    assert fsdp.device_overheads["nccl_buffers"] == nccl_buffer_bytes(2)
    assert replay(replayed[-1]).peak_allocated == fsdp.peak_bytes  # the rank's sequence, not the process's
    zero = estimate(gpt2_model(), shard="zero2", world_size=2, micro_batch_size=2, seq_len=16, optim="adamw_torch",
                    device="cuda", gpu="T4")
    process = replay(replayed[-1])  # the unsharded process's sequence, as recorded
    assert zero.peak_bytes < process.peak_allocated  # the rank holds its shares only
    assert zero.reserved_bytes == zero.peak_bytes + process.peak_reserved - process.peak_allocated
    assert (zero.peak_bytes, zero.reserved_bytes) == (25_292_288, 30_012_416)  # cuda_reserve.py's docstring
    assert zero.device_bytes == zero.reserved_bytes + sum(v for k, v in zero.device_overheads.items()
                                                          if k in ("cuda_context", "nccl_buffers"))
    assert any(note.startswith("CUDA reserve per rank") for note in zero.notes)
    assert carried_reserve(lambda peak: None, zero.peak_bytes, [], "ZeRO") is None  # nothing replayed: not predicted
    fsdp1_engine = Engine(kind="fsdp", world_size=2, fsdp_version=1, fsdp_strategy="FULL_SHARD")
    for engine in (fsdp1_engine, None):  # FSDP1; FSDP2's division where its replay does not run (no engine)
        fsdp1 = estimate(gpt2_model(), engine=engine, shard="fsdp", world_size=2, micro_batch_size=2, seq_len=16,
                         optim="adamw_torch", device="cuda", gpu="T4")
        process = replay(replayed[-1])
        assert fsdp1.peak_bytes < process.peak_allocated
        assert fsdp1.reserved_bytes == fsdp1.peak_bytes + process.peak_reserved - process.peak_allocated
        assert fsdp1.device_bytes is not None and fsdp1.fits is True
        label = "FSDP1" if engine is not None else "FSDP2"
        assert any(note.startswith("CUDA reserve per rank") and f"{label}'s shares" in note for note in fsdp1.notes)
    notes: list[str] = []
    assert cuda_step_reserve([replayed[-1]], peak=zero.peak_bytes, extrapolated=False, world_size=2, shard="zero2",
                             held_bytes=0, notes=notes, gpu=gpu_spec("T4"))[0] is None  # no engine hook
    assert any("not the rank's" in note for note in notes)


def test_the_reserve_of_an_extrapolated_depth_carries_the_deeper_gap():
    step = [("w", 12 * MiB), ("a", 3 * MiB), ("a", 0)]
    assert predict_reserved([step]) == 32 * MiB
    assert predict_reserved([step, step], extrapolated_peak=100 * MiB) == 117 * MiB
    # the workspace first: its 20 MiB segment keeps 12 MiB free, where w fits; a needs a segment of its own
    assert predict_reserved([step], workspace=8 * MiB) == 40 * MiB


def test_the_plan_is_made_against_the_predicted_reserve():
    """A CUDA estimate's reserve above its allocated peak becomes the plan's margin; none on the CPU."""
    from transformers import GPT2Config

    from hf_memwatch.estimation.estimate import estimate
    from hf_memwatch.planning.budget import Budget, with_predicted_reserve

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)
    cuda = estimate(config, task="causal-lm", micro_batch_size=2, seq_len=32, device="cuda")
    budget = Budget(total=cuda.reserved_bytes, margin=0, source="user budget")
    planned = with_predicted_reserve(budget, cuda)
    assert planned.usable == pytest.approx(cuda.peak_bytes, rel=1e-6)  # the step's allocated peak just fits
    cpu = estimate(config, task="causal-lm", micro_batch_size=2, seq_len=32, device="cpu")
    assert with_predicted_reserve(budget, cpu) == budget


def test_an_extrapolated_reserve_says_its_gap_is_carried_from_the_short_depth():
    """Depth extrapolation keeps peak allocated exact but carries the short depth's cache gap (published
    configurations: -7.8%..+6.0% of the full-depth replay's reserve): the estimate says so, a full replay not."""
    from transformers import LlamaConfig

    from hf_memwatch import estimate
    from hf_memwatch.estimation.cuda_device import EXTRAPOLATED_RESERVE_NOTE

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512)
    kwargs = dict(micro_batch_size=2, seq_len=64, device="cuda", activation_checkpointing=True)
    short = estimate(config, extrapolate_layers=True, **kwargs)
    full = estimate(config, extrapolate_layers=False, **kwargs)
    assert EXTRAPOLATED_RESERVE_NOTE in short.notes and EXTRAPOLATED_RESERVE_NOTE not in full.notes
    assert short.peak_bytes == full.peak_bytes and short.reserved_bytes is not None
