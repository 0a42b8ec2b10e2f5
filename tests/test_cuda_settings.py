"""The caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``) and size rules against torch 2.13's
``c10/core/AllocatorConfig`` and ``c10/cuda/CUDACachingAllocator.cpp`` (pure, CPU)."""

from __future__ import annotations

from hf_memwatch.estimation.cuda_settings import AllocatorConfig, MiB, round_size

KiB = 1 << 10


def test_roundup_power2_divisions():
    """round_size / roundup_power2_next_division: 1200 KiB in the 1-2 MiB interval's quarters."""
    assert round_size(1200 * KiB, divisions=4) == 1280 * KiB  # 1 MiB .. 2 MiB in quarters
    assert round_size(1200 * KiB) == 1200 * KiB
    config = AllocatorConfig.parse("roundup_power2_divisions:4")  # the single number: every interval
    assert {config.divisions(n * MiB) for n in (1, 64, 2048)} == {4}
    assert round_size(1200 * KiB, config) == 1280 * KiB


def test_roundup_power2_divisions_per_size_interval():
    """AcceleratorAllocatorConfig::roundup_power2_divisions(size) and parseRoundUpPower2Divisions: one
    interval per power of two from 1 MiB; the first value also below it, ``>`` after the last named one
    (the expectations of c10/test/core/AllocatorConfig_test.cpp)."""
    config = AllocatorConfig.parse("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]")
    assert [config.divisions(n * MiB) for n in (32, 64, 128, 256, 512, 1024, 2048, 8192)] == [8, 8, 2, 4, 2, 4, 1, 1]
    gaps = AllocatorConfig.parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]")
    assert [gaps.divisions(n * MiB) for n in (64, 128, 256, 512, 1024, 2048, 4096)] == [8, 8, 16, 1, 0, 8, 2]
    # the interval decides the step: 300 MiB in [256, 512) by 4 -> 320; 100 MiB in [64, 128) by 8 -> 104
    assert round_size(300 * MiB + 1, config) == 320 * MiB
    assert round_size(100 * MiB + 1, config) == 104 * MiB
    assert round_size(3000 * MiB + 1, config) == 3000 * MiB + 512  # [2048, 4096) by 1: only the 512 B rounding


def test_the_settings_are_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    assert AllocatorConfig.from_env() == AllocatorConfig(max_split_size=64 * MiB, expandable_segments=True)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert AllocatorConfig.from_env() == AllocatorConfig()
