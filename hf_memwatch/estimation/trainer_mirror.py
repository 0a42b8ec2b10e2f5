"""The Trainer mirror: what the Trainer and accelerate do around a model's forward, for a fake replay.

The batches ``default_data_collator`` forms (:func:`make_batch`), the ``num_items_in_batch`` rules
(:func:`accepts_loss_kwargs`, :func:`loss_shifts_labels`), accelerate's autocast wrapper with its fp32
output conversion (:func:`wrap_autocast`), activation checkpointing as ``Trainer.train()`` enables it,
the KV cache the Trainer turns off, ``compute_loss`` (:func:`forward_loss`) and transformers' mask code
led down the path it takes on a real batch (:func:`real_batch_masks`). Each change has its undo: the
same fake model is replayed again (the depth extrapolation, a plan's candidates).
"""

from __future__ import annotations

import contextlib
import inspect
from types import MethodType
from typing import Any

import torch

from ..compat.torch_internals import is_fake
from ..compat.trainer import MASK_HELPERS, masks_patchable

MIXED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
    from ..core.run_config import checkpointing_requested, model_is_checkpointing
    from ..engines.engine import own_checkpointing

    if model_is_checkpointing(model):
        return False
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None)
                  or getattr(args, "gradient_checkpointing_kwargs", None) or {})
    if args is not None and own_checkpointing(args) and not checkpointing_requested(args):
        # FSDP's own switch: accelerate's fsdp2_apply_ac wraps each unit (the decoder layers) in
        # checkpoint_wrapper(layer, preserve_rng_state=False), non-reentrant: no RNG state saved a call
        kwargs = {"use_reentrant": False, "preserve_rng_state": False}
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
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - older transformers
        yield
        return
    if not masks_patchable():  # another transformers (4.x): warned once, in meta.degraded
        yield
        return
    originals = {name: getattr(masking_utils, name) for name in MASK_HELPERS}

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


_NO_CONFIG = object()


def disable_kv_cache(model: torch.nn.Module) -> Any:
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


def restore_kv_cache(model: torch.nn.Module, previous: Any) -> None:
    """Undo :func:`disable_kv_cache`."""
    if previous is not _NO_CONFIG:
        model.config.use_cache = previous


def restore_forward(model: torch.nn.Module, saved_forward: Any) -> None:
    """Undo :func:`wrap_autocast` (the fake model may be simulated again)."""
    if saved_forward is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = saved_forward


def forward_loss(model: torch.nn.Module, inputs: dict[str, torch.Tensor], num_items: Any) -> torch.Tensor:
    """``Trainer.compute_loss``: outputs are dropped on return, only the loss survives."""
    kwargs = dict(inputs)
    if num_items is not None:
        kwargs["num_items_in_batch"] = num_items
    outputs = model(**kwargs)
    return outputs["loss"] if isinstance(outputs, dict) else outputs[0]
