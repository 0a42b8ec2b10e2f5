"""CUDA autocast's cast policy, applied to a CUDA target's replay on fake CPU tensors.

Every target is replayed on fake CPU tensors (:mod:`.replay`), so a mixed-precision step runs under
``torch.autocast("cpu")``, whose op lists differ from CUDA's: CPU autocast leaves softmax, layer and
RMS norms, ``pow``, ``exp``, ``sum``, the losses... in the input's dtype, where CUDA autocast runs them
in fp32 — ``gelu_new``'s ``pow`` turns GPT-2's MLP activation fp32 from there on, BERT's eager
attention saves an fp32 softmax. Within :func:`cuda_autocast_policy`, the replay's CPU autocast casts
as AutocastCUDA does. Measured (``estimate``, batch 4 x 64 tokens, 2 layers of 128, bf16, H100): GPT-2
18,508,288 → 20,081,152 bytes (+8.5%), BERT with eager attention 15,693,824 → 16,284,672 (+3.8%),
Llama 15,368,192 unchanged (its RMSNorm and softmax upcast by hand, its loss on ``logits.float()``);
GPT-2 124M at 8 x 512 tokens, 10.51 → 11.42 GB.

The policy is torch's own, read in ``aten/src/ATen/autocast_mode.h`` (the installed header's
``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``, ``AT_FORALL_PROMOTE``) and ``autocast_mode.cpp``
(``TORCH_LIBRARY_IMPL(aten, Autocast, m)``, which adds ``cudnn_convolution``/``_transpose`` as
lower_precision_fp and bans ``binary_cross_entropy``); :data:`CUDA_AUTOCAST_TABLES` holds it per torch
version (torch 2.13: 119 ops, exactly what the build registers for ``AutocastCUDA``,
``torch._C._dispatch_get_registrations_for_dispatch_key``). Each policy's wrapper is
``WrapFunction_<CastPolicy::...>`` in the header, mirrored here:

* ``lower_precision_fp``/``fp32``: every floating tensor argument ``cached_cast`` to the autocast dtype
  / fp32;
* ``fp32_set_opt_dtype`` (softmax, log_softmax, sum, cumsum, prod, the vector/matrix norms): when the
  first argument is eligible, ``dtype=float32`` unless a dtype was passed (``set_opt_dtype``); a half
  softmax/log_softmax asked for fp32 then runs CUDA's fused ``half_to_float`` kernel, without an fp32
  copy of its input (:data:`HALF_TO_FLOAT`);
* ``fp32_append_dtype`` (``norm.Scalar``, ``norm.ScalarOpt_dim``): redispatched to the ``*_dtype``
  overload with fp32 appended (the input's own dtype when it is not eligible);
* ``promote``: cast to the widest floating dtype among the arguments (``promote_type``/``prioritize``:
  fp32 wins, doubles ignored, the autocast dtype mixed with another half type is an error).

``cached_cast`` (``autocast_mode.cpp``) casts an *eligible* tensor (floating point, not float64, on the
autocast device: every fake CPU tensor of the replay stands for a CUDA one) and caches the cast of a
leaf fp32 tensor that requires grad and is no view (a parameter) to the autocast dtype while the cache
is enabled: one copy per autocast region, held until ``torch.autocast.__exit__`` leaves the outermost
region (``autocast_decrement_nesting() == 0`` → ``torch.clear_autocast_cache()``), which clears this
module's cache too while the policy is on. Activation checkpointing's recomputation re-enters
``torch.autocast("cpu")`` (``torch.utils.checkpoint``), so it recomputes under the same policy.

The mechanism: for the policy's duration, a Python kernel on the **AutocastCPU** dispatch key of every
op either key registers (``torch.library.Library("aten", "IMPL")``) — the same place in the dispatch
as torch's own autocast kernels, above Autograd, so autograd records the casts (a parameter's bf16
copy is what ``linear`` saves). Each kernel excludes AutocastCPU, casts as CUDA's policy says and
calls the op again, as ``WrapFunction_::call`` does; an op only CPU autocast registers gets a
fallthrough (CUDA has no kernel for it: its composite's inner ops are autocast each, as on CUDA).
``Library._destroy`` on exit puts torch's CPU autocast kernels back. The override is process-wide
while it is on (the dispatcher's table is): a CPU autocast in another thread during a CUDA replay
would cast as CUDA does.

A torch version without its own table uses the closest one at or below it (else the newest), and a
table that differs from the ops the running build registers for AutocastCUDA is reported: both as a
warning on the ``hf_memwatch`` logger (:func:`policy_table`) and in a CUDA estimate's notes
(:func:`policy_notes`), never silently.

Example:
    >>> import torch
    >>> x = torch.randn(2, 4).bfloat16()
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     with cuda_autocast_policy():
    ...         cuda = torch.softmax(x, -1).dtype
    ...     cpu = torch.softmax(x, -1).dtype
    >>> cuda, cpu
    (torch.float32, torch.bfloat16)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..compat.torch_dispatcher import (
    OpOverload,
    destroy_library,
    dispatch_registrations,
    excluding_dispatch_key,
    is_view,
    op_arguments,
)
from ..compat.torch_ops import LOG_SOFTMAX, SOFTMAX
from .trainer_mirror import MIXED_DTYPES

logger = logging.getLogger("hf_memwatch")

KEY = "AutocastCPU"  # the replay's autocast key (fake CPU tensors), where the CUDA policy's kernels go

# CUDA autocast's op lists per torch version ("major.minor"), op names as the dispatcher registers them
# ("overload" appended after a dot). Lists in the header's order; autocast_mode.cpp's additions last.
CUDA_AUTOCAST_TABLES: dict[str, dict[str, tuple[str, ...]]] = {
    "2.13": {
        "lower_precision_fp": (
            "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
            "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu",
            "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
            "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
            "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
            "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
            "cudnn_convolution", "cudnn_convolution_transpose"),  # the last two: autocast_mode.cpp
        "fp32": (
            "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
            "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
            "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim",
            "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
            "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
            "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
            "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits",
            "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
            "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
            "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
            "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa"),
        "fp32_set_opt_dtype": (
            "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
            "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList"),
        "fp32_append_dtype": ("norm.Scalar", "norm.ScalarOpt_dim"),
        "promote": (
            "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
            "tensordot", "scatter_add"),
        "banned": ("binary_cross_entropy",),  # autocast_mode.cpp: binary_cross_entropy_banned
    },
}
# The overload each fp32_append_dtype op redispatches to (AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE's
# REDISPATCH_SIGNATURE: at::norm with a trailing ScalarType).
APPEND_DTYPE_REDISPATCH = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
# autocast_mode.cpp's own registrations for AutocastCUDA, beside the header's macro lists.
OUTSIDE_HEADER = ("cudnn_convolution", "cudnn_convolution_transpose", "binary_cross_entropy")

_BANNED_MESSAGE = ("binary_cross_entropy is banned under CUDA autocast, where a real run fails on it "
                   "(autocast_mode.cpp, binary_cross_entropy_banned): use binary_cross_entropy_with_logits")


def version_key(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` → ``(2, 13)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def table_for(version: str) -> tuple[str, str | None]:
    """The table key for torch ``version`` and a note when it is not that version's own: the closest
    table at or below it, else the newest."""
    wanted = version_key(version)
    keys = sorted(CUDA_AUTOCAST_TABLES, key=version_key)
    own = f"{wanted[0]}.{wanted[1]}"
    if own in CUDA_AUTOCAST_TABLES:
        return own, None
    below = [key for key in keys if version_key(key) <= wanted]
    key = below[-1] if below else keys[-1]
    return key, (f"CUDA autocast policy: no table for torch {version}; torch {key}'s op lists are used "
                 "(hf_memwatch/estimation/cuda_autocast.py)")


def registered_ops(dispatch_key: str) -> set[str]:
    """The aten ops the running build registers for ``dispatch_key`` (``"softmax.int"``, ``"sum"``)."""
    names = dispatch_registrations(dispatch_key)
    return {name.removeprefix("aten::") for name in names if name.startswith("aten::")}


def table_ops(table: dict[str, tuple[str, ...]]) -> set[str]:
    """Every op a table names."""
    return {op for ops in table.values() for op in ops}


@functools.cache
def policy_table(version: str = torch.__version__) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """The table for torch ``version`` (the running one) and its notes, each logged once as a warning: a
    table borrowed from another version, a table that differs from the ops this build registers for
    AutocastCUDA."""
    key, note = table_for(version)
    table = CUDA_AUTOCAST_TABLES[key]
    notes = [note] if note else []
    registered = registered_ops("AutocastCUDA")
    if registered and registered != table_ops(table):
        unknown, gone = sorted(registered - table_ops(table)), sorted(table_ops(table) - registered)
        notes.append(f"CUDA autocast policy: torch {torch.__version__} registers for AutocastCUDA "
                     f"{unknown or 'nothing'} beyond torch {key}'s table (not cast), "
                     f"and not {gone or 'nothing'} of it")
    for line in notes:
        logger.warning(line)
    return table, tuple(notes)


def policy_notes(precision: str | None, version: str = torch.__version__) -> tuple[str, ...]:
    """A CUDA estimate's notes on the policy its replay casts by (mixed ``precision`` only): none when
    torch ``version`` (the running one) has its own table."""
    return policy_table(version)[1] if precision in MIXED_DTYPES else ()


# -- the casts (autocast_mode.h) ---------------------------------------------------------------------

def eligible(arg: Any) -> bool:
    """``is_eligible``: a floating tensor, not float64, on the autocast device (a fake CPU tensor of the
    replay stands for a CUDA one)."""
    return (isinstance(arg, torch.Tensor) and arg.device.type == "cpu" and arg.is_floating_point()
            and arg.dtype != torch.float64)


class WeightCache:
    """``cached_casts`` of ``autocast_mode.cpp``: the autocast-dtype cast of a leaf fp32 tensor that
    requires grad (a parameter), made once and held until the outermost autocast region exits. Keyed by
    the source tensor, a weak reference kept (as the C++ cache's weakref) so a recycled id never hits."""

    def __init__(self) -> None:
        self.casts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def cast(self, to_type: torch.dtype, arg: torch.Tensor) -> torch.Tensor:
        """``cached_cast(to_type, arg)`` for an eligible tensor."""
        if arg.dtype == to_type:
            return arg
        if (to_type == torch.get_autocast_dtype("cpu") and arg.dtype == torch.float32 and arg.requires_grad
                and arg.is_leaf and not is_view(arg) and torch.is_autocast_cache_enabled()):
            hit = self.casts.get(id(arg))
            if hit is not None and hit[0]() is arg:
                return hit[1]
            casted = arg.to(to_type)
            self.casts[id(arg)] = (weakref.ref(arg), casted)
            return casted
        return arg.to(to_type)

    def clear(self) -> None:
        self.casts.clear()


class _Signature:
    """Where an op's tensor arguments are (``Tensor``, ``Tensor?``, ``Tensor[]``: what ``cached_cast``
    and ``prioritize`` have overloads for; ``Tensor?[]`` passes through as in C++), and its defaults."""

    def __init__(self, op: OpOverload) -> None:
        self.op = op
        args = op_arguments(op)
        self.positional = [a for a in args if not a.kwarg_only]
        kinds = {"Tensor": "tensor", "Optional[Tensor]": "tensor", "List[Tensor]": "list"}
        self.kinds = {arg.name: kinds[str(arg.type)] for arg in args if str(arg.type) in kinds}
        self.names = [a.name for a in self.positional]

    def tensor_args(self, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
        """Every tensor argument, lists flattened."""
        for index, value in enumerate(args):
            yield from self._tensors(self.kinds.get(self.names[index]), value)
        for name, value in kwargs.items():
            yield from self._tensors(self.kinds.get(name), value)

    @staticmethod
    def _tensors(kind: str | None, value: Any) -> Iterator[torch.Tensor]:
        if kind == "tensor" and isinstance(value, torch.Tensor):
            yield value
        elif kind == "list" and value is not None:
            yield from (t for t in value if isinstance(t, torch.Tensor))

    def cast(self, args: tuple, kwargs: dict, cast: Callable[[torch.Tensor], torch.Tensor]) -> tuple[tuple, dict]:
        """``args``/``kwargs`` with ``cast`` applied to each eligible tensor argument."""
        def one(kind: str | None, value: Any) -> Any:
            if kind == "tensor" and eligible(value):
                return cast(value)
            if kind == "list" and value is not None:
                return [cast(t) if eligible(t) else t for t in value]
            return value
        return (tuple(one(self.kinds.get(self.names[i]), v) for i, v in enumerate(args)),
                {name: one(self.kinds.get(name), v) for name, v in kwargs.items()})

    def padded(self, args: tuple) -> tuple:
        """``args`` with the trailing positional defaults the Python kernel was not handed."""
        missing = self.positional[len(args):]
        return tuple(args) + tuple(a.default_value for a in missing)


def _excluded() -> Any:
    """``ExcludeDispatchKeyGuard no_autocast(...)``: the replay's autocast key off for the call."""
    return excluding_dispatch_key("AutocastCPU")


def _overload(name: str) -> OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _exists(name: str) -> bool:
    try:
        _overload(name)
    except (AttributeError, RuntimeError):
        return False
    return True


def promote_type(lower: torch.dtype, tensors: Iterator[torch.Tensor]) -> torch.dtype:
    """``promote_type``/``prioritize``: the widest floating dtype among the eligible tensors, from the
    autocast dtype up (fp32 wins; a float64 tensor is ignored; another half type is an error, as in C++)."""
    current = lower
    for tensor in tensors:
        if not (isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.is_floating_point()):
            continue
        nxt = tensor.dtype
        if nxt == torch.float64:
            continue
        if current == torch.float32 or nxt == torch.float32:
            current = torch.float32
        elif not (current == lower and nxt == lower):
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


# SoftMax.cpp, ``softmax``/``log_softmax(const Tensor& input_, int64_t dim_, std::optional<ScalarType>
# dtype)``: a CUDA half input asked for float runs ``at::_softmax(input_, dim_, /*half_to_float=*/true)``
# — no fp32 copy of the input, and the backward hands back a half gradient
# (``_softmax_backward_data(..., input_dtype=Half)``) — where any other input is converted first
# (``input_.toType(dtype)``), as the CPU kernel does for every input. With fp16 autocast, every softmax
# of a half tensor takes that path (fp32_set_opt_dtype sets dtype=float32).
HALF_TO_FLOAT = {"softmax.int": SOFTMAX, "log_softmax.int": LOG_SOFTMAX}


def _dtype_of(args: tuple, kwargs: dict) -> Any:
    """softmax's / log_softmax's ``dtype`` argument (the third)."""
    return args[2] if len(args) > 2 else kwargs.get("dtype")


def _kernel(policy: str, name: str, cache: WeightCache) -> Callable[..., Any]:
    """The Python kernel of ``name`` under ``policy`` (``WrapFunction_<policy>::call``)."""
    op = _overload(name)
    sig = _Signature(op)

    if policy in ("lower_precision_fp", "fp32"):
        def kernel(*args: Any, **kwargs: Any) -> Any:
            with _excluded():
                to_type = torch.get_autocast_dtype("cpu") if policy == "lower_precision_fp" else torch.float32
                args, kwargs = sig.cast(args, kwargs, lambda t: cache.cast(to_type, t))
                return op(*args, **kwargs)
    elif policy == "promote":
        def kernel(*args: Any, **kwargs: Any) -> Any:
            with _excluded():
                to_type = promote_type(torch.get_autocast_dtype("cpu"), sig.tensor_args(args, kwargs))
                args, kwargs = sig.cast(args, kwargs, lambda t: cache.cast(to_type, t))
                return op(*args, **kwargs)
    elif policy == "fp32_set_opt_dtype":
        position = sig.names.index("dtype") if "dtype" in sig.names else None
        fused = HALF_TO_FLOAT.get(name)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            with _excluded():
                if eligible(args[0]):
                    if position is not None and len(args) > position:
                        if args[position] is None:
                            args = args[:position] + (torch.float32,) + args[position + 1:]
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                if fused is not None and args[0].dtype == torch.float16 and _dtype_of(args, kwargs) == torch.float32:
                    return fused(args[0], args[1], True)
                return op(*args, **kwargs)
    elif policy == "fp32_append_dtype":
        redispatch = _overload(APPEND_DTYPE_REDISPATCH[name])

        def kernel(*args: Any, **kwargs: Any) -> Any:
            with _excluded():
                first = args[0]
                out_type = torch.float32 if eligible(first) else first.dtype
                return redispatch(*sig.padded(args), **kwargs, dtype=out_type)
    elif policy == "banned":
        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(_BANNED_MESSAGE)
    else:  # pragma: no cover - a table naming an unknown policy
        raise ValueError(f"unknown autocast policy {policy!r}")
    kernel.__name__ = f"cuda_autocast_{policy}_{name}"
    return kernel


_active: list[Any] = []  # the policy on now (re-entered: the outer one stays)


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[WeightCache]:
    """For the duration, the replay's CPU autocast casts as CUDA autocast does (see the module doc);
    torch's own AutocastCPU kernels back on every exit path. Re-entering it keeps the outer one on."""
    if _active:
        yield _active[-1]
        return
    table, _notes = policy_table()
    cache = WeightCache()
    lib = torch.library.Library("aten", "IMPL")
    original_clear = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:  # torch.autocast.__exit__ leaving the outermost region
        original_clear()
        cache.clear()

    cpu_only = sorted(registered_ops(KEY) - table_ops(table))  # CPU autocast's own: no kernel on CUDA
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": on purpose
            for policy, ops in table.items():
                for name in ops:
                    if _exists(name):  # a borrowed table may name an op this torch lacks (noted)
                        lib.impl(name, _kernel(policy, name, cache), KEY)
            for name in cpu_only:
                lib.impl(name, torch.library.fallthrough_kernel, KEY)
        torch.clear_autocast_cache = clear_autocast_cache
        _active.append(cache)
        yield cache
    finally:
        if _active and _active[-1] is cache:
            _active.pop()
        torch.clear_autocast_cache = original_clear
        cache.clear()
        destroy_library(lib)
