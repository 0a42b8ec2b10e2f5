"""What CUDA libraries allocate through the caching allocator for a CUDA target, by the target's card.

* **cuBLAS workspaces** (torch 2.13, ``aten/src/ATen/cuda/CublasHandlePool.cpp``): every GEMM takes the
  thread's cuBLAS handle (``getCurrentCUDABlasHandle``: one handle per thread from
  ``DeviceThreadHandlePool``), and ``setWorkspaceForHandle`` allocates one workspace per (handle, stream)
  through the caching allocator, kept for the process's life. Its size is ``getChosenWorkspaceSize`` ->
  ``parseChosenWorkspaceSize``: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs, KiB, summed) when set,
  else ``4096 * 1024 * 2 + 16 * 1024 * 8`` = 8,519,680 B, or 32 MiB on compute capability 9.x, 10.x and 12.x
  (Hopper, Blackwell). cuBLASLt shares that workspace (``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` unset or 1:
  ``getCUDABlasLtWorkspace`` looks up the cuBLAS map); with it set to 0, Lt keeps its own per (handle,
  stream) of ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024), counted here for every thread as a biased
  ``Linear`` runs through Lt (``gemm_and_bias``). A training step runs GEMMs on two threads on the one
  stream — the forward on the Python thread, the backward on the autograd engine's device thread — so it
  holds two workspaces from its first backward on (:func:`cublas_workspaces`: registered at the replay's
  start, after the weights, named ``cublas_workspace`` in the ``other`` class; the CUDA reserve
  prediction replays them with the step's allocations).
* **bitsandbytes' 4-bit GEMM on CUDA** (bitsandbytes 0.50, ``backends/cuda/ops.py``, the ``gemm_4bit``
  CUDA kernel registration): with M = rows of the input, past ``_gemm_4bit_custom_max_m`` (1536) or with
  K not a multiple of the block size it runs ``_dequant_linear_fallback`` — the dequantized weight
  (``torch.empty(shapeB, A.dtype)``, and with double quantization ``absmax_dq`` and ``absmax_dq +
  absmax_offset`` in fp32) then ``F.linear``; below, ``_gemm_4bit_use_custom_cuda`` decides by M, N, K,
  the dtype and the card (compute capability, SM count): the fused kernel ``_gemm_4bit_kernel_impl``
  allocates ``A.contiguous()`` and the output only, no dequantized weight. bitsandbytes' own heuristic is
  run (:func:`bnb_gemm_4bit_cuda`; compiled from the installed source, whose module a CPU build cannot
  import), with the card's properties in place of the device query. Unknown SM
  count (a card outside :data:`SM_COUNTS` and not the local one): the fallback, as for a CPU target.
  The backward (``MatMul4Bit.backward``) dequantizes on every device: the same Python code, replayed as is.
* **bitsandbytes' optimizer steps on CUDA** (0.50, ``backends/cuda/ops.py``: ``_optimizer_update_8bit_blockwise_impl``,
  ``_optimizer_update_32bit_impl``) pass the tensors' pointers to one C kernel that updates the weight and
  the states in place: nothing is allocated. Their CPU kernels dequantize both states and build the update
  in fp32 (5 x 4 B per element of the parameter), which a CPU target's replay counts; a CUDA target's
  replays the registered fake kernels (:class:`~hf_memwatch.estimation.fake_dispatch.EstimateTracker`).

Example:
    >>> from hf_memwatch.core.gpus import gpu_spec
    >>> cublas_workspace_size(gpu_spec("T4"), {}), cublas_workspace_size(gpu_spec("H100"), {}) >> 20
    (8519680, 32)
    >>> cublas_workspace_size(gpu_spec("A100"), {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"})
    8519680
"""

from __future__ import annotations

import functools
import os
import re
import types
from collections.abc import Mapping
from typing import Any

import torch

from ..compat.torch_internals import tensor_storage_key

CUBLAS_WORKSPACE = "cublas_workspace"
# GEMM threads of a training step on one stream: the Python thread (forward), the autograd device thread (backward)
GEMM_THREADS = 2
# Streaming multiprocessors per card of core.gpus.GPUS (NVIDIA's data sheets): bitsandbytes' 4-bit
# routing reads them (``torch.cuda.get_device_properties().multi_processor_count``).
SM_COUNTS = {"H200": 132, "H100-80GB": 132, "A100-80GB": 108, "A100-40GB": 108, "L4": 58, "A10G": 80,
             "RTX-4090": 128, "RTX-3090": 82, "T4": 40, "V100-16GB": 80, "V100-32GB": 80}
BNB_CUSTOM_MAX_M = 1536  # bitsandbytes 0.50 ``_gemm_4bit_custom_max_m`` on CUDA


def cublas_workspace_size(gpu: Any, environ: Mapping[str, str] | None = None) -> int:
    """``getChosenWorkspaceSize`` for ``gpu`` (a :class:`~hf_memwatch.core.gpus.GpuSpec`): see the module doc."""
    env = os.environ if environ is None else environ
    default = 4096 * 8 * 1024 if gpu.capability[0] in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        return default  # torch warns "Could not parse CUBLAS_WORKSPACE_CONFIG" and takes the default
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def cublaslt_own_workspace_size(environ: Mapping[str, str] | None = None) -> int:
    """cuBLASLt's own workspace per (handle, stream): 0 when unified with cuBLAS' (the default)."""
    env = os.environ if environ is None else environ
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE") != "0":  # c10::utils::check_env: "0" is false
        return 0
    try:
        return int(env.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
    except ValueError:
        return 1024 * 1024


def cublas_workspaces(tracker: Any) -> list[torch.Tensor]:
    """The step's cuBLAS (and cuBLASLt) workspaces as fake tensors, for a CUDA target (``tracker.gpu``);
    none for a CPU target. Call inside the replay's fake mode and tracker; keep the tensors alive."""
    gpu = getattr(tracker, "gpu", None)
    if gpu is None:
        return []
    sizes = [cublas_workspace_size(gpu), cublaslt_own_workspace_size()]
    held = [torch.empty(size, dtype=torch.uint8) for size in sizes if size > 0 for _ in range(GEMM_THREADS)]
    name_held(tracker, held, CUBLAS_WORKSPACE)
    return held


def name_held(tracker: Any, tensors: list[torch.Tensor], name: str) -> None:
    """Name ``tensors``' storages ``name`` in the estimate's details."""
    live = tracker.live_refs()
    for tensor in tensors:
        key = tensor_storage_key(tensor)
        if key in live:
            tracker.named[id(live[key])] = (live[key], name)


# -- bitsandbytes' 4-bit GEMM -----------------------------------------------------------------
def sm_count(gpu: Any) -> int | None:
    """``gpu``'s SM count: the local card's own when it is the one, else :data:`SM_COUNTS` (None: unknown)."""
    if gpu.name in SM_COUNTS:
        return SM_COUNTS[gpu.name]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        if props.name == gpu.name:
            return int(props.multi_processor_count)
    return None


@functools.cache
def _bnb_cuda_routing() -> tuple[Any, int] | None:
    """bitsandbytes' own ``_gemm_4bit_use_custom_cuda`` and ``_gemm_4bit_custom_max_m``, compiled from the
    installed ``bitsandbytes/backends/cuda/ops.py`` (that module binds the CUDA library's symbols on import,
    so a CPU build cannot import it); None without bitsandbytes or where its source differs."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "backends" / "cuda" / "ops.py"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None
    names = {"_gemm_4bit_use_custom_cuda", "_GEMM_4BIT_CUSTOM_FLOOR_M", "_gemm_4bit_custom_max_m"}
    kept: list[ast.stmt] = []
    for node in tree.body:
        # the CUDA branch of ``if torch.version.hip is None:`` holds the CUDA maximum
        body = node.body if isinstance(node, ast.If) and "hip is None" in ast.unparse(node.test) else [node]
        for stmt in body:
            if isinstance(stmt, ast.FunctionDef) and stmt.name in names:
                stmt.decorator_list = []  # functools.cache'd there
                kept.append(stmt)
            elif isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) in names for t in stmt.targets):
                kept.append(stmt)
    scope: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=kept, type_ignores=[]), str(path), "exec"), scope)  # noqa: S102 - bnb's own code
    if "_gemm_4bit_use_custom_cuda" not in scope or "_gemm_4bit_custom_max_m" not in scope:
        return None
    return scope["_gemm_4bit_use_custom_cuda"], int(scope["_gemm_4bit_custom_max_m"])


@functools.cache
def _custom_heuristic(sms: int, major: int, minor: int) -> Any:
    """bitsandbytes' ``_gemm_4bit_use_custom_cuda`` with the card's properties answering its device query."""
    routing = _bnb_cuda_routing()
    if routing is None:
        return None
    function = routing[0]
    scope = dict(function.__globals__, _gpu_dispatch_props=lambda _index: (sms, major, minor))
    return types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__)


def custom_max_m() -> int:
    """bitsandbytes' ``_gemm_4bit_custom_max_m`` on CUDA (1536 in 0.50)."""
    routing = _bnb_cuda_routing()
    return BNB_CUSTOM_MAX_M if routing is None else routing[1]


def uses_custom_kernel(gpu: Any, dtype: torch.dtype, m: int, n: int, k: int, blocksize: int) -> bool | None:
    """Whether bitsandbytes' CUDA ``gemm_4bit`` runs its fused kernel (no dequantized weight) on ``gpu``;
    None when the card's SM count is unknown and M is in the range where it decides."""
    if m > custom_max_m() or k % blocksize != 0:
        return False
    sms = sm_count(gpu)
    heuristic = None if sms is None else _custom_heuristic(sms, *gpu.capability)
    if heuristic is None:
        return None
    return bool(heuristic(0, dtype, m, n, k))


def bnb_gemm_4bit_cuda(gpu: Any) -> Any:
    """``bitsandbytes::gemm_4bit`` as its CUDA kernel allocates on ``gpu`` (module doc); None: undecided."""

    def gemm_4bit(A: torch.Tensor, B: torch.Tensor, shapeB: Any, absmax: torch.Tensor, blocksize: int,
                  quant_type: str, bias: torch.Tensor | None = None, absmax_8bit: torch.Tensor | None = None,
                  absmax_code: torch.Tensor | None = None, absmax_offset: torch.Tensor | None = None) -> torch.Tensor:
        k = A.shape[-1]
        m, n = A.numel() // k, shapeB[0]
        custom = uses_custom_kernel(gpu, A.dtype, m, n, k, blocksize)
        if custom:  # _gemm_4bit_kernel_impl
            A = A.contiguous()
            if absmax_offset is not None:
                absmax_offset = absmax_offset.to(dtype=torch.float32)
            return torch.empty((*A.shape[:-1], n), dtype=A.dtype, device=A.device)
        # _dequant_linear_fallback (the kernels write into these buffers)
        scales = None  # alive to the return, as the fallback's locals are
        if absmax_8bit is not None:
            absmax_dq = torch.empty_like(absmax_8bit, dtype=torch.float32)
            scales = (absmax_dq, absmax_dq + absmax_offset)
        weight = torch.empty(tuple(shapeB), dtype=A.dtype, device=A.device)
        out = torch.nn.functional.linear(A, weight, bias)
        del scales, weight
        return out

    return gemm_4bit
