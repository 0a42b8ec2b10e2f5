"""ATen's underscore-named operators and the CPU backend queries the replay keys rules on, with their
probe. Verified on torch 2.13.0.

The replay recognises some operators by identity, to add what their kernel allocates inside
(``estimation/kernel_workspaces.py``) or to answer what a fake tensor cannot
(``estimation/fake_dispatch.py``). Their names begin with an underscore in ATen's
``native_functions.yaml``; a release that renames one would silently drop its rule, so
:data:`OPS` checks, at the first ``MemWatch()`` or ``estimate`` of a process
(:func:`hf_memwatch.compat.stack.check_stack`), that each is there; failed, one WARNING and
``meta.degraded`` say which rules are off (each missing operator is then left out of its set).

==============================================================  ==================================================
operator (``aten::``, overload ``default``)                      rule
==============================================================  ==================================================
``_softmax``, ``_log_softmax``                                   the contiguous copy the CPU kernel makes of a
                                                                 strided input
``_scaled_dot_product_flash_attention_for_cpu`` (and             the CPU flash kernel's per-thread buffers
``_backward``)
``_local_scalar_dense``                                          a value read back from a fake tensor (answered
                                                                 as a clean batch's)
``_grouped_mm``                                                  fp32/fp16 operands shaped through the bf16 shape
                                                                 function (mixture-of-experts layers)
==============================================================  ==================================================

Also here: whether the autograd profiler is on (``torch._C._autograd._profiler_enabled``: the
replay's one real GEMM run stays out of a user's profile) and whether oneDNN has native bf16/fp16
on this CPU (``torch.ops.mkldnn._is_mkldnn_bf16_supported``).
"""

from __future__ import annotations

from typing import Any

import torch

from .probes import Probe

NAMES = ("_softmax", "_log_softmax", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_flash_attention_for_cpu_backward", "_local_scalar_dense", "_grouped_mm")


def aten_default(name: str) -> Any:
    """``torch.ops.aten.<name>.default``, or None when this torch has no such operator."""
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, "default", None) if packet is not None else None


SOFTMAX, LOG_SOFTMAX, SDPA_FLASH_CPU, SDPA_FLASH_CPU_BACKWARD, LOCAL_SCALAR_DENSE, GROUPED_MM = map(aten_default, NAMES)

OPS = Probe("torch", "aten::" + ", ".join(NAMES),
            "the replay's rules for these operators (kernel copies and buffers, read-backs, grouped_mm's dtypes)",
            lambda: all(aten_default(name) is not None for name in NAMES))


def present(*ops: Any) -> frozenset[Any]:
    """The operators of ``ops`` this torch has (a missing one is None, left out; :data:`OPS` warns)."""
    return frozenset(op for op in ops if op is not None)


def profiler_enabled() -> bool:
    """Whether the autograd profiler is recording in this thread."""
    return bool(torch._C._autograd._profiler_enabled())


def onednn_native(dtype: torch.dtype) -> bool:
    """Whether oneDNN has native ``dtype`` (bf16/fp16) GEMM on this CPU."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float16 and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


# The CUDA replay's operators (estimation/cuda_kernels.py, cuda_sdpa.py): CUDA's SDPA kernels and their
# backward ops (their schemas are registered in every build, the CPU one included).
CUDA_NAMES = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
              "_scaled_dot_product_cudnn_attention", "_safe_softmax",
              "_scaled_dot_product_cudnn_attention_backward")
(SDPA_FLASH, SDPA_FLASH_BACKWARD, SDPA_EFFICIENT, SDPA_EFFICIENT_BACKWARD, SDPA_CUDNN,
 SAFE_SOFTMAX, SDPA_CUDNN_BACKWARD) = map(aten_default, CUDA_NAMES)
CUDA_OPS = Probe("torch", "aten::" + ", ".join(CUDA_NAMES),
                 "the CUDA replay's SDPA kernels (a CUDA target's attention replayed by the math path)",
                 lambda: all(aten_default(name) is not None for name in CUDA_NAMES))


def cuda_kernels_present() -> bool:
    """Whether the CUDA SDPA kernels can be replayed (:data:`CUDA_OPS`, run once at a CUDA target's first attention)."""
    from .probes import holds

    return holds(CUDA_OPS)
