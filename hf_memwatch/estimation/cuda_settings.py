"""The caching allocator's settings and sizes: ``PYTORCH_CUDA_ALLOC_CONF`` and the block and segment sizes.

The constants and size rules of ``c10/cuda/CUDACachingAllocator.cpp`` (read at pytorch/pytorch
``001074d2``) and the settings of torch 2.13's ``c10/core/AllocatorConfig.h``
(``AcceleratorAllocatorConfig``: ``large_segment_size``, ``max_split_size``,
``max_non_split_rounding_size``, the per-interval ``roundup_power2_divisions``,
``garbage_collection_threshold``, ``use_expandable_segments``), parsed as its ``parseArgs`` does and
checked against ``c10/test/core/AllocatorConfig_test.cpp``. The replay that uses them is
:mod:`hf_memwatch.estimation.cuda_allocator`.

Example:
    >>> round_size(1200 * 1024, AllocatorConfig.parse("roundup_power2_divisions:4")) // 1024
    1280
    >>> allocation_size(3 * MiB) // MiB, allocation_size(3 * MiB, large_segment_size=32 * MiB) // MiB
    (20, 32)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

MiB = 1 << 20
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: every block is a multiple of it
K_SMALL_SIZE = 1 * MiB  # kSmallSize: largest request served by the small pool
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: the small pool's segment size
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: requests (1, 10) MiB get a large_segment_size segment
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer: large_segment_size's and max_non_split_rounding_size's default
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: larger requests are rounded up to it
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB .. 64 GiB, one per power of two
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` settings that change what is reserved.

    ``roundup_power2_divisions``: the divisions of each of the 16 size intervals (0: none).

    Example:
        >>> c = AllocatorConfig.parse("max_split_size_mb:128,expandable_segments:True,roundup_power2_divisions:[2:4,>:2]")
        >>> c.max_split_size // MiB, c.expandable_segments, c.divisions(MiB), c.divisions(2 * MiB), c.divisions(5 * MiB)
        (128, True, 4, 4, 2)
    """

    max_split_size: int | None = None  # bytes; None: unlimited (torch's default, SIZE_MAX)
    expandable_segments: bool = False
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    max_non_split_rounding: int = K_LARGE_BUFFER  # max_non_split_rounding_mb
    large_segment_size: int = K_LARGE_BUFFER  # large_segment_size_mb
    garbage_collection_threshold: float = 0.0

    @classmethod
    def parse(cls, text: str | None) -> AllocatorConfig:
        """From the text of ``PYTORCH_CUDA_ALLOC_CONF`` (``key:value`` pairs, comma-separated; a list
        value in brackets); keys that do not change the reserve are ignored."""
        values: dict[str, object] = {}
        for key, value in re.findall(r"(\w+)\s*:\s*(\[[^\]]*\]|[^,]*)", text or ""):
            value = value.strip()
            try:
                if key == "max_split_size_mb":
                    values["max_split_size"] = int(float(value) * MiB)
                elif key == "max_non_split_rounding_mb":
                    values["max_non_split_rounding"] = int(float(value) * MiB)
                elif key == "large_segment_size_mb":
                    values["large_segment_size"] = int(float(value) * MiB)
                elif key == "expandable_segments":
                    values["expandable_segments"] = value.lower() == "true"
                elif key == "garbage_collection_threshold":
                    values["garbage_collection_threshold"] = float(value)
                elif key == "roundup_power2_divisions":
                    values["roundup_power2_divisions"] = _parse_divisions(value)
            except ValueError:
                continue  # torch refuses it at start-up; the replay keeps the default
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls) -> AllocatorConfig:
        """This process's settings (``PYTORCH_CUDA_ALLOC_CONF``, else ``PYTORCH_ALLOC_CONF``)."""
        return cls.parse(next((os.environ[v] for v in ALLOC_CONF_VARIABLES if os.environ.get(v)), None))

    def divisions(self, size: int) -> int:
        """``roundup_power2_divisions(size)``: the divisions of the interval ``size`` falls in."""
        index = max(0, min(size.bit_length() - 1 - 20, ROUNDUP_INTERVALS - 1))
        return self.roundup_power2_divisions[index]


def _parse_divisions(value: str) -> tuple[int, ...]:
    """``parseRoundUpPower2Divisions``: one number for every interval, or ``[MiB:N,...,>:N]``."""
    if not value.startswith("["):
        return (_power_of_two(int(value)),) * ROUNDUP_INTERVALS
    divisions = [0] * ROUNDUP_INTERVALS
    last, first = 0, True
    for bound, number in re.findall(r"([>\d]+)\s*:\s*(\d+)", value):
        number = _power_of_two(int(number))
        if bound == ">":
            divisions[last + 1:] = [number] * (ROUNDUP_INTERVALS - last - 1)
            continue
        index = min(_power_of_two(int(bound)).bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            divisions[:index] = [number] * index
            first = False
        divisions[index], last = number, index
    return tuple(divisions)


def _power_of_two(n: int) -> int:
    if n and n & (n - 1):
        raise ValueError(f"{n} is not a power of 2")
    return n


def cuda_blocks(nbytes: int) -> int:
    """``nbytes`` as the caching allocator hands it out: up to a multiple of ``kMinBlockSize`` (512 B), 0 for 0.

    Example:
        >>> cuda_blocks(0), cuda_blocks(1), cuda_blocks(513)
        (0, 512, 1024)
    """
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE if nbytes > 0 else 0


def round_size(size: int, divisions: int | AllocatorConfig = 1) -> int:
    """``round_size``: the block size a request of ``size`` bytes gets (``divisions``: those of the
    request's interval, or the settings to read them from).

    Example:
        >>> round_size(1), round_size(513), round_size(1536), round_size(1200 * 1024, divisions=4)
        (512, 1024, 1536, 1310720)
    """
    if isinstance(divisions, AllocatorConfig):
        divisions = divisions.divisions(size)
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * -(-size // K_MIN_BLOCK_SIZE)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: ``size`` up to the next of ``divisions`` steps between powers of 2."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def allocation_size(size: int, large_segment_size: int = K_LARGE_BUFFER) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc`` reserves for a rounded request none fits.

    Example:
        >>> [allocation_size(n) // MiB for n in (512, MiB, MiB + 512, 10 * MiB, 10 * MiB + 1)]
        [2, 2, 20, 10, 12]
    """
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment_size
    return K_ROUND_LARGE * -(-size // K_ROUND_LARGE)
