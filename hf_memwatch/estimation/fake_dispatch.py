"""The fake-dispatch layer: the tracker a replay runs under and the shims that let fake tensors run.

:class:`EstimateTracker` counts storages as the target allocator would (``round_to``: 512 bytes on CUDA)
and snapshots the live set at each new high of a phase. Under it, fake tensors answer what they cannot
know as a clean batch's real tensors would (a value read back, a boolean index, ``nonzero``), torch's
shape functions are worked around where they reject what the CPU kernel runs (``_grouped_mm``),
bitsandbytes kernels are replayed as they allocate (the CPU optimizer kernels, the 4-bit GEMM's
dequantized weight; for a CUDA target the 4-bit GEMM as its CUDA kernel routes it:
:mod:`hf_memwatch.estimation.cuda_libs`), and kernels' internal workspaces are added as transients
(:mod:`hf_memwatch.estimation.kernel_workspaces` for a CPU target, :mod:`hf_memwatch.estimation.cuda_kernels`
for a CUDA one).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ..compat.bitsandbytes import cpu_optimizer_kernel, gemm_4bit_composite
from ..compat.torch_internals import FakeTensor, is_fake, tensor_storage_key
from ..compat.torch_ops import GROUPED_MM, LOCAL_SCALAR_DENSE, present
from ..measure.attribution import weight_tensors
from ..measure.saved_tensors import SavedTensorRegistry
from ..measure.tracker import StorageTracker
from .cuda_kernels import CUDA_WORKSPACE_OPS, cuda_workspace
from .cuda_libs import bnb_gemm_4bit_cuda
from .cuda_settings import K_MIN_BLOCK_SIZE
from .kernel_workspaces import (
    CPU_GEMM_OPS,
    CPU_SOFTMAX_OPS,
    SDPA_CPU_OPS,
    gemm_cpu_workspace,
    low_precision,
    sdpa_cpu_workspace,
    strided_input_copy,
)

CUDA_BLOCK = K_MIN_BLOCK_SIZE  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes

LOGITS = "logits"
LOGITS_FP32 = "logits_fp32_upcast"

# ``tensor.device`` asked from C++ (autograd, argument parsing) of a fake tensor: dispatched to every mode
# on the stack. 72% of a replay's dispatches (1,757 of 2,439 in a 2-layer GPT-2 step); it allocates nothing.
# Answered at the top of the mode: an estimate 9-12% cheaper (benchmarks/results/estimate_cost.md).
_DEVICE_QUERY = torch.ops.prim.device.default
_LIFT_FRESH = torch.ops.aten.lift_fresh.default  # ``torch.tensor(python_data)``


class EstimateTracker(StorageTracker):
    """A :class:`StorageTracker` that also snapshots the live set at each new high of a phase.

    ``round_to`` rounds each storage up as the target allocator would (512 bytes on CUDA).
    bitsandbytes optimizer ops are replayed with their Python CPU kernels when ``bnb_cpu_kernels``
    (the registered fake kernels allocate nothing, the real CPU ones dequantize into temporaries);
    otherwise (a CUDA target) with the fake kernels: bitsandbytes' CUDA kernels update in place and
    allocate nothing (``backends/cuda/ops.py``, ``_optimizer_update_8bit_blockwise_impl`` and
    ``_optimizer_update_32bit_impl`` pass the tensors' pointers to the C kernel). The base tracker's
    observed CPU kernels are therefore off here: they counted 5 x 4 B per element of the parameter
    on a CUDA target (the CPU kernel's fp32 states, gradient, weight and update).
    For a CPU target, the per-thread buffers the CPU flash-attention kernel allocates inside itself
    are added as transients (:func:`sdpa_cpu_workspace`).
    """

    observes_python_kernels = False  # bitsandbytes' kernels: per target, below (bnb_cpu_kernels)

    def __init__(self, device_type: str, saved: SavedTensorRegistry, round_to: int = 1,
                 bnb_cpu_kernels: bool = False) -> None:
        super().__init__(device_type, round_to=round_to)
        self.saved = saved
        self.bnb_cpu_kernels = bnb_cpu_kernels
        self.snapshot: tuple[dict[int, Any], set[int]] | None = None
        self.kernel_workspaces = device_type == "cpu" and round_to == 1
        self.gpu: Any = None  # a CUDA target's card (core.gpus.GpuSpec), set by replay.new_tracker
        # True within a torch optimizer's step for a CUDA target: tensors made from Python data are host
        # tensors, not counted (estimation.cuda_optim.steps_on_host)
        self.host_scalars = False
        # id of a storage's ref -> (the ref, its detail name): by the ref, one storage lifetime, so a name
        # stays with its storage in a snapshot after that storage died and its address was reused
        self.named: dict[int, tuple[Any, str]] = {}
        # storage key -> its ref: gradients an engine holds outside ``.grad`` (ZeRO's buckets, partitions)
        self.engine_gradients: dict[int, Any] = {}
        # storage key -> its ref: parameters an engine gathers outside the model's own (FSDP2's all-gathers)
        self.engine_weights: dict[int, Any] = {}
        self._logits_shape: tuple[int, int] | None = None
        self._mixed = False
        self._int_answer = 1
        # id of an any()/all() result -> (a weak reference to it, the answer); None: answers of 1 and True
        self._verdicts: dict[int, tuple[weakref.ref, bool]] | None = None
        # id of a one-element ``x == 0`` -> a weak reference to it: read back, it answers False
        self._zero_tests: dict[int, weakref.ref] = {}

    @contextlib.contextmanager
    def reading_a_clean_batch(self, longest: int) -> Iterator[None]:
        """Within, values read back from fake tensors answer as a clean batch's do, at the longest.

        An integer answers ``longest`` (outside: 1): generation's "longest generated sequence" bounds
        slices that clamp, so the largest keeps them whole. ``any()`` answers False and ``all()`` True:
        their checks in ``generate`` ask whether a batch of full rows of valid ids is padded or has
        negative ids (no) or whether its attention mask is all ones (yes).
        """
        saved = self._int_answer, self._verdicts
        self._int_answer, self._verdicts = longest, {}
        try:
            yield
        finally:
            self._int_answer, self._verdicts = saved

    def name_logits(self, vocab: int, rows: int, mixed: bool) -> None:
        """Name every new storage shaped (>= ``rows`` rows) x ``vocab``: the logits and their kin.

        That is the LM head's output, its fp32 copy in the loss (``logits_fp32_upcast`` under
        mixed precision), the loss's log-softmax and the gradients of each: the largest single
        tensors of a language-model step.
        """
        self._logits_shape = (vocab, rows)
        self._mixed = mixed

    def _track_plain(self, tensor: torch.Tensor) -> None:
        shape = self._logits_shape
        if shape is None or tensor.dim() < 2 or tensor.shape[-1] != shape[0] or tensor.numel() < shape[0] * shape[1]:
            super()._track_plain(tensor)
            return
        key = tensor_storage_key(tensor)
        before = self._live.get(key)
        super()._track_plain(tensor)
        ref = self._live.get(key)
        if ref is not None and ref is not before:
            upcast = self._mixed and tensor.dtype == torch.float32
            self.named[id(ref)] = (ref, LOGITS_FP32 if upcast else LOGITS)

    def reads_zero(self, tensor: torch.Tensor) -> None:
        """``tensor``'s next read back (``.item()``) answers 0: a clean step's ``found_inf``."""
        self._zero_tests[id(tensor)] = weakref.ref(tensor)

    def on_new_peak(self) -> None:
        # C-speed shallow copies: the refs keep each storage's size even after it dies
        self.snapshot = (dict(self._live), self.saved.keys())

    def reset_peak(self) -> None:
        super().reset_peak()
        self.on_new_peak()

    def transient(self, nbytes: int) -> None:
        """Memory a kernel allocates and frees inside itself (invisible to dispatch), at its high."""
        if nbytes <= 0:
            return
        self._live[-1] = _Transient(nbytes)
        self.allocated += nbytes
        if self.allocated > self.peak:
            self.peak = self.allocated
            if self.census is not None:
                self.census.on_peak()
            self.on_new_peak()
        del self._live[-1]
        self.allocated -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY and isinstance(args[0], FakeTensor):
            return args[0].device  # FakeTensor's own answer (its property), without the modes below
        if self.host_scalars and func is _LIFT_FRESH:
            return func(*args, **(kwargs or {}))  # a host tensor of a CUDA run: not the card's memory
        if func in _READ_BACK_OPS:
            # A value read back to Python (``.item()``, ``if tensor:``): fake tensors have none. Metrics
            # code (TRL's token counts, accuracies) only needs *a* number; memory never depends on it.
            # (by identity: a tensor's == would itself be read back)
            ref, verdict = (self._verdicts or {}).get(id(args[0]), (None, None))
            if ref is not None and ref() is args[0]:
                return verdict
            zero = self._zero_tests.pop(id(args[0]), None)
            if zero is not None and zero() is args[0]:
                return False
            return _read_back_value(func, args, self._int_answer)
        if func is torch.ops.aten.eq.Scalar and len(args) > 1 and args[1] == 0 and args[0].numel() == 1:
            # ``if mask.sum() == 0:`` (SDFT's "no completion token" shortcut, a zero loss with no top-k
            # divergence nor its backward: -4.7% taken): a clean batch has tokens, so not zero.
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self._zero_tests[id(out)] = weakref.ref(out)
            return out
        if self._verdicts is not None and func.overloadpacket in _VERDICTS:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self._verdicts[id(out)] = (weakref.ref(out), _VERDICTS[func.overloadpacket])
            return out
        if func is torch.ops.aten.index.Tensor and _boolean_index(args):
            # ``tensor[mask]``: the size depends on the mask's values; every element counted as selected.
            source, mask = args[0], args[1][0]
            shape = (mask.numel(), *source.shape[mask.dim():])
            out = torch.empty(shape, dtype=source.dtype, device=source.device)
            self._track_output(out)
            return out
        if func is torch.ops.aten.nonzero.default:
            # A data-dependent size: every element counted as non-zero, the largest result (masks of
            # real tokens, as the estimate's unpadded batches are).
            source = args[0]
            out = torch.zeros((source.numel(), source.dim()), dtype=torch.long, device=source.device)
            self._track_output(out)
            return out
        if self.gpu is not None and func in CUDA_WORKSPACE_OPS:  # a CUDA target's kernels (cuda_kernels)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.transient(cuda_workspace(func, args, self.gpu))
            return out
        if self.kernel_workspaces and func in SDPA_CPU_OPS:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.transient(sdpa_cpu_workspace(func, args))
            return out
        if self.kernel_workspaces and func in CPU_SOFTMAX_OPS:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.transient(strided_input_copy(args[0]))
            return out
        if self.kernel_workspaces and func in CPU_GEMM_OPS and low_precision(args):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.transient(gemm_cpu_workspace(func, args, kwargs or {}))
            return out
        if func is torch.ops.aten.nonzero.default and is_fake(args[0]):
            return super().__torch_dispatch__(_nonzero_of_all_true, types, args, kwargs)
        if func in _GROUPED_MM_OPS and _meta_rejects_dtype(args):
            return super().__torch_dispatch__(_grouped_mm_via_bf16(func), types, args, kwargs)
        if func.namespace == "bitsandbytes" and func.__name__ == "gemm_4bit.default":
            # The registered fake kernel allocates the output only; the CPU kernel (and the CUDA one
            # past 1536 rows, every training micro-batch) dequantizes the weight into a temporary
            # first: bitsandbytes' own composite, replayed. A CUDA target: the CUDA kernel's routing.
            kernel = bnb_gemm_4bit_composite() if self.gpu is None else bnb_gemm_4bit_cuda(self.gpu)
            if kernel is not None:
                with self:
                    return kernel(*args, **(kwargs or {}))
        if self.bnb_cpu_kernels and func.namespace == "bitsandbytes" and "optimizer_update" in func.__name__:
            kernel = bnb_cpu_kernel(func.__name__)
            if kernel is not None:
                with self:  # re-enter so the kernel's temporaries are counted
                    kernel(*args, **(kwargs or {}))
                return None
        return super().__torch_dispatch__(func, types, args, kwargs)


_VERDICTS = {torch.ops.aten.any: False, torch.ops.aten.all: True}  # what a clean batch answers
_READ_BACK_OPS = present(LOCAL_SCALAR_DENSE, torch.ops.aten.is_nonzero.default)


def _boolean_index(args: tuple) -> bool:
    """``aten.index.Tensor(source, [mask])`` with one boolean mask over leading dimensions."""
    indices = args[1] if len(args) > 1 else None
    if not isinstance(indices, (list, tuple)) or len(indices) != 1:
        return False
    mask = indices[0]
    return isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() <= args[0].dim()


def _read_back_value(func: Any, args: tuple, int_answer: int = 1) -> Any:
    if func is torch.ops.aten.is_nonzero.default:
        return True
    dtype = args[0].dtype
    return 1.0 if dtype.is_floating_point else True if dtype == torch.bool else int_answer


class _Transient:
    """Stands in a snapshot for a kernel's internal workspace (classified as temporaries)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def _nonzero_of_all_true(tensor: torch.Tensor) -> torch.Tensor:
    """``nonzero`` as the estimate's batches answer it: every element true.

    Its output size depends on values, which fake tensors do not have (``DynamicOutputShapeException``).
    The estimate's batches are full rows with valid labels (no padding, no ``-100``), so masks
    and label filters built from them are all true — DeBERTa-v2's classification loss indexes the
    labelled rows with ``(labels >= 0).nonzero()``.
    """
    return torch.empty((tensor.numel(), tensor.dim()), dtype=torch.long, device=tensor.device)


_GROUPED_MM_OPS = present(GROUPED_MM)


def _meta_rejects_dtype(args: tuple) -> bool:
    """torch's shape function for ``_grouped_mm`` accepts only bf16 (the CUDA kernel's rule)."""
    return any(isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.bfloat16 for a in args[:2])


def _grouped_mm_via_bf16(func: Any) -> Any:
    """``_grouped_mm`` of fp32/fp16 operands, shaped through the bf16 shape function.

    The CPU kernel (mixture-of-experts layers: Mixtral, Qwen2-MoE, ... through transformers'
    ``grouped_mm`` experts) computes in any floating dtype, but the fake-tensor shape function
    rejects all but bf16. The output has the same shape in the operands' dtype; the casts in
    between are fake and untracked (only the returned tensor is counted).
    """

    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        dtype = args[0].dtype
        cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args]
        return func(*cast, **kwargs).to(kwargs.get("out_dtype") or dtype)

    return run


def bnb_cpu_kernel(op_name: str) -> Any:
    """bitsandbytes' Python CPU implementation of an optimizer op (None when unavailable: compat.bitsandbytes)."""
    return cpu_optimizer_kernel(op_name)


def bnb_gemm_4bit_composite() -> Any:
    """bitsandbytes' dequantize-then-``linear`` implementation of ``gemm_4bit`` (None when unavailable: compat.bitsandbytes)."""
    return gemm_4bit_composite()


def name_frozen_weights(tracker: EstimateTracker, model: torch.nn.Module) -> None:
    """With frozen parameters (PEFT, a frozen backbone), split weights into ``frozen``/``trainable``.

    Buffers count as frozen. A full fine-tune gets no split (everything is trainable).
    """
    params = list(model.parameters())
    if all(p.requires_grad for p in params):
        return
    for tensor in weight_tensors(model):
        key = tensor_storage_key(tensor)
        ref = tracker._live.get(key)
        if ref is not None:
            trainable = isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad
            tracker.named[id(ref)] = (ref, "trainable" if trainable else "frozen")
