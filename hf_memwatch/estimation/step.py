"""The Trainer's optimizer step, replayed on a fake model with lean storage accounting.

:func:`simulate_step` mirrors ``Trainer._run_epoch`` / ``training_step`` / ``compute_loss``:
``accum`` micro-batches prefetched (plus accelerate's one-batch look-ahead),
``num_items_in_batch`` when the model takes loss kwargs, accelerate's autocast forward wrapper
with its fp32 output conversion, ``loss / accum`` otherwise, ``backward``, the detached loss
accumulator, ``clip_grad_norm_``, ``optimizer.step()``, ``zero_grad(set_to_none=True)`` — for two
optimizer steps. Every tensor is fake; :class:`EstimateTracker` counts storages and snapshots the
live set each time a phase reaches a new high, and the snapshot is split into classes when the
phase ends.

A CUDA target is simulated on fake CPU tensors (fake CUDA tensors need a CUDA build of torch),
with what differs on CUDA modelled: every storage rounded up to 512 bytes as the caching
allocator rounds blocks; the optimizer implementation torch picks for CUDA tensors (``foreach``
unless the Trainer asks for ``fused``); bitsandbytes' fused CUDA kernels (no temporaries) instead
of its Python CPU kernels. Autocast runs with CPU autocast's op lists at the same dtype, and SDPA
with the CPU flash kernel, which saves what the CUDA flash / memory-efficient kernels save (the
output and the log-sum-exp), not the attention matrix.

Phase names are those of the timeline snapshot that closes each interval: ``after_forward``
(forward and loss), ``after_backward``, ``after_optimizer`` (clipping and the optimizer step),
``step_end`` (``zero_grad``).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from ..measure.attribution import weight_tensors
from ..measure.peak_tensors import PeakCensus, PeakTensors
from ..measure.saved_tensors import SavedTensorRegistry
from ..measure.tracker import StorageTracker
from .optim import BNB_OPTIMS, build_optimizer
from .peak import PeakCensusWatch
from .trainer_replay import batch_tensors, fake_batch

CUDA_BLOCK = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes
MIXED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepSimulation:
    """What one simulated step left: for each phase, the class split at its highest point."""

    phase_classes: dict[str, dict[str, int]]
    notes: list[str] = field(default_factory=list)
    # per phase, inside each class, the bytes of named tensors at that high (see LOGITS)
    phase_details: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    # per phase, the tensors alive at that high (with ``top`` > 0; :mod:`hf_memwatch.estimation.peak`)
    phase_tensors: dict[str, PeakTensors] = field(default_factory=dict)


LOGITS = "logits"
LOGITS_FP32 = "logits_fp32_upcast"


class EstimateTracker(StorageTracker):
    """A :class:`StorageTracker` that also snapshots the live set at each new high of a phase.

    ``round_to`` rounds each storage up as the target allocator would (512 bytes on CUDA).
    bitsandbytes optimizer ops are replayed with their Python CPU kernels when ``bnb_cpu_kernels``
    (the registered fake kernels allocate nothing, the real CPU ones dequantize into temporaries).
    For a CPU target, the per-thread buffers the CPU flash-attention kernel allocates inside itself
    are added as transients (:func:`sdpa_cpu_workspace`).
    """

    def __init__(self, device_type: str, saved: SavedTensorRegistry, round_to: int = 1,
                 bnb_cpu_kernels: bool = False) -> None:
        super().__init__(device_type, round_to=round_to)
        self.saved = saved
        self.bnb_cpu_kernels = bnb_cpu_kernels
        self.snapshot: tuple[dict[int, Any], set[int]] | None = None
        self.kernel_workspaces = device_type == "cpu" and round_to == 1
        self.named: dict[int, tuple[Any, str]] = {}  # storage key -> (its ref, detail name)
        self._logits_shape: tuple[int, int] | None = None
        self._mixed = False
        self._int_answer = 1
        # id of an any()/all() result -> (a weak reference to it, the answer); None: answers of 1 and True
        self._verdicts: dict[int, tuple[weakref.ref, bool]] | None = None

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
        key = tensor.untyped_storage()._cdata
        before = self._live.get(key)
        super()._track_plain(tensor)
        ref = self._live.get(key)
        if ref is not None and ref is not before:
            upcast = self._mixed and tensor.dtype == torch.float32
            self.named[key] = (ref, LOGITS_FP32 if upcast else LOGITS)

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
        if func in _READ_BACK_OPS:
            # A value read back to Python (``.item()``, ``if tensor:``): fake tensors have none. Metrics
            # code (TRL's token counts, accuracies) only needs *a* number; memory never depends on it.
            # (by identity: a tensor's == would itself be read back)
            ref, verdict = (self._verdicts or {}).get(id(args[0]), (None, None))
            if ref is not None and ref() is args[0]:
                return verdict
            return _read_back_value(func, args, self._int_answer)
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
        if self.kernel_workspaces and func in _SDPA_CPU_OPS:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.transient(sdpa_cpu_workspace(func, args))
            return out
        if self.kernel_workspaces and func in _CPU_SOFTMAX_OPS:
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.transient(strided_input_copy(args[0]))
            return out
        if self.kernel_workspaces and func in _CPU_GEMM_OPS and _low_precision(args):
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
            # first: bitsandbytes' own composite, replayed.
            kernel = _bnb_gemm_4bit_composite()
            if kernel is not None:
                with self:
                    return kernel(*args, **(kwargs or {}))
        if self.bnb_cpu_kernels and func.namespace == "bitsandbytes" and "optimizer_update" in func.__name__:
            kernel = _bnb_cpu_kernel(func.__name__)
            if kernel is not None:
                with self:  # re-enter so the kernel's temporaries are counted
                    kernel(*args, **(kwargs or {}))
                return None
        return super().__torch_dispatch__(func, types, args, kwargs)


_VERDICTS = {torch.ops.aten.any: False, torch.ops.aten.all: True}  # what a clean batch answers
_READ_BACK_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


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


# ATen's CPU softmax kernels (SoftMax.cpp) make their input contiguous inside: a strided input (a slice
# of the logits, Online DPO's ``logits[:, prompt - 1:-1].log_softmax(-1)``) is copied whole, next to
# the output (measured, profiler: Online DPO -3.98% before, the 8 x 8 x 1002 fp32 copy missing).
_CPU_SOFTMAX_OPS = {torch.ops.aten._log_softmax.default, torch.ops.aten._softmax.default}


def strided_input_copy(tensor: Any) -> int:
    """Bytes of the contiguous copy a CPU kernel makes of ``tensor`` (0 when it is contiguous)."""
    if not isinstance(tensor, torch.Tensor) or tensor.is_contiguous():
        return 0
    return tensor.numel() * tensor.element_size()


_SDPA_CPU_OPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}


def _nonzero_of_all_true(tensor: torch.Tensor) -> torch.Tensor:
    """``nonzero`` as the estimate's batches answer it: every element true.

    Its output size depends on values, which fake tensors do not have (``DynamicOutputShapeException``).
    The estimate's batches are full rows with valid labels (no padding, no ``-100``), so masks
    and label filters built from them are all true — DeBERTa-v2's classification loss indexes the
    labelled rows with ``(labels >= 0).nonzero()``.
    """
    return torch.empty((tensor.numel(), tensor.dim()), dtype=torch.long, device=tensor.device)


_GROUPED_MM_OPS = {torch.ops.aten._grouped_mm.default}


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


def sdpa_cpu_workspace(func: Any, args: tuple) -> int:
    """Bytes the CPU flash-attention kernel allocates for its per-thread buffers.

    From ATen's ``FlashAttentionKernel.cpp``: query blocks of 32/64/256 rows (sequence < 192,
    < 768, longer), key blocks of up to 512; forward ``buf`` (fp32) holds q @ k.T, row max and sum
    and an output block per thread, plus a low-precision copy of q @ k.T for bf16/fp16; backward
    holds attention and its gradient per thread, in fp32 and, for bf16/fp16, again in low precision,
    after a contiguous copy of the output gradient when it arrives strided.
    """
    backward = func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
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


_CPU_GEMM_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                 torch.ops.aten.baddbmm.default}
_GEMM_WORKSPACES: dict[tuple, int] = {}
GEMM_PROBE_MAX_BYTES = 64 * 2**20  # operands larger than this are not probed (workspace taken as 0)


def _low_precision(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) for a in args)


def gemm_cpu_workspace(func: Any, args: tuple, kwargs: dict[str, Any]) -> int:
    """Bytes a bf16/fp16 CPU matrix product allocates inside itself (oneDNN's packed operand blocks).

    Invisible at the dispatcher but counted by the CPU allocator: 18 KB to 1.6 MB for the small
    models' shapes (more when the left operand arrives transposed), which sets the step's peak
    where a backward GEMM meets the highest live set (ALBERT in bf16: -3.3% without it). The
    blocking depends on oneDNN's heuristics and the thread count, so the kernel is probed once
    per (op, shapes, strides, dtype, threads): run on real operands of the same layout, its
    allocator events read from the profiler. Not probed (0) when a profiler is already running
    or the operands exceed ``GEMM_PROBE_MAX_BYTES``.
    """
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    key = (func, tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors),
           tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))),
           torch.get_num_threads())
    if key not in _GEMM_WORKSPACES:
        _GEMM_WORKSPACES[key] = _probe_gemm(func, args, kwargs)
    return _GEMM_WORKSPACES[key]


def _probe_gemm(func: Any, args: tuple, kwargs: dict[str, Any]) -> int:
    """Highest allocator bytes inside one real run of ``func`` beyond its output (see above)."""
    from torch.utils._python_dispatch import _disable_current_modes

    size = sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))
    if size > GEMM_PROBE_MAX_BYTES or torch._C._autograd._profiler_enabled():
        return 0
    with _disable_current_modes():
        real = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype).zero_() if isinstance(a, torch.Tensor) else a
                for a in args]
        with warnings.catch_warnings(), _quiet_stderr():
            warnings.simplefilter("ignore")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                        profile_memory=True) as prof:
                out = func(*real, **kwargs)
        cpu = torch._C._autograd.DeviceType.CPU
        running = peak = 0
        for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
            if event.name() == "[memory]" and event.device_type() == cpu:
                running += event.nbytes()
                peak = max(peak, running)
        del out
    return max(0, peak - running)


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


def _bnb_cpu_kernel(op_name: str) -> Any:
    """bitsandbytes' Python CPU implementation of an optimizer op (None when unavailable)."""
    try:
        from bitsandbytes.backends.cpu import ops as cpu_ops
    except ImportError:  # pragma: no cover - bnb without a CPU backend
        return None
    if op_name.startswith("optimizer_update_8bit_blockwise"):
        return getattr(cpu_ops, "_optimizer_update_8bit_blockwise_cpu", None)
    if op_name.startswith("optimizer_update_32bit"):
        return getattr(cpu_ops, "_optimizer_update_32bit_cpu", None)
    return None


def _bnb_gemm_4bit_composite() -> Any:
    """bitsandbytes' dequantize-then-``linear`` implementation of ``gemm_4bit`` (None when unavailable)."""
    try:
        from bitsandbytes.backends.default import ops as default_ops
    except ImportError:  # pragma: no cover - bnb without its default backend
        return None
    return getattr(default_ops, "_gemm_4bit_default_impl", None)


# -- inputs ----------------------------------------------------------------------------------
def make_batch(config: Any, task: str, batch: int, seq_len: int, target_len: int, device: str) -> dict[str, torch.Tensor]:
    """The tensors ``default_data_collator`` would hand the model for ``task`` (call under the fake mode)."""
    vocab = int(getattr(config, "vocab_size", None) or 2)
    input_ids = torch.randint(0, vocab, (batch, seq_len), device=device)
    if task == "seq-cls":
        labels = torch.randint(0, max(int(getattr(config, "num_labels", 2)), 1), (batch,), device=device)
    elif task == "seq2seq":
        labels = torch.randint(0, vocab, (batch, target_len), device=device)
    else:
        labels = torch.randint(0, vocab, (batch, seq_len), device=device)
    return {"input_ids": input_ids, "labels": labels}


def accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """``Trainer.model_accepts_loss_kwargs`` for ``model``."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    params = inspect.signature(model.forward).parameters
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())


def loss_shifts_labels(model: torch.nn.Module) -> bool:
    """``Trainer._loss_shifts_labels``: causal-LM loss counts ``labels[..., 1:]``."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:  # pragma: no cover - older transformers
        return False
    config = getattr(model, "config", None)
    return LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss and not getattr(
        config, "is_encoder_decoder", False
    )


def wrap_autocast(model: torch.nn.Module, device: str, precision: str) -> None:
    """Wrap ``model.forward`` as ``Accelerator.prepare_model`` does for native AMP."""
    from accelerate.utils import convert_outputs_to_fp32

    dtype = MIXED_DTYPES[precision]
    autocast = torch.autocast(device_type=device, dtype=dtype)
    forward = model.forward.__func__ if hasattr(model.forward, "__func__") else model.forward
    model.forward = MethodType(autocast(forward), model)
    model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)


def enable_checkpointing(model: torch.nn.Module, args: Any = None) -> bool:
    """Activation checkpointing as ``Trainer.train()`` enables it from ``args`` (a run's
    ``TrainingArguments``; None: the defaults): ``every_n_layers`` and ``offload`` out of
    ``activation_checkpointing_kwargs``, the rest (``use_reentrant``...) to ``torch.utils.checkpoint``.

    A model that checkpoints already is left as it is: its copy carries exactly what the live model
    checkpoints — a subset of modules switched on by hand, a model's own ``_set_gradient_checkpointing``,
    PEFT's — and enabling it again would checkpoint every layer (measured, 4-layer GPT-2, CPU profiler,
    tests/test_checkpointing_as_configured.py: every second layer -25.45% under the truth before,
    -0.01% now; the first layer only -39.28% before, +0.00% now; ``use_reentrant=True`` -0.85%, -0.06% now).
    Returns whether it switched checkpointing on (undo with :func:`disable_checkpointing`).
    """
    from ..core.run_config import model_is_checkpointing

    if model_is_checkpointing(model):
        return False
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None)
                  or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    layout = {}
    if (every := kwargs.pop("every_n_layers", 1)) != 1:
        layout["every_n_layers"] = every
    if kwargs.pop("offload", False):
        layout["offload"] = True
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, **layout)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None, **layout)
    return True


def disable_checkpointing(model: torch.nn.Module) -> None:
    """Undo :func:`enable_checkpointing`: the next replay of the same fake model (the depth
    extrapolation replays 2 then 3 layers of one model) finds it as the caller gave it, not with the
    first replay's layers checkpointing and the next depth's new layer not (BERT demo: +12.6%)."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def packed_rows(sample: dict[str, Any] | None) -> bool:
    """Whether a real collated batch packs several sequences in a row (``position_ids`` restarting, as a
    padding-free collator forms them): transformers then builds a packed-sequence mask."""
    position_ids = (sample or {}).get("position_ids") if isinstance(sample, dict) else None
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or is_fake(position_ids):
        return False
    first = position_ids[:, :1] - 1
    return bool(((torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)[:, -1] != 0).any())


def padded_rows(sample: dict[str, Any] | None) -> bool:
    """Whether a real collated batch has padding (zeros in its ``attention_mask``): transformers then
    materialises the padding mask (a batch the length-grouped sampler forms of unequal samples)."""
    mask = sample.get("attention_mask") if isinstance(sample, dict) else None
    return isinstance(mask, torch.Tensor) and not is_fake(mask) and bool((mask == 0).any())


@contextlib.contextmanager
def real_batch_masks(packed: bool = False, padded: bool = False) -> Any:
    """Let transformers' mask code take the path it takes on the real batch: full rows, no padding.

    On a fake tensor transformers cannot read values, so its mask helpers play safe: they treat the
    tensor as traced, keep a packed-sequence mask and materialise causal and padding masks that a
    real run skips (one unpadded sequence per row, as the estimate's batches are — SDPA then gets
    ``is_causal`` instead of a mask). Within this context, ``masking_utils`` judges fake tensors
    as real ones, and its value checks (``fast_all``, packed-sequence detection) still run their
    operators, so their temporaries count, but answer as the real batch would: all ones, and packed
    only when the real batch is (``packed``: :func:`packed_rows`), padded only when it is (``padded``:
    :func:`padded_rows`; measured, the same samples padded into one batch: -3.7% without the mask; measured, 8 samples of 8-64 tokens
    flattened into one row of a tiny Llama: -8.5% under the profiler without the packed mask).
    """
    try:
        from torch._subclasses.fake_tensor import is_fake
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - older transformers
        yield
        return
    originals = {name: getattr(masking_utils, name, None)
                 for name in ("is_tracing", "fast_all", "find_packed_sequence_indices")}
    if any(value is None for value in originals.values()):  # pragma: no cover - other transformers
        yield
        return

    def is_tracing(tensor: Any = None) -> bool:
        return originals["is_tracing"]()  # graph capture only, not "this tensor is fake"

    def fast_all(tensor: torch.Tensor) -> Any:
        result = originals["fast_all"](tensor)
        return (not padded) if is_fake(result) else result

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if not is_fake(position_ids):
            return originals["find_packed_sequence_indices"](position_ids)
        first = position_ids[:, :1] - 1  # the detection's operators, as transformers runs them
        indices = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
        return indices if packed else None

    patched = {"is_tracing": is_tracing, "fast_all": fast_all,
               "find_packed_sequence_indices": find_packed_sequence_indices}
    for name, value in patched.items():
        setattr(masking_utils, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(masking_utils, name, value)


# -- classification --------------------------------------------------------------------------
def classify(snapshot: tuple[dict[int, Any], set[int]], live_now: dict[int, Any], weights: dict[int, Any],
             gradients: set[int], states: set[int], other: dict[int, Any],
             named: dict[int, tuple[Any, str]] | None = None,
             details: dict[str, dict[str, int]] | None = None) -> dict[str, int]:
    """Split a live-set snapshot into the six classes (each storage once, first class wins).

    Storage keys are addresses and get reused once a storage dies, so a snapshot entry belongs to
    a class only when it is the *same* storage: the tracker's reference object (one per storage
    lifetime) must match the one recorded for the class (``weights``/``other``: key -> ref) or
    the one live now (``gradients``/``states``: keys read now). Entries of ``named`` (key -> (ref,
    name)) are also added to ``details[class][name]`` when given.
    """
    live, saved = snapshot
    classes = dict.fromkeys(("weights", "gradients", "optimizer_states", "activations", "temporaries", "other"), 0)
    for key, ref in live.items():
        if weights.get(key) is ref:
            name = "weights"
        elif key in gradients and live_now.get(key) is ref:
            name = "gradients"
        elif key in states and live_now.get(key) is ref:
            name = "optimizer_states"
        elif key in saved:
            name = "activations"
        elif other.get(key) is ref:
            name = "other"
        else:
            name = "temporaries"
        classes[name] += ref.nbytes
        if named is not None and details is not None:
            label = named.get(key)
            if label is not None and label[0] is ref:
                inner = details.setdefault(name, {})
                inner[label[1]] = inner.get(label[1], 0) + ref.nbytes
    return classes


def _keys(tensors: Any) -> set[int]:
    keys: set[int] = set()
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            keys.add(tensor.untyped_storage()._cdata)
    return keys


def _refs(tracker: StorageTracker, tensors: Any) -> dict[int, Any]:
    """key -> the tracker's reference object of each tensor's storage (its identity for this lifetime)."""
    live = tracker.live_refs()
    return {key: live[key] for key in _keys(tensors) if key in live}


def _state_tensors(optimizer: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for state in optimizer.state.values():
        values = state.values() if isinstance(state, dict) else [state]
        found.extend(v for v in values if isinstance(v, torch.Tensor))
    return found


class _Phases:
    """Closes phase intervals: classify the interval's highest snapshot, keep the best per phase."""

    def __init__(self, tracker: EstimateTracker, model: torch.nn.Module, optimizer: Any,
                 weights: dict[int, Any], other: dict[int, Any]) -> None:
        self.tracker, self.model, self.optimizer = tracker, model, optimizer
        self.weights, self.other = weights, other
        self.best: dict[str, dict[str, int]] = {}
        self.details: dict[str, dict[str, dict[str, int]]] = {}
        self.tensors: dict[str, PeakTensors] = {}
        self.census: PeakCensusWatch | None = None

    def close(self, phase: str) -> None:
        tracker = self.tracker
        if tracker.snapshot is not None:
            grads = _keys(p.grad for p in self.model.parameters())
            states = _keys(_state_tensors(self.optimizer))
            details: dict[str, dict[str, int]] = {}
            classes = classify(tracker.snapshot, tracker.live_refs(), self.weights, grads, states, self.other,
                               tracker.named, details)
            if sum(classes.values()) > sum(self.best.get(phase, {}).values() or [-1]):
                self.best[phase] = classes
                self.details[phase] = details
                if self.census is not None:
                    self.tensors[phase] = self.census.summary(grads, states)
        if self.census is not None:
            self.census.after(phase)
        tracker.reset_peak()


# -- the step --------------------------------------------------------------------------------
# The phases of a step before its optimizer step (keys of ``StepSimulation.phase_classes``).
FORWARD_BACKWARD_PHASES = ("after_forward", "after_backward")
GENERATION_PHASE = "generation"  # a step that generates (TRL's online trainers): the decoding loop's high


def simulate_step(
    model: torch.nn.Module, fake_mode: Any, *, config: Any, task: str, batch_size: int, seq_len: int,
    target_len: int, precision: str, optim: str, checkpointing: bool, accum: int, device: str,
    max_grad_norm: float, steps: int = 2, trainer: Any = None, sample: Any = None,
    optimizer_step: bool = True, replay: Any = None, top: int = 0,
) -> StepSimulation:
    """Run ``steps`` Trainer optimizer steps on the fake ``model``; the peak and its split.

    All but the last step only prime the optimizer (see :func:`_prime_optimizer`). With ``trainer``,
    each micro-step is that Trainer's own ``training_step`` (its ``compute_loss``, loss scaling and
    ``num_items_in_batch`` count) — the caller guards the Trainer's state
    (:class:`~hf_memwatch.estimation.trainer_replay.TrainerStateGuard`); with ``sample`` (a collated
    batch of real tensors), every micro-batch is a fake copy of it instead of a synthetic batch.
    ``top`` > 0: the ``top`` largest tensors alive at each phase's high, grouped by module and
    operator (``phase_tensors``; :class:`~hf_memwatch.estimation.peak.PeakCensusWatch`).
    ``optimizer_step=False`` replays the forward and backward alone, without optimizer state
    (nothing primed, no clipping, no step): only the ``after_forward``/``after_backward`` phases,
    which lie under the full step's by exactly the optimizer states that would be resident.
    ``replay`` (a :class:`~hf_memwatch.estimation.trl_replay.TrainerReplay`, with ``trainer``): the
    Trainer's models swapped for fakes around its micro-steps — generation inside the step, held
    models' forwards — and its first micro-steps replayed as they run where it asks
    (``replay.micro_steps()``).
    """
    notes: list[str] = []
    model.train()
    enabled = bool(checkpointing) and enable_checkpointing(model, getattr(trainer, "args", None))
    saved_forward = model.__dict__.get("forward")
    saved_use_cache = _disable_kv_cache(model)
    target, device = device, "cpu"  # a CUDA target is simulated on fake CPU tensors (see module doc)
    if precision in MIXED_DTYPES:
        wrap_autocast(model, device, precision)
    optimizer = build_optimizer(model, optim, target)
    takes_loss_kwargs = accepts_loss_kwargs(model)
    shifts = loss_shifts_labels(model)

    def new_batch() -> dict[str, Any]:
        if sample is not None:
            return fake_batch(sample)
        return make_batch(config, task, batch_size, seq_len, target_len, device)

    saved = SavedTensorRegistry()
    tracker = EstimateTracker(
        device, saved, round_to=CUDA_BLOCK if target == "cuda" else 1,
        bnb_cpu_kernels=(target == "cpu" and optim in BNB_OPTIMS),
    )
    weights_of_model = weight_tensors(model)  # quantization state included
    if top > 0:
        tracker.census = PeakCensus()  # before the weights: it knows every storage the tracker does
    tracker.register(weights_of_model)
    held_weights = list(replay.held_weights) if replay is not None else []  # a Trainer's other models
    tracker.register(held_weights)
    _name_frozen_weights(tracker, model)
    vocab = getattr(config, "vocab_size", None)
    if task != "seq-cls" and isinstance(vocab, int) and vocab > 1:  # after the weights: never named
        tracker.name_logits(vocab, batch_size, precision in MIXED_DTYPES)
    weights = _refs(tracker, weights_of_model + held_weights)
    other: dict[int, Any] = {}
    phases = _Phases(tracker, model, optimizer, weights, other)
    if top > 0:
        phases.census = PeakCensusWatch(tracker, saved, model, optimizer, weights, other, top)
    params = [p for p in model.parameters() if p.requires_grad]

    with warnings.catch_warnings(), real_batch_masks(packed_rows(sample), padded_rows(sample)), fake_mode, tracker:
        warnings.simplefilter("ignore")
        saved.start()
        try:
            tr_loss = torch.tensor(0.0, device=device)
            other.update(_refs(tracker, [tr_loss]))
            lookahead = new_batch()
            for _ in range(steps - 1 if optimizer_step else 0):
                _prime_optimizer(optimizer, params)
            # A step begins with no gradient: the Trainer zeroes them (set to None) after every optimizer
            # step, as priming does; the model handed in may hold some.
            optimizer.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            phases.close("after_optimizer")
            batches = [lookahead] + [new_batch() for _ in range(accum - 1)]
            lookahead = new_batch()
            for b in batches + [lookahead]:
                other.update(_refs(tracker, batch_tensors(b)))
            num_items = None
            if trainer is not None:
                num_items = trainer._get_num_items_in_batch(batches, torch.device(device))
                if isinstance(num_items, torch.Tensor):
                    other.update(_refs(tracker, [num_items]))
            elif takes_loss_kwargs:
                labels = [b["labels"][..., 1:] if shifts else b["labels"] for b in batches]
                num_items = sum(lab.ne(-100).sum() for lab in labels).to(device)
                other.update(_refs(tracker, [num_items]))
            replayed = batches[:1]
            natural = replay.micro_steps() if replay is not None else 0
            if natural:
                # A step that generates: its first micro-step (no gradient yet) and the next (gradients
                # resident, the buffered completions) differ; both replayed as they run.
                replayed = batches[:natural]
            elif len(batches) > 1:
                # Every micro-step after the first runs with the gradients resident and adds into them:
                # the same live set as the first plus the gradients, so its peak is the step's (the
                # first one's cannot be higher). It alone is replayed, the gradients made resident as
                # the first micro-step leaves them; all batches stay prefetched.
                for param in params:
                    param.grad = torch.zeros_like(param)
                replayed = batches[1:2]
            tracker.reset_peak()
            for inputs in replayed:
                if trainer is not None:
                    # The Trainer's own micro-step: forward and loss (subclass overrides included), its
                    # scaling, backward. "after_forward" closes when the model's forward returns.
                    hook = model.register_forward_hook(_close_after_forward(phases, replay))
                    try:
                        with (replay.running(model, tracker, phases.close) if replay is not None
                              else contextlib.nullcontext()):
                            loss = trainer.training_step(model, inputs, num_items)
                    finally:
                        hook.remove()
                    del inputs
                    phases.close("after_backward")
                    tr_loss += loss
                    del loss
                    continue
                loss = _forward_loss(model, inputs, num_items)
                del inputs
                if num_items is None:
                    loss = loss / accum
                phases.close("after_forward")
                loss.backward()
                phases.close("after_backward")
                tr_loss += loss.detach()
                del loss
            del batches, replayed
            if not optimizer_step:
                kept = (*FORWARD_BACKWARD_PHASES, GENERATION_PHASE)
                return StepSimulation(
                    {phase: phases.best[phase] for phase in kept if phase in phases.best},
                    notes, {phase: phases.details.get(phase, {}) for phase in kept if phase in phases.best},
                    {phase: t for phase, t in phases.tensors.items() if phase in kept})
            if max_grad_norm and max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            phases.close("after_optimizer")
            optimizer.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            phases.close("step_end")
        finally:
            saved.stop()
            if phases.census is not None:
                phases.census.close()
            _restore_forward(model, saved_forward)
            _restore_kv_cache(model, saved_use_cache)
            if enabled:
                disable_checkpointing(model)
    return StepSimulation(dict(phases.best), notes, dict(phases.details), dict(phases.tensors))


def _close_after_forward(phases: _Phases, replay: Any) -> Any:
    """The forward hook that closes ``after_forward`` (not on a decoding step inside ``generate``)."""
    def hook(*_: Any) -> None:
        if replay is None or not replay.generating:
            phases.close("after_forward")
    return hook


def _name_frozen_weights(tracker: EstimateTracker, model: torch.nn.Module) -> None:
    """With frozen parameters (PEFT, a frozen backbone), split weights into ``frozen``/``trainable``.

    Buffers count as frozen. A full fine-tune gets no split (everything is trainable).
    """
    params = list(model.parameters())
    if all(p.requires_grad for p in params):
        return
    for tensor in weight_tensors(model):
        key = tensor.untyped_storage()._cdata
        ref = tracker._live.get(key)
        if ref is not None:
            trainable = isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad
            tracker.named[key] = (ref, "trainable" if trainable else "frozen")


_NO_CONFIG = object()


def _disable_kv_cache(model: torch.nn.Module) -> Any:
    """``config.use_cache = False``, as ``Trainer.__init__`` sets it (``args.use_cache``, default False).

    With the cache on, a training forward builds a ``DynamicCache`` whose update copies strided
    key/value views (GPT-NeoX, Phi-3: slices of a fused QKV projection) into fresh storages, so
    autograd saves the copies instead of views of the fused output. Returns the previous value.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "use_cache"):
        return _NO_CONFIG
    previous = config.use_cache
    config.use_cache = False
    return previous


def _restore_kv_cache(model: torch.nn.Module, previous: Any) -> None:
    """Undo :func:`_disable_kv_cache`."""
    if previous is not _NO_CONFIG:
        model.config.use_cache = previous


def _restore_forward(model: torch.nn.Module, saved_forward: Any) -> None:
    """Undo :func:`wrap_autocast` (the fake model may be simulated again)."""
    if saved_forward is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = saved_forward


def _prime_optimizer(optimizer: Any, params: list[torch.nn.Parameter]) -> None:
    """An earlier optimizer step, short: create the lazily built state (gradients of the right shapes).

    The forward and backward of the earlier step are the later one's without optimizer state, so
    they cannot be higher and are not replayed; the state creation itself is tracked.
    """
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _forward_loss(model: torch.nn.Module, inputs: dict[str, torch.Tensor], num_items: Any) -> torch.Tensor:
    """``Trainer.compute_loss``: outputs are dropped on return, only the loss survives."""
    kwargs = dict(inputs)
    if num_items is not None:
        kwargs["num_items_in_batch"] = num_items
    outputs = model(**kwargs)
    return outputs["loss"] if isinstance(outputs, dict) else outputs[0]
