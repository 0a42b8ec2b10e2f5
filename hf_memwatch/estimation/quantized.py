"""Quantized bases (QLoRA) on the estimator's fake model: bitsandbytes 4-bit and 8-bit linears.

A :class:`QuantSpec` says how the base is loaded (what ``BitsAndBytesConfig`` says). On a config, the
meta-device model is converted by transformers' own bitsandbytes quantizer (the modules it keeps
in full precision — the LM head, ``llm_int8_skip_modules`` — are its choice, as at load time) and
prepared by PEFT's ``prepare_model_for_kbit_training`` (everything frozen, non-quantized fp16/bf16
parameters upcast to fp32). Each quantized weight then gets its fake twin *by bitsandbytes itself*:
:func:`fake_quantized_param` runs ``bitsandbytes.functional.quantize_4bit`` (or the 8-bit row-wise
quantizer) on a fake tensor, so the packed data, the absmax per block, the nested statistics and
the code tables have exactly the shapes and dtypes a real load gives, and nothing is allocated. A
built quantized model (a Trainer's) keeps its quantization state: each of its tensors is replaced
by a fake of the same shape, so ``Linear4bit.forward`` runs as on the real model.

The quantized storage is a weight like any other (:func:`quant_state_tensors`, counted by
:func:`hf_memwatch.measure.attribution.weight_storages`): a 4-bit weight is ``numel / 2`` bytes
plus an fp32 absmax per 64 values (with double quantization a uint8 per block plus an fp32 per 256
blocks), an 8-bit weight ``numel`` bytes plus an fp32 scale per row.

Usage:
    >>> estimate(config, micro_batch_size=4, seq_len=512, quantization=QuantSpec(bits=4),  # doctest: +SKIP
    ...          lora=LoraSpec(r=16, targets="all-linear"))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.choices import COMPUTE_DTYPE_NAMES, QUANT_TYPES
from ..core.errors import MemWatchConfigError
from ..core.extras import MissingExtra, install_hint

COMPUTE_DTYPES = dict(zip(COMPUTE_DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


def require_bitsandbytes(what: str) -> None:
    """Fail fast, in one line, when ``what`` needs bitsandbytes and it is not installed."""
    try:
        import bitsandbytes  # noqa: F401 - imported to know it imports (a broken install fails here, not mid-step)
    except ImportError:
        raise MissingExtra(f"{what} needs bitsandbytes, which is not installed ({install_hint('bitsandbytes')})") from None


@dataclass(frozen=True)
class QuantSpec:
    """A bitsandbytes-quantized base as ``BitsAndBytesConfig`` loads it.

    ``bits`` 4 (``load_in_4bit``) or 8 (``load_in_8bit``); for 4 bits ``quant_type``
    (``bnb_4bit_quant_type``: nf4 or fp4), ``double_quant`` (``bnb_4bit_use_double_quant``) and
    ``compute_dtype`` (``bnb_4bit_compute_dtype``: fp32, bf16 or fp16: the dtype the weight is
    dequantized to for each matmul).
    """

    bits: int = 4
    quant_type: str = "nf4"
    double_quant: bool = False
    compute_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or isinstance(self.bits, bool):
            raise MemWatchConfigError(f"quantization bits must be 4 or 8; got {self.bits!r}")
        if self.quant_type not in QUANT_TYPES:
            raise MemWatchConfigError(f"bnb 4-bit quant type must be one of {', '.join(QUANT_TYPES)}; "
                                      f"got {self.quant_type!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise MemWatchConfigError(f"bnb 4-bit compute dtype must be one of {', '.join(COMPUTE_DTYPES)}; "
                                      f"got {self.compute_dtype!r}")
        if self.bits == 8 and (self.quant_type != "nf4" or self.double_quant or self.compute_dtype != "fp32"):
            raise MemWatchConfigError("quant type, double quantization and compute dtype are 4-bit options")
        require_bitsandbytes(f"load_in_{self.bits}bit")

    def bnb_config(self) -> Any:
        """The ``transformers.BitsAndBytesConfig`` of this spec."""
        from transformers import BitsAndBytesConfig

        if self.bits == 8:
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=self.quant_type,
                                  bnb_4bit_use_double_quant=self.double_quant,
                                  bnb_4bit_compute_dtype=COMPUTE_DTYPES[self.compute_dtype])


def quantize_meta(model: torch.nn.Module, spec: QuantSpec) -> torch.nn.Module:
    """Convert a meta-device transformers model as ``from_pretrained(quantization_config=...)`` does,
    then ``peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)``.

    Checkpointing is left to the run's ``checkpointing`` setting (the Trainer's), not switched on here.
    """
    try:
        from peft import prepare_model_for_kbit_training
    except ImportError:
        raise MemWatchConfigError("a quantized base trains adapters: it needs peft (pip install peft)") from None
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(spec.bnb_config(), pre_quantized=False)
    quantizer.preprocess_model(model, device_map={"": "cpu"})
    # ``from_pretrained`` loads in the checkpoint's dtype (``dtype="auto"``) and quantizes from it: the
    # quantization state remembers it, and the backward dequantizes to it before casting.
    source = getattr(model.config, "dtype", None)
    if isinstance(source, torch.dtype) and source.is_floating_point:
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if type(weight).__name__ == "Params4bit" and weight.dtype != source:
                weight.data = weight.data.to(source)
    # What the quantizer sets after loading the weights (is_loaded_in_4bit/8bit, the config).
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def _prime_code_tables() -> None:
    """Build bitsandbytes' shared 8-bit dynamic code table on real memory, once.

    The nested (double) quantization builds it lazily from Python floats (``.tolist()``), which a fake
    tensor cannot give; built first, it is the cached table every real load shares too.
    """
    import bitsandbytes.functional as bnb_functional

    bnb_functional.quantize_blockwise(torch.zeros(256), blocksize=256)


def fake_quantized_param(param: torch.Tensor, fake_mode: Any, memo: dict[int, Any]) -> torch.Tensor:
    """The fake twin of a bitsandbytes parameter, quantization state included.

    A quantized parameter keeps its state, each tensor replaced (through ``memo``: shared code
    tables stay shared) by a fake of the same shape; a not yet quantized one (a meta model after
    :func:`quantize_meta`) is quantized by bitsandbytes on a fake tensor. The twin is a fake tensor
    marked as a parameter, as ``nn.Parameter(fake)`` gives (a tensor subclass cannot wrap a fake
    one), carrying the attributes bitsandbytes' layers read (``quant_state``; ``CB``/``SCB``).
    """
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_functional

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in memo:
            with torch.no_grad():
                memo[id(tensor)] = fake_mode.from_tensor(tensor.detach())
        return memo[id(tensor)]

    if isinstance(param, bnb.nn.Params4bit):
        if param.bnb_quantized:
            data, state = fake(param), _fake_state(param.quant_state, fake)
        else:
            if param.compress_statistics:
                _prime_code_tables()
            with fake_mode:
                source = torch.empty(param.shape, dtype=param.dtype, device="cpu")
                data, state = bnb_functional.quantize_4bit(
                    source, blocksize=param.blocksize, compress_statistics=param.compress_statistics,
                    quant_type=param.quant_type, quant_storage=param.quant_storage)
        twin = torch.nn.Parameter(data, requires_grad=False)
        for name in ("blocksize", "compress_statistics", "quant_type", "quant_storage"):
            setattr(twin, name, getattr(param, name))
        twin.quant_state, twin.bnb_quantized, twin.module = state, True, None
        return twin
    # Int8Params: int8 data (CB) and an fp32 scale per output row (SCB), as ``Int8Params._quantize`` keeps them
    if getattr(param, "SCB", None) is not None:
        data, scales = fake(param), fake(param.SCB)
    else:
        with fake_mode:
            data = torch.empty(param.shape, dtype=torch.int8, device="cpu")
            scales = torch.empty(param.shape[0], dtype=torch.float32, device="cpu")
    twin = torch.nn.Parameter(data, requires_grad=False)
    twin.CB, twin.SCB, twin.has_fp16_weights = data, scales, False
    return twin


def _fake_state(state: Any, fake: Any) -> Any:
    """A copy of a bitsandbytes ``QuantState`` whose tensors are fakes."""
    import bitsandbytes.functional as bnb_functional

    if state is None:
        return None
    offset = state.offset if not isinstance(state.offset, torch.Tensor) else fake(state.offset)
    return bnb_functional.QuantState(
        absmax=fake(state.absmax), shape=state.shape, code=fake(state.code), blocksize=state.blocksize,
        quant_type=state.quant_type, dtype=state.dtype, offset=offset, state2=_fake_state(state.state2, fake))
