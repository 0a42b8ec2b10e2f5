"""The GPU a CUDA estimate is for: memory and compute capability, the inputs of every architecture choice.

A CUDA target's step depends on the card: which SDPA kernel ``sdp_utils`` picks (flash needs sm80+,
cuDNN attention is preferred on sm90+), the cuBLAS workspace torch sizes per architecture, whether the
run ``fits``. :func:`gpu_spec` names one card of :data:`GPUS`; :func:`local_gpu` reads the card this
process sees (``None`` without CUDA). An estimate without a GPU named and without one at hand assumes
:data:`DEFAULT_GPU` and says so in its notes.

``memory`` is the card's total as the driver reports it (``cudaMemGetInfo``'s total, nvidia-smi's
"Total" in MiB), which is a little under the marketed size (an "80 GB" H100 reports 81,559 MiB).

Example:
    >>> spec = gpu_spec("a100-40gb")
    >>> spec.name, spec.capability, spec.memory >> 20
    ('A100-40GB', (8, 0), 40960)
    >>> gpu_spec("H100") is gpu_spec("h100-80gb")
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import MemWatchConfigError

MiB = 1 << 20


@dataclass(frozen=True)
class GpuSpec:
    """One CUDA card: its name, total memory (bytes, as the driver reports it), compute capability."""

    name: str
    memory: int
    capability: tuple[int, int]
    aliases: tuple[str, ...] = ()

    @property
    def sm(self) -> int:
        """The capability as one number, ``sm_90`` → 90."""
        return self.capability[0] * 10 + self.capability[1]


# nvidia-smi's "Total" (MiB) on each card, as its users print it; capability from NVIDIA's CUDA GPUs table.
GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("H200", 143_771 * MiB, (9, 0), ("h200-141gb",)),
    GpuSpec("H100-80GB", 81_559 * MiB, (9, 0), ("h100", "h100-sxm", "h100-pcie")),
    GpuSpec("A100-80GB", 81_920 * MiB, (8, 0), ("a100-80g",)),
    GpuSpec("A100-40GB", 40_960 * MiB, (8, 0), ("a100", "a100-40g")),
    GpuSpec("L4", 23_034 * MiB, (8, 9), ()),
    GpuSpec("A10G", 23_028 * MiB, (8, 6), ("a10",)),
    GpuSpec("RTX-4090", 24_564 * MiB, (8, 9), ("4090", "rtx4090")),
    GpuSpec("RTX-3090", 24_576 * MiB, (8, 6), ("3090", "rtx3090")),
    GpuSpec("T4", 15_360 * MiB, (7, 5), ()),
    GpuSpec("V100-16GB", 16_160 * MiB, (7, 0), ("v100", "v100-16g")),
    GpuSpec("V100-32GB", 32_510 * MiB, (7, 0), ("v100-32g",)),
)
DEFAULT_GPU = "H100-80GB"

_BY_NAME = {key: spec for spec in GPUS for key in (spec.name.lower(), *spec.aliases)}


def gpu_spec(name: str) -> GpuSpec:
    """The card named ``name`` (case-insensitive, spaces and underscores as dashes); one clear error else."""
    key = str(name).strip().lower().replace(" ", "-").replace("_", "-")
    key = key.removeprefix("nvidia-").removeprefix("geforce-")
    spec = _BY_NAME.get(key)
    if spec is None:
        raise MemWatchConfigError(f"unknown GPU {name!r}; choose one of {', '.join(s.name for s in GPUS)}")
    return spec


def local_gpu(index: int | None = None) -> GpuSpec | None:
    """The card this process sees (``None`` without CUDA): its own name, memory and capability as
    ``torch.cuda.get_device_properties`` reports them."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return GpuSpec(props.name, int(props.total_memory), (props.major, props.minor))


def target_gpu(name: str | GpuSpec | None) -> tuple[GpuSpec, str | None]:
    """The card a CUDA estimate is for, and a note when it was assumed: ``name`` when given, else the
    local card, else :data:`DEFAULT_GPU` (noted)."""
    if isinstance(name, GpuSpec):
        return name, None
    if name is not None:
        return gpu_spec(name), None
    local = local_gpu()
    if local is not None:
        return local, None
    spec = gpu_spec(DEFAULT_GPU)
    return spec, f"no GPU here and none named: assumed {spec.name} (sm_{spec.sm}, {spec.memory / (1 << 30):.1f} GiB); " \
                 "pass gpu= / --gpu"


def gpu_record(spec: GpuSpec) -> dict[str, object]:
    """The card as an estimate's ``config["gpu"]`` records it.

    Example:
        >>> gpu_record(gpu_spec("T4"))
        {'name': 'T4', 'memory': 16106127360, 'capability': [7, 5]}
    """
    return {"name": spec.name, "memory": spec.memory, "capability": list(spec.capability)}


def card_fits(spec: GpuSpec | None, reserved: int | None, device: int | None, notes: list[str]) -> bool | None:
    """A CUDA estimate's ``fits`` without a budget: the step's highest on the card against its memory.

    The device total (``device``: reserved + the CUDA context — measured on this machine's card, else
    the published measurement of ``estimation.cuda_device.PUBLISHED_CONTEXTS`` — + NCCL buffers) when
    known; else the caching allocator's predicted reserve alone, noted; None when neither is predicted
    (FSDP1's sharded states). The card's memory is the driver's total (:class:`GpuSpec`).

    Example:
        >>> notes = []
        >>> card_fits(gpu_spec("T4"), 2 << 30, None, notes), len(notes)
        (True, 1)
        >>> card_fits(gpu_spec("T4"), 2 << 30, 16 << 30, [])
        False
    """
    if spec is None or (reserved is None and device is None):
        return None
    if device is not None:
        return device <= spec.memory
    notes.append(f"fits: the predicted reserve against the {spec.name}'s {spec.memory / (1 << 30):.1f} GiB, "
                 "without the CUDA context (measured only where a CUDA device is at hand)")
    return reserved <= spec.memory
