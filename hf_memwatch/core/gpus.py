"""The GPU a CUDA estimate is for: memory and compute capability, the inputs of every architecture choice.

A CUDA target's step depends on the card: which SDPA kernel ``sdp_utils`` picks (flash needs sm80+,
cuDNN attention is preferred on sm90+), the cuBLAS workspace torch sizes per architecture, whether the
run ``fits``. :func:`gpu_spec` names one card of :data:`GPUS`; :func:`local_gpu` reads the card this
process sees (``None`` without CUDA). An estimate without a GPU named and without one at hand assumes
:data:`DEFAULT_GPU` and says so in its notes.

``memory`` is what CUDA gives a process on the card: ``cudaMemGetInfo``'s total, which torch reports as
``get_device_properties().total_memory`` and as the "total capacity" of its out-of-memory message, and
which the caching allocator can never pass. It is less than nvidia-smi's "Total" (``smi_total``) on the
data-centre and recent GeForce cards, by framebuffer the driver keeps for itself (recent drivers list a
"Reserved" line under nvidia-smi -q's "FB Memory Usage"): 265 MiB on a T4, 453 MiB on an H100, 768 MiB on an 80 GB A100 (:data:`GPUS`, each
figure with its source). It moves by tens of MiB between drivers (an 80 GB A100: 79.14 to 79.25 GiB in
the out-of-memory messages of 2025-2026); a card whose CUDA total no source was found for (``published``
False) carries its nvidia-smi total, an upper bound, and an estimate for it says so.

Example:
    >>> spec = gpu_spec("a100-40gb")
    >>> spec.name, spec.capability, spec.memory >> 20, spec.smi_total >> 20
    ('A100-40GB', (8, 0), 40448, 40960)
    >>> gpu_spec("H100") is gpu_spec("h100-80gb")
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import MemWatchConfigError

MiB = 1 << 20


@dataclass(frozen=True)
class GpuSpec:
    """One CUDA card: its name, the memory CUDA gives a process (bytes, ``cudaMemGetInfo``'s total),
    compute capability; nvidia-smi's total (``smi_total``, None for a card read here) and whether the
    CUDA total was published (else ``memory`` is the nvidia-smi total, an upper bound)."""

    name: str
    memory: int
    capability: tuple[int, int]
    aliases: tuple[str, ...] = ()
    smi_total: int | None = None
    published: bool = True

    @property
    def sm(self) -> int:
        """The capability as one number, ``sm_90`` → 90."""
        return self.capability[0] * 10 + self.capability[1]


def _gib(hundredths: int) -> int:
    """A total printed in GiB to two decimals (torch's out-of-memory message), in bytes: 7925 → 79.25 GiB."""
    return hundredths * (1 << 30) // 100


# memory: CUDA's total for a process, from the source after each card (torch's total_memory printed in MB,
# which are MiB; a deviceQuery in bytes; or an out-of-memory message's "total capacity" in GiB, 0.01 GiB =
# 10 MiB); smi_total: nvidia-smi's "Total" as its users print it; capability: NVIDIA's CUDA GPUs table.
GPUS: tuple[GpuSpec, ...] = (
    # ai-bot-pro/achatbot deploy/modal/src/llm/vllm/vlm/skywork_r1v.py @859e216: total_memory=143156MB
    GpuSpec("H200", 143_156 * MiB, (9, 0), ("h200-141gb",), smi_total=143_771 * MiB),
    # thamada/nvidia-smi nvsim/H100SXMx8_deviceQuery.py @03fbe6e: deviceQuery on an "NVIDIA H100 80GB HBM3",
    # driver CUDA 12.7: 85,045,477,376 bytes (vllm-project/vllm#27508's message on an H100: 79.11 GiB)
    GpuSpec("H100-80GB", 85_045_477_376, (9, 0), ("h100", "h100-sxm", "h100-pcie"), smi_total=81_559 * MiB),
    # 79.25 GiB: wbfwonderful/Vad-R1#11 (2026-03, "4 A100 80GB"), HiDream-ai/VAREdit#6 (2025-12),
    # levihsu/OOTDiffusion#235 (2025-03); lianqi1008/Control-GIC#6 (2025-10): 79.14 GiB
    GpuSpec("A100-80GB", _gib(7925), (8, 0), ("a100-80g",), smi_total=81_920 * MiB),
    # 39.50 GiB: TianheWu/CoSeR#10 (2025-01, "one A100" of 40 GB)
    GpuSpec("A100-40GB", _gib(3950), (8, 0), ("a100", "a100-40g"), smi_total=40_960 * MiB),
    # no CUDA total found for an L4: nvidia-smi's, an upper bound
    GpuSpec("L4", 23_034 * MiB, (8, 9), (), smi_total=23_034 * MiB, published=False),
    # meta-pytorch/torchcodec's CUDA decoding tutorial (torch 2.15.0.dev20260909+cu130): total_memory=22587MB
    GpuSpec("A10G", 22_587 * MiB, (8, 6), ("a10",), smi_total=23_028 * MiB),
    # 23.64 GiB: 3DTopia/Phidias-Diffusion#8 (2025-08, a 4090); zai-org/CogVideo#36 (2023-05): 23.68 GiB
    GpuSpec("RTX-4090", _gib(2364), (8, 9), ("4090", "rtx4090"), smi_total=24_564 * MiB),
    # huggingface/transformers docs/source/en/debugging.md: GeForce RTX 3090, total_memory=24268MB
    GpuSpec("RTX-3090", 24_268 * MiB, (8, 6), ("3090", "rtx3090"), smi_total=24_576 * MiB),
    # mryab/efficient-dl-systems week01_intro/seminar.ipynb @5b367a2 (driver 550.54.15): total_memory=15095MB
    # beside nvidia-smi's 15360MiB in the same notebook
    GpuSpec("T4", 15_095 * MiB, (7, 5), (), smi_total=15_360 * MiB),
    # 15.78 GiB: kchengiva/Shift-GCN#34 (a 16 GB V100); nvidia-smi's 16160MiB (transformers' perf guide)
    GpuSpec("V100-16GB", 16_160 * MiB, (7, 0), ("v100", "v100-16g"), smi_total=16_160 * MiB),
    # 31.74 GiB: haotian-liu/LLaVA#812 (V100 x 8)
    GpuSpec("V100-32GB", _gib(3174), (7, 0), ("v100-32g",), smi_total=32_510 * MiB),
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
    return spec, f"no GPU here and none named: assumed {spec.name} (sm_{spec.sm}, {spec.memory / (1 << 30):.2f} GiB " \
                 "for CUDA); pass gpu= / --gpu"


def gpu_record(spec: GpuSpec) -> dict[str, object]:
    """The card as an estimate's ``config["gpu"]`` records it.

    Example:
        >>> gpu_record(gpu_spec("T4"))
        {'name': 'T4', 'memory': 15828254720, 'capability': [7, 5]}
    """
    return {"name": spec.name, "memory": spec.memory, "capability": list(spec.capability)}


def card_fits(spec: GpuSpec | None, reserved: int | None, device: int | None, notes: list[str]) -> bool | None:
    """A CUDA estimate's ``fits`` without a budget: the step's highest on the card against its memory.

    The device total (``device``: reserved + the CUDA context — measured on this machine's card, else
    the published measurement of ``estimation.cuda_device.PUBLISHED_CONTEXTS`` — + NCCL buffers) when
    known; else the caching allocator's predicted reserve alone, noted; None when neither is predicted
    (FSDP1's sharded states). The card's memory is CUDA's total (:class:`GpuSpec`), not nvidia-smi's: a
    step of 15,200 MiB on a T4 is under nvidia-smi's 15,360 MiB and over the 15,095 MiB CUDA gives.

    Example:
        >>> notes = []
        >>> card_fits(gpu_spec("T4"), 2 << 30, None, notes), len(notes)
        (True, 1)
        >>> card_fits(gpu_spec("T4"), 2 << 30, 15_200 * MiB, [])
        False
        >>> notes = []
        >>> card_fits(gpu_spec("L4"), 2 << 30, 3 << 30, notes), notes[0][:40]
        (True, "fits: the L4's CUDA total is not publish")
    """
    if spec is None or (reserved is None and device is None):
        return None
    if not spec.published:
        notes.append(f"fits: the {spec.name}'s CUDA total is not published; against its nvidia-smi total, "
                     f"{spec.memory / (1 << 30):.2f} GiB, an upper bound (the driver keeps 265-768 MiB of the "
                     "other cards for itself: core.gpus.GPUS)")
    if device is not None:
        return device <= spec.memory
    notes.append(f"fits: the predicted reserve against the {spec.name}'s {spec.memory / (1 << 30):.1f} GiB, "
                 "without the CUDA context (measured only where a CUDA device is at hand)")
    return reserved <= spec.memory
