"""Memory CPU kernels allocate inside themselves, invisible at the dispatcher, as the tracker adds it.

The CPU allocator counts these buffers; the fake step does not see them: the flash-attention kernel's
per-thread blocks (:func:`sdpa_cpu_workspace`, from ATen's source), the contiguous copy a softmax makes
of a strided input (:func:`strided_input_copy`) and oneDNN's packed operand blocks of a bf16/fp16 matrix
product (:func:`gemm_cpu_workspace`: probed once per layout with a real run under the profiler; in a
watched run, :func:`run_cpu_kernel`, measured on the product's own call).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

import torch

from ..compat.torch_ops import (
    LOG_SOFTMAX,
    SDPA_FLASH_CPU,
    SDPA_FLASH_CPU_BACKWARD,
    SOFTMAX,
    onednn_native,
    present,
    profiler_enabled,
)

# ATen's CPU softmax kernels (SoftMax.cpp) make their input contiguous inside: a strided input (a slice
# of the logits, Online DPO's ``logits[:, prompt - 1:-1].log_softmax(-1)``) is copied whole, next to
# the output (measured, profiler: Online DPO -3.98% before, the 8 x 8 x 1002 fp32 copy missing).
CPU_SOFTMAX_OPS = present(LOG_SOFTMAX, SOFTMAX)


def strided_input_copy(tensor: Any) -> int:
    """Bytes of the contiguous copy a CPU kernel makes of ``tensor`` (0 when it is contiguous)."""
    if not isinstance(tensor, torch.Tensor) or tensor.is_contiguous():
        return 0
    return tensor.numel() * tensor.element_size()


SDPA_CPU_OPS = present(SDPA_FLASH_CPU, SDPA_FLASH_CPU_BACKWARD)


def sdpa_cpu_workspace(func: Any, args: tuple) -> int:
    """Bytes the CPU flash-attention kernel allocates for its per-thread buffers.

    From ATen's ``FlashAttentionKernel.cpp``: query blocks of 32/64/256 rows (sequence < 192,
    < 768, longer), key blocks of up to 512; forward ``buf`` (fp32) holds q @ k.T, row max and sum
    and an output block per thread, plus a low-precision copy of q @ k.T for bf16/fp16; backward
    holds attention and its gradient per thread, in fp32 and, for bf16/fp16, again in low precision,
    after a contiguous copy of the output gradient when it arrives strided.
    """
    backward = func is SDPA_FLASH_CPU_BACKWARD
    query, key = (args[1], args[2]) if backward else (args[0], args[1])
    q_len, kv_len, head_dim = query.shape[-2], key.shape[-2], query.shape[-1]
    q_split = min(256 if q_len >= 768 else 64 if q_len >= 192 else 32, q_len)
    kv_split = min(512, kv_len)
    threads = torch.get_num_threads()
    reduced = query.dtype in (torch.bfloat16, torch.float16)
    low = query.element_size()
    if backward:
        per_thread = 2 * q_split * kv_split * 4 + q_split * 4 + (2 * q_split * kv_split * low if reduced else 0)
        grad_out = args[0]  # the kernel makes it contiguous first
        copy = 0 if grad_out.is_contiguous() else grad_out.numel() * grad_out.element_size()
        return threads * per_thread + copy
    per_thread = (q_split * kv_split + 2 * q_split + q_split * head_dim) * 4 + (
        q_split * kv_split * low if reduced else 0)
    return threads * per_thread


CPU_GEMM_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                 torch.ops.aten.baddbmm.default}
_GEMM_WORKSPACES: dict[tuple, int] = {}
GEMM_PROBE_MAX_BYTES = 64 * 2**20  # operands larger than this are not probed (workspace taken as 0)


LOW_PRECISION = (torch.bfloat16, torch.float16)


def low_precision(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype in LOW_PRECISION for a in args)


def gemm_cpu_workspace(func: Any, args: tuple, kwargs: dict[str, Any]) -> int:
    """Bytes a bf16/fp16 CPU matrix product allocates inside itself (oneDNN's packed operand blocks).

    Invisible at the dispatcher but counted by the CPU allocator: 18 KB to 1.6 MB for the small
    models' shapes (more when the left operand arrives transposed), which sets the step's peak
    where a backward GEMM meets the highest live set (ALBERT in bf16: -3.3% without it). The
    blocking depends on oneDNN's heuristics and the thread count, so the kernel is probed once
    per (op, shapes, strides, dtype, threads): run on real operands of the same layout, its
    allocator events read from the profiler. Not probed (0) when the operands exceed
    ``GEMM_PROBE_MAX_BYTES``; 0 and not remembered while a profiler is already running (a live run
    under the profiler; probed at the next call without one).

    Where ATen does not send the dtype to oneDNN (:func:`onednn_gemm`: a CPU without AVX-512 or
    AVX-NE-CONVERT) and both matrices are row- or column-major (:func:`blas_ready`), nothing is
    probed: the fallback kernel allocates nothing through the allocator (measured 0 bytes on 172 bf16
    and fp16 ``mm``/``addmm`` products, 16 to 9728 a side, up to 2.6e9 multiply-adds, all four
    transpositions, and on
    a Qwen3-4B layer's products at 512-4096 tokens: ``benchmarks/results/gemm_workspace_rule.md``;
    seven bf16 estimates unchanged to the byte), while each probe ran the full product: a 2-layer
    Qwen3-4B estimate at 1 x 64 tokens took 216 s with its 18 probes, 7 s without.
    A matrix in neither layout is copied contiguous first (measured: exactly its bytes), so it is
    still probed.
    """
    key = _gemm_key(func, args, kwargs)
    if key is None:
        return 0
    if key not in _GEMM_WORKSPACES:
        if profiler_enabled():  # no probe under a running profiler: 0 now, probed when it has stopped
            return 0
        _GEMM_WORKSPACES[key] = _probe_gemm(func, args, kwargs)
    return _GEMM_WORKSPACES[key]


def _gemm_key(func: Any, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
    """What a product's workspace depends on (None: the BLAS fallback, which allocates nothing)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    dtype = next(t.dtype for t in tensors if t.dtype in LOW_PRECISION)
    if not onednn_gemm(dtype) and all(blas_ready(t) for t in tensors[-2:]):
        return None
    return (func, tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors),
            tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))),
            torch.get_num_threads())


def cpu_kernel_workspace(func: Any, args: tuple, kwargs: dict[str, Any]) -> int:
    """Bytes a built-in CPU operator allocates and frees inside itself, by the estimate's rules
    (flash attention's per-thread buffers, a softmax's contiguous copy, a bf16/fp16 product's
    packed blocks, probed on copies of its operands), 0 for any other operator."""
    if func in CPU_GEMM_OPS:
        return gemm_cpu_workspace(func, args, kwargs) if low_precision(args) else 0
    if func in SDPA_CPU_OPS:
        return sdpa_cpu_workspace(func, args)
    if func in CPU_SOFTMAX_OPS:
        return strided_input_copy(args[0])
    return 0


# Products the live run measured on their own call whose operands exceed ``GEMM_PROBE_MAX_BYTES``:
# kept apart, so that an estimate (0 for them) does not depend on what ran before it in the process.
_LIVE_GEMM_WORKSPACES: dict[tuple, int] = {}


def run_cpu_kernel(func: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, int]:
    """Run a built-in CPU operator for the live tracker (``StorageTracker.kernel_call``): its output
    and the bytes its kernel allocated and freed inside itself.

    The same rules as :func:`cpu_kernel_workspace`, except that a bf16/fp16 product whose layout
    was never measured is measured on its own call, under a profiler scoped to that call, and not
    on copies: a watched step allocates nothing the unwatched one does not (a probe on copies
    inside the step held up to 2 x 64 MiB of operands and their product next to the step's live
    set). Under a running profiler (one cannot be nested) an unmeasured product counts 0 and
    is measured at its next call without one. Without this hook MemWatch's live peak of bf16 draws
    read up to 2.67% under the profiler (150-draw sweep: ALBERT 4 x 64 bf16, the backward
    product's blocked weight copy missing).
    """
    if func not in CPU_GEMM_OPS or not low_precision(args):
        return func(*args, **kwargs), cpu_kernel_workspace(func, args, kwargs)
    key = _gemm_key(func, args, kwargs)
    if key is None:
        return func(*args, **kwargs), 0
    known = _GEMM_WORKSPACES.get(key, _LIVE_GEMM_WORKSPACES.get(key))
    if known is not None or profiler_enabled():
        return func(*args, **kwargs), known or 0
    out, workspace = _measured_call(func, args, kwargs)
    size = sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))
    (_GEMM_WORKSPACES if size <= GEMM_PROBE_MAX_BYTES else _LIVE_GEMM_WORKSPACES)[key] = workspace
    return out, workspace


@functools.cache
def _onednn_device(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return onednn_native(dtype)


def onednn_gemm(dtype: torch.dtype) -> bool:
    """Whether ATen sends a CPU matrix product of ``dtype`` to oneDNN (``mkldnn_matmul``).

    ATen's ``mkldnn_bf16_device_check`` (``_fp16_``): AVX-512 BW/VL/DQ or AVX-NE-CONVERT for bf16,
    AVX-512-FP16 or AVX-NE-CONVERT for fp16 (x86), and oneDNN enabled (``torch.backends.mkldnn``).
    Elsewhere the product runs ATen's own CPU BLAS kernel.
    """
    return torch.backends.mkldnn.enabled and _onednn_device(dtype)


def blas_ready(tensor: torch.Tensor) -> bool:
    """Whether a matrix (the last two dimensions) is row- or column-major as BLAS takes it, no copy.

        >>> blas_ready(torch.empty(4, 6)), blas_ready(torch.empty(6, 4).t()), blas_ready(torch.empty(4, 12)[:, ::2])
        (True, True, False)
    """
    if tensor.dim() < 2:
        return True
    rows, cols = tensor.shape[-2:]
    row_stride, col_stride = tensor.stride()[-2:]
    return (col_stride == 1 and row_stride >= max(1, cols)) or (row_stride == 1 and col_stride >= max(1, rows))


def _probe_gemm(func: Any, args: tuple, kwargs: dict[str, Any]) -> int:
    """Highest allocator bytes inside one real run of ``func`` on copies of its operands beyond its
    output (see above): for the estimate, whose operands are fake."""
    from ..compat.torch_internals import disable_current_modes

    size = sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))
    if size > GEMM_PROBE_MAX_BYTES or profiler_enabled():
        return 0
    with disable_current_modes():
        real = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype).zero_() if isinstance(a, torch.Tensor) else a
                for a in args]
        out, workspace = _measured_call(func, tuple(real), kwargs)
        del out
    return workspace


def _measured_call(func: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, int]:
    """``func``'s output and the highest bytes its kernel held beyond that output, read from the
    CPU allocator's events of this one call (this thread's only: a free on another thread in the
    window, gloo's in a two-rank run, is not the kernel's)."""
    with warnings.catch_warnings(), _quiet_stderr():
        warnings.simplefilter("ignore")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    profile_memory=True) as prof:
            out = func(*args, **kwargs)
    cpu = torch.autograd.DeviceType.CPU
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    name = func.name()
    threads = {e.start_thread_id() for e in events if e.name() == name}
    running = peak = 0
    for event in events:
        if event.name() == "[memory]" and event.device_type() == cpu and (
                not threads or event.start_thread_id() in threads):
            running += event.nbytes()
            peak = max(peak, running)
    return out, max(0, peak - running)


@contextlib.contextmanager
def _quiet_stderr() -> Any:
    """Silence file descriptor 2 (kineto prints a line at every profiler start and stop)."""
    import os
    import sys

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real descriptor (embedded interpreters): leave it
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
