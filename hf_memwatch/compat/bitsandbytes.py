"""bitsandbytes' private kernels the estimator replays on fake tensors, with their probes. Verified on
bitsandbytes 0.50.2.

The fake tensors have no values, so bitsandbytes' ops are replayed by running their Python
implementations (whose inner ``aten`` operators the replay sees and counts):

=====================================================  ====================================  ==============================
private thing (``guards``)                             what relies on it                     without it (``off``)
=====================================================  ====================================  ==============================
``bitsandbytes.backends.cpu.ops``:                     8-bit / 32-bit optimizer steps'       the op's output only: its
``_optimizer_update_8bit_blockwise_cpu``,              fp32 temporaries on a CPU target      temporaries are not counted
``_optimizer_update_32bit_cpu``
``bitsandbytes.backends.default.ops``:                 QLoRA's 4-bit matmul on a CPU         the op's output only: the
``_gemm_4bit_default_impl``                            target (dequantize, then ``linear``)  dequantized weight is not counted
=====================================================  ====================================  ==============================
"""

from __future__ import annotations

from typing import Any

from .probes import Probe, holds

OPTIMIZER_KERNELS = {"optimizer_update_8bit_blockwise": "_optimizer_update_8bit_blockwise_cpu",
                     "optimizer_update_32bit": "_optimizer_update_32bit_cpu"}


def _cpu_ops() -> Any:
    from bitsandbytes.backends.cpu import ops

    return ops


def _default_ops() -> Any:
    from bitsandbytes.backends.default import ops

    return ops


CPU_OPTIMIZER_KERNELS = Probe("bitsandbytes", "backends.cpu.ops._optimizer_update_8bit_blockwise_cpu, "
                              "_optimizer_update_32bit_cpu",
                              "counting the temporaries of bitsandbytes' optimizer step on a CPU target",
                              lambda: all(callable(getattr(_cpu_ops(), name, None)) for name in OPTIMIZER_KERNELS.values()))
GEMM_4BIT = Probe("bitsandbytes", "backends.default.ops._gemm_4bit_default_impl",
                  "counting the dequantized weight of QLoRA's 4-bit matmul on a CPU target",
                  lambda: callable(getattr(_default_ops(), "_gemm_4bit_default_impl", None)))


def cpu_optimizer_kernel(op_name: str) -> Any:
    """bitsandbytes' Python CPU implementation of optimizer op ``op_name`` (None when unavailable)."""
    name = next((kernel for op, kernel in OPTIMIZER_KERNELS.items() if op_name.startswith(op)), None)
    if name is None or not holds(CPU_OPTIMIZER_KERNELS):
        return None
    return getattr(_cpu_ops(), name)


def gemm_4bit_composite() -> Any:
    """bitsandbytes' dequantize-then-``linear`` implementation of ``gemm_4bit`` (None when unavailable)."""
    return _default_ops()._gemm_4bit_default_impl if holds(GEMM_4BIT) else None
