"""The CUDA kernel paths of a CUDA target, replayed on fake CPU tensors (torch 2.13's source).

A CUDA target is replayed on fake CPU tensors (fake CUDA tensors need a CUDA build), so ATen takes
its CPU paths wherever the choice depends on the device. Here the paths CUDA takes instead, each
from torch's source:

* **Fused dropout** (:func:`fused_dropout`): ``at::native::dropout`` (``aten/src/ATen/native/Dropout.cpp``)
  calls ``native_dropout`` when ``is_fused_kernel_acceptable`` (input on CUDA, ``0 < p < 1``,
  ``numel > 0``) in training; its autograd saves a 1-byte bool mask. The CPU path (``_dropout_impl``:
  ``empty_like`` + ``bernoulli_`` + ``div_`` + ``mul``) saves a mask in the input's dtype (2 bytes an
  element in bf16, 4 in fp32). ``dropout_`` (in place), ``feature_dropout`` and ``alpha_dropout`` are
  never fused and stay as they are.
* **SDPA** (:func:`~hf_memwatch.estimation.cuda_sdpa.cuda_sdpa`): the backend ``sdp_utils`` picks for
  the target's compute capability, run as the CUDA op itself (:mod:`~hf_memwatch.estimation.cuda_sdpa`).
* **Kernel workspaces** (:func:`cuda_workspace`, added as transients by the tracker): SDPA's (flash
  backward's fp32 ``dq_accum`` and ``softmax_d``, memory-efficient attention's accumulators), embedding
  backward's sort
  and segment buffers past 3,072 indices, cuBLAS's contiguous copy of an operand that is neither row-
  nor column-major, and the contiguous copy CUDA's softmax makes of a strided input.

What differs nowhere in bytes is not modelled: CUDA's ``nll_loss`` returns ``total_weight`` as the CPU
kernel does, and ``log_softmax``/``nll_loss`` allocate nothing else through the allocator.

Not modelled (no source to size it from): cub's temporary storage in the embedding sort.

Example:
    >>> x = torch.empty(4, 1024)[:, ::2]  # neither row- nor column-major: cuBLAS copies it first
    >>> gemm_operand_copies((x, torch.empty(512, 8)))
    8192
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ..compat.torch_ops import (
    LOG_SOFTMAX,
    SDPA_CUDNN_BACKWARD,
    SDPA_EFFICIENT,
    SDPA_EFFICIENT_BACKWARD,
    SDPA_FLASH_BACKWARD,
    SOFTMAX,
    present,
)
from .cuda_sdpa import (
    HALF,
    aten,
    cuda_sdpa,
    cudnn_backward_workspace,
    efficient_backward_workspace,
    efficient_forward_workspace,
    flash_backward_workspace,
)
from .cuda_settings import cuda_blocks


# -- dropout -----------------------------------------------------------------------------------
def fused_dropout(func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``F.dropout(input, p, training, inplace)`` (``func``) as CUDA runs it: ``native_dropout`` when the
    fused kernel is acceptable (Dropout.cpp, ``dropout``: training, ``0 < p < 1``, ``numel > 0``; not
    ``dropout_``, in place), else ``func`` unchanged. ``native_dropout`` has CPU and fake kernels; its
    autograd saves the bool mask."""
    bound = dict(zip(("input", "p", "training", "inplace"), args))
    bound.update(kwargs)
    x, p, train = bound.get("input"), bound.get("p", 0.5), bound.get("training", True)
    if (isinstance(x, torch.Tensor) and train and not bound.get("inplace", False)
            and isinstance(p, (int, float)) and 0 < p < 1 and x.numel() > 0):
        return torch.native_dropout(x, float(p), True)[0]
    return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_kernel_paths(gpu: Any) -> Iterator[None]:
    """Within, ``F.dropout`` and ``F.scaled_dot_product_attention`` take the paths CUDA takes on ``gpu``
    (a GpuSpec): :func:`fused_dropout`, :func:`cuda_sdpa`.

    Both decompose in C++ (CompositeImplicitAutograd) before any dispatch mode sees them, so they are
    replaced where Python code finds them: the ``torch.nn.functional`` attributes (``nn.Dropout``,
    transformers' ``sdpa_attention_forward`` and the models look them up at each call), put back on
    exit. Not a function mode: a mode is off while its handler runs, and ``backward`` is such a call,
    so activation checkpointing would recompute the forward on the CPU paths (torch's checkpoint then
    reports a different number of saved tensors); the attributes hold inside the recomputation. The
    replay runs on one thread; nothing else should call these functions meanwhile.
    """
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def cuda_dropout(*args: Any, **kwargs: Any) -> Any:
        return fused_dropout(dropout, args, kwargs)

    def cuda_scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        return cuda_sdpa(gpu, *args, **kwargs)

    F.dropout, F.scaled_dot_product_attention = cuda_dropout, cuda_scaled_dot_product_attention
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, sdpa


EMBEDDING_DIRECT_MAX = 3072  # embedding_dense_backward_cuda: up to this many indices, one direct kernel
NROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu: rows per partial segment


def embedding_backward_workspace(args: tuple) -> int:
    """Bytes CUDA's ``embedding_dense_backward`` allocates beside ``grad_weight`` past 3,072 indices (or
    with ``scale_grad_by_freq``): Embedding.cu's sorted and original index arrays (radix sort; a count
    with ``scale_grad_by_freq``), then EmbeddingBackwardKernel.cu's ``segment_offsets`` ``[N]``,
    ``partials_per_segment`` and its offsets ``[min(N, V)]``, ``partial_segment_offset``
    ``[N / 10 + min(N, V)]`` and ``grad_weight_per_segment`` of that many rows in the accumulation dtype
    (fp32 for fp16/bf16), all alive while the partial sums are scattered."""
    grad, indices, num_weights = args[0], args[1], args[2]
    scale_by_freq = bool(args[4]) if len(args) > 4 else False
    n = indices.numel()
    if n <= EMBEDDING_DIRECT_MAX and not scale_by_freq:
        return 0
    idx = indices.element_size()
    segments = min(n, num_weights)
    partials = n // NROWS_PER_THREAD + segments
    acc = 4 if grad.dtype in (*HALF, torch.float32) else grad.element_size()
    total = (2 + scale_by_freq) * cuda_blocks(n * idx) + cuda_blocks(n * idx) + 2 * cuda_blocks(segments * idx)
    total += cuda_blocks(partials * idx) + cuda_blocks(partials * grad.shape[-1] * acc) + 2 * cuda_blocks(8)
    if not grad.is_contiguous():
        total += cuda_blocks(grad.numel() * grad.element_size())
    return total


def _cublas_ready(t: torch.Tensor) -> bool:
    """``prepare_matrix_for_cublas`` / ``prepare_batch_matrix_for_cublas`` (Blas.cpp): a matrix taken
    as is when row- or column-major in its last two dims (a contiguous batch too)."""
    if t.dim() < 2:
        return True
    rows, cols = t.shape[-2:]
    rs, cs = t.stride()[-2:]
    if (cs == 1 and rs >= max(1, cols)) or (rs == 1 and cs >= max(1, rows)):
        return True
    return t.dim() == 3 and t.is_contiguous() and rs != 0 and cs != 0


def gemm_operand_copies(args: tuple) -> int:
    """Bytes of the contiguous clones cuBLAS's ``mm``/``addmm``/``bmm``/``baddbmm`` make of operands
    that are neither row- nor column-major (Blas.cpp, ``prepare_matrix_for_cublas``: ``tensor.clone``)."""
    operands = [a for a in args if isinstance(a, torch.Tensor)][-2:]
    return sum(cuda_blocks(t.numel() * t.element_size()) for t in operands if not _cublas_ready(t))


_FLASH_BWD, _EFFICIENT_BWD, _EFFICIENT_FWD = SDPA_FLASH_BACKWARD, SDPA_EFFICIENT_BACKWARD, SDPA_EFFICIENT
_CUDNN_BWD = SDPA_CUDNN_BACKWARD
_EMBEDDING_BWD = aten.embedding_dense_backward.default
_GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_SOFTMAXES = present(LOG_SOFTMAX, SOFTMAX)
CUDA_WORKSPACE_OPS = present(_FLASH_BWD, _EFFICIENT_BWD, _EFFICIENT_FWD, _CUDNN_BWD, _EMBEDDING_BWD, *_GEMMS,
                             *_SOFTMAXES)


def cuda_workspace(func: Any, args: tuple, gpu: Any) -> int:
    """Bytes the CUDA kernel of ``func`` allocates and frees inside itself on ``gpu`` (0 when none)."""
    if func is _FLASH_BWD:
        return flash_backward_workspace(args)
    if func is _EFFICIENT_BWD:
        return efficient_backward_workspace(args, gpu.sm)
    if func is _EFFICIENT_FWD:
        return efficient_forward_workspace(args)
    if func is _CUDNN_BWD:
        return cudnn_backward_workspace(args)
    if func is _EMBEDDING_BWD:
        return embedding_backward_workspace(args)
    if func in _GEMMS:
        return gemm_operand_copies(args)
    if func in _SOFTMAXES:  # SoftMax.cu, host_softmax: ``input_.contiguous()``
        x = args[0]
        return 0 if x.is_contiguous() else cuda_blocks(x.numel() * x.element_size())
    return 0
