"""What a CUDA process holds on its device outside the caching allocator, measured once per device.

``torch.cuda.mem_get_info`` counts the whole device; ``memory_reserved`` the caching allocator's
segments. The difference, read at start, is what the process holds beside them — the CUDA context
(driver state, the kernels of torch and its libraries as they load, typically 0.3-1 GiB) and the
cuBLAS/cuDNN handles — plus whatever *other processes* hold on a shared device. One bf16 matmul is
run first so that cuBLAS is initialised: its workspace is allocated *through* the caching allocator
(torch 2.x: ``getCurrentCUDABlasHandle`` workspaces), so it is read as the allocated bytes the matmul
leaves behind, and counted by the reserve prediction as a block the run holds from its first matmul.

On a machine without CUDA nothing is measured: every figure is ``None`` (the estimate then says the
device total is unknown rather than guessing it).

Example:
    >>> cuda_overheads("cpu") is None
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MEASURED: dict[int, CudaOverheads] = {}


@dataclass(frozen=True)
class CudaOverheads:
    """Bytes this process holds on one CUDA device beyond its tensors (measured, see the module doc)."""

    context: int  # mem_get_info's used bytes minus memory_reserved: the context, handles, other processes
    cublas_workspace: int  # allocated bytes one matmul leaves in the caching allocator
    total_memory: int  # the device's memory (mem_get_info's total)


def cuda_overheads(device: torch.device | str | int | None = None) -> CudaOverheads | None:
    """The overheads of ``device`` (default: the current CUDA device), measured on the first call."""
    if isinstance(device, str) and not device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return None
    try:
        index = torch.device("cuda", torch.cuda.current_device()) if device in (None, "cuda") else torch.device(device)
        key = index.index if index.index is not None else torch.cuda.current_device()
        if key not in _MEASURED:
            _MEASURED[key] = _measure(torch.device("cuda", key))
        return _MEASURED[key]
    except (RuntimeError, AssertionError, ValueError):  # an unusable device: say unknown, never fail
        return None


def _measure(device: torch.device) -> CudaOverheads:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    a = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    del a
    torch.cuda.synchronize(device)
    workspace = max(0, torch.cuda.memory_allocated(device) - before)
    free, total = torch.cuda.mem_get_info(device)
    context = max(0, total - free - torch.cuda.memory_reserved(device))
    return CudaOverheads(context=context, cublas_workspace=workspace, total_memory=total)
