"""SDPA on a CUDA target as torch 2.13 runs it: the backend ``sdp_utils`` picks, what it saves and allocates.

The replay runs on fake CPU tensors, where ``F.scaled_dot_product_attention`` takes the CPU flash
kernel, which refuses ``dropout_p > 0`` and then falls to the math path (fp32 upcast, the whole
attention matrix kept for backward): +185% … +248% on a GPT-2-large-sized benchmark. Here instead:

* :func:`sdp_backend`: the backend ``sdp::select_sdp_backend`` picks for the target's compute
  capability (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` with ``sdp_utils_cpp.h``): the
  priority order (cuDNN first on sm 9.x/10.x), then each backend's constraints — flash: sm80-sm121,
  fp16/bf16, no explicit mask, head dim <= 256, GQA; memory-efficient: sm50+, any mask, head dims
  aligned, no GQA; cuDNN: sm80+, dropout a multiple of 1/16, head dim <= 128; math otherwise;
* :func:`cuda_sdpa`: the chosen CUDA op itself (``_scaled_dot_product_flash_attention``,
  ``_efficient_attention``, ``_cudnn_attention``, whose fake kernels and autograd formulas run on fake
  CPU tensors) after the preprocessing ``scaled_dot_product_attention`` (``attention.cpp``) does on
  CUDA; autograd then saves what CUDA's does (the output, the fp32 log-sum-exp — padded to 32 rows by
  the memory-efficient kernel — and the RNG seed and offset), not the attention matrix;
* the kernels' internal buffers (:func:`flash_backward_workspace`, :func:`efficient_backward_workspace`,
  :func:`efficient_forward_workspace`, :func:`cudnn_backward_workspace`), added as transients by the tracker.

Sources: the kernel tables and workspace formulas from the headers torch 2.13 installs
(``mem_eff_attention/kernel_backward.h``, ``kernels/cutlassB.h``, ``kernel_forward.h``,
``sdp_utils_cpp.h``); ``sdp_utils.cpp``, ``attention.cpp``, ``attention_backward.cu`` and
``flash_attn/flash_api.cpp`` from pytorch/pytorch as stored (the memory-efficient backend's refusal of
GQA is the ``check_batch_size_and_num_heads_dense<false>`` of the versions whose template matches 2.13's
header; the cuDNN preference assumes the wheel's cuDNN is newer than 9.15.0).

cuDNN attention's backward workspace: its cuDNN frontend part (:func:`cudnn_backward_workspace`); the engine's
own plan workspace is not modelled (the cuDNN runtime reports it); the split-KV
buffers (decoding only), the memory-efficient backward's shared-memory fit check (the first kernel
``dispatch_cutlassB`` lists that fits the shape is taken), and flash backward's deterministic mode
(``torch.use_deterministic_algorithms``: ``dq_accum`` split per SM group).

Example:
    >>> from hf_memwatch.core.gpus import gpu_spec
    >>> q = torch.empty(2, 12, 1024, 64, dtype=torch.bfloat16, requires_grad=True)
    >>> sdp_backend(gpu_spec("A100"), q, q, q, dropout_p=0.1, is_causal=True)
    'flash_attention'
    >>> sdp_backend(gpu_spec("T4"), q.half(), q.half(), q.half(), dropout_p=0.1, is_causal=True)
    'efficient_attention'
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F

from ..compat.torch_ops import SAFE_SOFTMAX, SDPA_CUDNN, SDPA_EFFICIENT, SDPA_FLASH, cuda_kernels_present
from .cuda_settings import cuda_blocks

aten = torch.ops.aten

FLASH, EFFICIENT, CUDNN, MATH = "flash_attention", "efficient_attention", "cudnn_attention", "math"
HALF = (torch.float16, torch.bfloat16)


def _round(x: int, m: int) -> int:
    return -(-x // m) * m


# -- SDPA backend selection (sdp_utils.cpp, sdp_utils_cpp.h) -----------------------------------

def _requires_grad(*tensors: torch.Tensor) -> bool:
    """``input_requires_grad``: any of q, k, v requires grad and grad mode is on."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _dense_heads_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, supports_gqa: bool,
                    same_kv_heads: bool = True) -> bool:
    """``check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>``."""
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if enable_gqa and supports_gqa:
        if same_kv_heads and hk != hv:
            return False
        return hq % hk == 0 and (same_kv_heads or hq % hv == 0)
    return hq == hk == hv


def _last_dim_stride_1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ignore_singleton: bool) -> bool:
    """``check_last_dim_stride_equals_1_dense`` (a CUDA mask's last stride too)."""
    ok = q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    return ok or (ignore_singleton and q.shape[-1] == 1)


def _mask_shape_ok(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> bool:
    """``check_attn_mask_shape``: 2-D, or 4-D broadcastable over batch and heads; no gradient."""
    if mask is None:
        return True
    if mask.requires_grad:
        return False
    if mask.shape[-2] not in (1, q.shape[2]) or mask.shape[-1] not in (1, k.shape[2]):
        return False
    if mask.dim() == 2:
        return True
    return mask.dim() == 4 and mask.shape[0] in (1, q.shape[0]) and mask.shape[1] in (1, q.shape[1])


def _same_dtype(dtypes: tuple[torch.dtype, ...], *tensors: torch.Tensor) -> bool:
    """``check_tensor_dtype``: q, k, v of one dtype among ``dtypes``."""
    return len({t.dtype for t in tensors}) == 1 and tensors[0].dtype in dtypes


def can_use_flash(sm: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout_p: float,
                  is_causal: bool, enable_gqa: bool) -> bool:
    """``can_use_flash_attention`` (dense inputs): sm80-sm121, fp16/bf16 (FA3's fp8 only when enabled),
    no explicit mask, equal head dims <= 256, no causal flag with ``Lq != Lk``, GQA allowed; training
    on sm86/89/120/121 only with head dim <= 192 (or > 224 without dropout)."""
    if not torch.backends.cuda.flash_sdp_enabled() or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    d = q.shape[-1]
    if mask is not None or not (d == k.shape[-1] == v.shape[-1] and d <= 256) or not 80 <= sm <= 121:
        return False
    if _requires_grad(q, k, v) and (86 <= sm <= 89 or 120 <= sm <= 121):
        if not (d <= 192 or (dropout_p == 0 and d > 224)):
            return False
    if is_causal and q.shape[-2] != k.shape[-2]:
        return False
    if not _same_dtype(HALF, q, k, v):
        return False
    return (_dense_heads_ok(q, k, v, enable_gqa, supports_gqa=True)
            and q.shape[-2] > 0 and k.shape[-2] > 0 and _last_dim_stride_1(q, k, v, ignore_singleton=True))


def _gemm_alignment(sm: int, dtype: torch.dtype) -> int:
    """``minimum_gemm_alignment``: 4 elements on sm80+, 128 bits on tensor cores (half on sm70+)."""
    half = dtype in HALF
    tensor_cores = sm >= 80 or (sm >= 70 and half)
    align = 4 if sm >= 80 else 1
    return max(align, 128 // (16 if half else 32)) if tensor_cores else align


def can_use_efficient(sm: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                      enable_gqa: bool) -> bool:
    """``can_use_mem_efficient_attention`` (dense): sm50-sm121, head dims aligned to
    ``minimum_gemm_alignment`` (8 elements in fp16/bf16), storage offsets aligned on sm80+, any mask,
    no GQA (``check_batch_size_and_num_heads_dense<false>``), fp16/fp32 (+ bf16 on sm80+)."""
    if not torch.backends.cuda.mem_efficient_sdp_enabled() or not 50 <= sm <= 121:
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    align = _gemm_alignment(sm, q.dtype)
    dq, dv = q.shape[-1], v.shape[-1]
    if not (dq == k.shape[-1] and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return False
    if sm >= 80 and any(t.storage_offset() % align for t in (q, k, v)):
        return False
    if not (q.shape[-2] > 0 and k.shape[-2] > 0 and _last_dim_stride_1(q, k, v, ignore_singleton=False)):
        return False
    if mask is not None and mask.stride(-1) != 1:
        return False
    if not _dense_heads_ok(q, k, v, enable_gqa, supports_gqa=False):
        return False
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if sm >= 80 else (torch.float16, torch.float32)
    return _same_dtype(dtypes, q, k, v)


CUDNN_HEAD_DIM_LIMIT = 128  # check_cudnn_tensor_shapes: head_dim_limit, 192/256 only with newer cuDNN on sm90/sm10x


def can_use_cudnn(sm: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout_p: float,
                  enable_gqa: bool) -> bool:
    """``can_use_cudnn_attention`` (dense): sm80-sm121, fp16/bf16, a 2-D/4-D mask allowed, dropout a
    multiple of 1/16 (``check_cudnn_dropout``: 0.1 is refused), not deterministic, GQA allowed, head dims
    multiples of 8 up to 128, batch and heads <= 65535, key length != 1."""
    if not torch.backends.cuda.cudnn_sdp_enabled() or q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if not (80 <= sm <= 121 and _same_dtype(HALF, q, k, v) and _mask_shape_ok(mask, q, k)):
        return False
    if dropout_p * 16.0 != math.floor(dropout_p * 16.0):
        return False
    if not (q.shape[-2] > 0 and k.shape[-2] > 0 and _last_dim_stride_1(q, k, v, ignore_singleton=True)):
        return False
    if not _dense_heads_ok(q, k, v, enable_gqa, supports_gqa=True, same_kv_heads=False):
        return False
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if q.shape[0] > 65535 or q.shape[1] > 65535 or d_qk > CUDNN_HEAD_DIM_LIMIT or d_v > CUDNN_HEAD_DIM_LIMIT:
        return False
    if d_qk % 8 or d_v % 8 or k.shape[-2] == 1:
        return False
    return not (dropout_p != 0.0 and q.shape[-2] == 1)


def prefers_cudnn(sm: int) -> bool:
    """``check_prefer_cudnn_attention``: cuDNN first on sm 9.x/10.x (CUDA 13 builds) with a runtime cuDNN
    newer than 9.15.0 — the cuDNN the PyPI wheels pin (nvidia-cudnn-cu13 9.x) — unless
    ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is set."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().lower() in ("1", "true", "on", "yes", "y"):
        return False
    return sm // 10 in (9, 10)


def sdp_backend(gpu: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                enable_gqa: bool = False) -> str:
    """The backend ``select_sdp_backend`` picks on ``gpu`` (a GpuSpec): the first of the priority order
    (cuDNN, flash, efficient, math where cuDNN is preferred; else flash, efficient, math, cuDNN) whose
    constraints hold."""
    sm = gpu.sm
    order = (CUDNN, FLASH, EFFICIENT, MATH) if prefers_cudnn(sm) else (FLASH, EFFICIENT, MATH, CUDNN)
    for backend in order:
        if backend == FLASH and can_use_flash(sm, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
            return FLASH
        if backend == EFFICIENT and can_use_efficient(sm, query, key, value, attn_mask, enable_gqa):
            return EFFICIENT
        if backend == CUDNN and can_use_cudnn(sm, query, key, value, attn_mask, dropout_p, enable_gqa):
            return CUDNN
        if backend == MATH and torch.backends.cuda.math_sdp_enabled():
            return MATH
    return MATH


# -- SDPA as CUDA runs it (attention.cpp, scaled_dot_product_attention) ---------------------------

def _convert_boolean_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert_boolean_attn_mask``: a bool mask becomes an additive one in the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), dtype=dtype), torch.full((), float("-inf"), dtype=dtype))


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask``: padded to a multiple of 8 in its last dim when its strides are not aligned
    (``pad_bias<8>``), then expanded to ``[B, H, Lq, Lk]``."""
    if any(mask.stride(i) % 8 for i in range(mask.dim() - 1)) or mask.stride(-1) != 1:
        last = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _autocast_inputs(tensors: list[Any]) -> list[Any]:
    """Under autocast (the replay's CPU autocast standing for CUDA's), SDPA's ``lower_precision_fp``
    policy (``autocast_mode.h``): floating inputs cast to the autocast dtype."""
    if not torch.is_autocast_enabled("cpu"):
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    return [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t
            for t in tensors]


def cuda_sdpa(gpu: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
              scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as CUDA runs it on ``gpu``: the backend :func:`sdp_backend`
    picks, its op called after attention.cpp's preprocessing (flash: head dim padded to 8; efficient:
    the bool mask made additive and aligned; cuDNN: the mask made additive)."""
    query, key, value, attn_mask = _autocast_inputs([query, key, value, attn_mask])
    with torch.autocast("cpu", enabled=False):
        backend = sdp_backend(gpu, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        backend = backend if cuda_kernels_present() else MATH  # compat.torch_ops.CUDA_OPS: warned
        grad = _requires_grad(query, key, value)
        if backend == FLASH:
            d = query.shape[-1]
            if scale is None:
                scale = 1.0 / math.sqrt(d)
            if d % 8:
                query, key, value = (F.pad(t, (0, 8 - d % 8)) for t in (query, key, value))
            out = SDPA_FLASH(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
            return out[..., :d] if d % 8 else out
        mask = _convert_boolean_mask(attn_mask, query.dtype)
        if backend == EFFICIENT:
            if mask is not None:
                mask = _preprocess_mask(mask, query, key)
            return SDPA_EFFICIENT(query, key, value, mask, grad, dropout_p, is_causal, scale=scale)[0]
        if backend == CUDNN:
            return SDPA_CUDNN(query, key, value, mask, grad, dropout_p, is_causal, False, scale=scale)[0]
        return math_sdpa(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)


def math_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """``_scaled_dot_product_attention_math`` (attention.cpp) as on CUDA, op for op: fp16/bf16 inputs
    upcast to fp32, q and k scaled by ``sqrt(scale)``, the causal mask built and made additive, GQA's
    k/v repeated per query head, ``_safe_softmax``, the dropout through ``at::dropout`` — CUDA's fused
    kernel, a bool mask (C++ calls it, so the CPU math op would run the CPU dropout) — then the output
    and the attention weights cast back to the input dtype (the weights returned, dropped by SDPA)."""
    dtype = query.dtype
    if dtype in HALF:
        query, key, value = query.float(), key.float(), value.float()
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
    query = query * (-factor if scale is not None and scale < 0 else factor)
    if is_causal:
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool).tril()
        mask = _convert_boolean_mask(causal, query.dtype)
    if enable_gqa and key.shape[-3] != query.shape[-3]:  # pre_process_group_query_attention_input
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    attn = torch.matmul(query, key.transpose(-2, -1) * factor)
    if mask is not None:
        attn.add_(mask)
    attn = SAFE_SOFTMAX(attn, -1) if SAFE_SOFTMAX is not None else torch.softmax(attn, -1)
    if dropout_p > 0.0:
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    out = torch.matmul(attn, value).to(dtype)
    attn.to(dtype)  # the second output, freed as SDPA returns
    return out


def flash_backward_workspace(args: tuple) -> int:
    """Bytes ``_flash_attention_backward`` (attention_backward.cu) and ``mha_bwd`` (flash_api.cpp)
    allocate beside dq/dk/dv: the output gradient made contiguous, ``softmax_d`` fp32
    ``[B, H, round128(Lq)]``, ``dq_accum`` fp32 ``[B, round128(Lq), H, round32(D)]``, and for GQA
    ``dk_expanded``/``dv_expanded`` ``[B, Lk, H, D]`` in the inputs' dtype."""
    grad_out, query, key = args[0], args[1], args[2]
    b, h, lq, d = query.shape
    lk, hk = key.shape[2], key.shape[1]
    lq_r = _round(lq, 128)
    total = cuda_blocks(4 * b * h * lq_r) + cuda_blocks(4 * b * lq_r * h * _round(d, 32))
    if not grad_out.transpose(1, 2).is_contiguous():
        total += cuda_blocks(grad_out.numel() * grad_out.element_size())
    if hk != h:
        total += 2 * cuda_blocks(b * lk * h * d * query.element_size())
    return total


def cudnn_backward_workspace(args: tuple) -> int:
    """Bytes ``_cudnn_attention_backward`` takes from the caching allocator for its cuDNN graph (MHA.cpp,
    ``run_cudnn_SDP_bprop``: ``CUDACachingAllocator::get()->allocate(mha_graph->get_workspace_size())``),
    the cuDNN frontend's part of it (``CompositeSDPABackwardNode::get_fe_workspace_size_node``, cuDNN >= 9,
    dense, not deterministic): ``dQ_accum`` fp32 ``[B, H, Lq, D]`` and ``softmax_sum`` fp32 ``[B, H, Lq]``,
    one allocation. The engine's own plan workspace comes on top and is known only at run time."""
    query = args[1]
    b, h, lq, d = query.shape
    return cuda_blocks(4 * b * h * lq * d + 4 * b * h * lq)


# dispatch_cutlassB's aligned kernels in order (mem_eff_attention/kernels/cutlassB.h, torch 2.13):
# (kBlockSizeI, kBlockSizeJ, kMaxK, kApplyDropout, kKeysQueriesAlignedToBlockSize, only on cc)
_SM80_HALF = ((64, 64, 32, False, True, ()), (64, 64, 32, False, False, ()), (64, 64, 64, False, True, ()),
              (64, 64, 64, False, False, ()), (128, 64, 96, False, False, (86, 89)),
              (128, 128, 128, False, True, ()), (128, 128, 128, False, False, ()), (64, 64, 128, False, True, ()),
              (64, 64, 128, False, False, ()), (128, 64, 65536, False, False, ()), (64, 64, 65536, False, False, ()),
              (64, 64, 32, True, False, ()), (64, 64, 64, True, False, ()), (128, 128, 128, True, False, ()),
              (64, 64, 128, True, False, ()), (128, 64, 65536, True, False, ()), (64, 64, 65536, True, False, ()))
_SM75_HALF = ((64, 64, 32, False, False, ()), (64, 64, 64, False, False, ()), (128, 64, 128, False, False, ()),
              (64, 64, 128, False, False, ()), (128, 64, 65536, False, False, ()), (64, 64, 65536, False, False, ()),
              (64, 64, 32, True, False, ()), (64, 64, 64, True, False, ()), (128, 64, 128, True, False, ()),
              (64, 64, 128, True, False, ()), (128, 64, 65536, True, False, ()), (64, 64, 65536, True, False, ()))
_SM70_HALF = ((64, 64, 32, False, True, ()), (64, 64, 32, False, False, ()), (64, 64, 64, False, True, ()),
              (64, 64, 64, False, False, ()), (128, 64, 128, False, True, ()), (128, 64, 128, False, False, ()),
              (64, 64, 128, False, True, ()), (64, 64, 128, False, False, ()), (128, 64, 65536, False, False, ()),
              (64, 64, 65536, False, False, ()), (64, 64, 32, True, False, ()), (64, 64, 64, True, False, ()),
              (128, 64, 128, True, False, ()), (64, 64, 128, True, False, ()), (128, 64, 65536, True, False, ()),
              (64, 64, 65536, True, False, ()))
_FLOAT_64 = ((64, 64, 32, False, False, ()), (64, 64, 64, False, False, ()), (64, 64, 128, False, False, ()),
             (64, 64, 65536, False, False, ()), (64, 64, 32, True, False, ()), (64, 64, 64, True, False, ()),
             (64, 64, 128, True, False, ()), (64, 64, 65536, True, False, ()))
_SM80_FLOAT = ((64, 64, 32, False, False, ()), (64, 64, 64, False, False, ()), (128, 64, 128, False, False, ()),
               (64, 64, 128, False, False, ()), (128, 64, 65536, False, False, ()), (64, 64, 65536, False, False, ()),
               (64, 64, 32, True, False, ()), (64, 64, 64, True, False, ()), (128, 64, 128, True, False, ()),
               (64, 64, 128, True, False, ()), (128, 64, 65536, True, False, ()), (64, 64, 65536, True, False, ()))


def _cutlass_kernels(sm: int, half: bool) -> tuple:
    """``dispatch_cutlassB``'s list for the card and dtype."""
    if half:
        return _SM80_HALF if sm >= 80 else _SM75_HALF if sm >= 75 else _SM70_HALF if sm >= 70 else _FLOAT_64
    return _SM80_FLOAT if sm >= 80 else _FLOAT_64


def efficient_backward_kernel(sm: int, half: bool, max_k: int, dropout: bool, m: int, n: int) -> tuple:
    """The first kernel ``_efficient_attention_backward``'s ``launchKernel`` accepts: ``kMaxK >= max K``,
    dropout-capable when dropout is on, block-aligned sequences for the ``seqaligned`` ones."""
    for row in _cutlass_kernels(sm, half):
        bi, bj, kmax, drop, seqaligned, only = row
        if kmax < max_k or (dropout and not drop) or (only and sm not in only):
            continue
        if seqaligned and (m % bi or n % bj):
            continue
        return row
    return _cutlass_kernels(sm, half)[-1]


def efficient_backward_workspace(args: tuple, sm: int) -> int:
    """Bytes ``_efficient_attention_backward`` (attention_backward.cu) allocates beside the gradients:
    the output gradient made contiguous, ``delta`` (fp32 ``[B, H, M]`` when the kernel computes it, else
    ``(grad_out.float() * out.float()).sum(-1)`` on the host) and the kernel's ``workspace_size()``
    (kernel_backward.h): per batch and head, the fp32 dK/dV accumulators when they do not stay in
    registers (``kMaxK > kBlockSizeI`` or fp32) over ``ceil(N / kBlockSizeJ)`` key splits, and the dQ
    accumulator ``GradQTempStorage`` per ``kBlockSizeI x kBlockSizeJ`` tile."""
    grad_out, query, key, value, out = args[0], args[1], args[2], args[3], args[5]
    dropout_p = args[9] if len(args) > 9 else 0.0
    b, h, m, d = query.shape
    n, dv = key.shape[2], value.shape[3]
    half = query.dtype in HALF
    bi, bj, kmax, _, _, _ = efficient_backward_kernel(sm, half, max(d, dv), bool(dropout_p), m, n)
    output_in_rf = half and kmax <= bi
    total = 0
    if not grad_out.transpose(1, 2).is_contiguous():
        total += cuda_blocks(grad_out.numel() * grad_out.element_size())
    if half and (output_in_rf or sm // 10 != 7):  # kKernelComputesDelta
        total += cuda_blocks(4 * b * h * m)
    else:
        copies = 3 if half else 1  # grad_out.float(), out.float(), their product
        total += copies * cuda_blocks(4 * out.numel()) + cuda_blocks(4 * b * h * m)
    splits = -(-n // bj) if sm >= 70 else 1
    accum_kv = not output_in_rf and half
    gk = splits * bj * _round(d, bi) if accum_kv else 0
    gv = splits * bj * _round(dv, bi) if accum_kv else 0
    gq = (-(-m // bi)) * (-(-d // bj)) * (4 + bi * bj) if sm >= 70 or half else 0
    total += cuda_blocks(b * h * _round(gk + gv + gq, 4) * 4)
    return total


def efficient_forward_workspace(args: tuple) -> int:
    """``_efficient_attention_forward``'s fp32 ``output_accum`` (attention.cu): fp16/bf16 with a head dim
    over 128, where the kernel (``32x128_gmem``, ``kMaxK`` 65536) cannot keep the output in registers."""
    query, value = args[0], args[2]
    if query.dtype not in HALF or max(query.shape[-1], value.shape[-1]) <= 128:
        return 0
    return cuda_blocks(4 * query.shape[0] * query.shape[2] * query.shape[1] * value.shape[-1])
