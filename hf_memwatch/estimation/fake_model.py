"""The fake model builder, one for the training step and the evaluation loop.

A config, a model directory / ``config.json`` path or a built module becomes a model whose every
parameter and buffer is a fake tensor (``FakeTensorMode``: real shape, dtype and device, no memory):
:func:`fake_model` builds it, PEFT adapters (a :class:`~hf_memwatch.estimation.peft.LoraSpec` or a saved
adapter folder) and bitsandbytes quantization (a :class:`~hf_memwatch.estimation.quantized.QuantSpec`)
applied on a meta-device base first. A built module is never copied: :func:`fake_copy` makes a fake twin
(tied and frozen parameters respected).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import types
from collections import Counter, OrderedDict
from typing import Any

import torch

from ..compat.torch_internals import tensor_storage_key
from ..compat.trainer import no_init_weights
from ..core.errors import MemWatchConfigError
from ..measure.attribution import is_quantized_param
from .peft import LoraSpec, apply_peft, is_adapter_dir, load_adapter, meta_copy
from .quantized import QuantSpec, fake_quantized_param, quantize_meta
from .rebind import rebind_patched_forwards
from .request import TASKS, check_choice


# -- inputs ----------------------------------------------------------------------------------
def load_config(model_or_config: Any) -> Any:
    """A ``PretrainedConfig`` from a config, a model directory or a ``config.json`` path.

    Raises :class:`MemWatchConfigError` with one clear line when the path is missing or invalid.
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_or_config, PretrainedConfig):
        return model_or_config
    if isinstance(model_or_config, os.PathLike):
        model_or_config = os.fspath(model_or_config)
    if not isinstance(model_or_config, str):
        raise MemWatchConfigError(
            f"model_or_config must be a PretrainedConfig, an nn.Module or a path; got {type(model_or_config).__name__}"
        )
    path = model_or_config
    try:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
            if not isinstance(data, dict) or "model_type" not in data:
                raise MemWatchConfigError(f"{path}: not a Transformers config (no 'model_type')")
            check_model_type(data["model_type"], path)
            config_cls = AutoConfig.for_model(data["model_type"]).__class__
            return config_cls.from_dict(data)
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise MemWatchConfigError(f"{path}: no config.json in this directory")
            with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
                check_model_type((json.load(handle) or {}).get("model_type"), path)
            return AutoConfig.from_pretrained(path)
        if os.path.sep in path or path.endswith(".json"):
            raise MemWatchConfigError(f"{path}: no such file or directory")
        return AutoConfig.from_pretrained(path)  # a hub id, where the network allows
    except MemWatchConfigError:
        raise
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MemWatchConfigError(f"cannot load a config from {path!r}: {first}") from None


def check_model_type(model_type: Any, path: str) -> None:
    """One actionable line when ``model_type`` is not one this transformers knows: the closest names,
    how to list them all, and the way for a custom architecture (a built model, in Python)."""
    import difflib

    import transformers
    from transformers import CONFIG_MAPPING

    if model_type is None or model_type in CONFIG_MAPPING:
        return
    known = sorted(CONFIG_MAPPING.keys())
    close = difflib.get_close_matches(str(model_type), known, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise MemWatchConfigError(
        f"{path}: model_type {model_type!r} is not one of the {len(known)} model types transformers "
        f"{transformers.__version__} knows; {hint}list them with python -c \"import transformers; "
        "print(sorted(transformers.CONFIG_MAPPING))\"; a custom architecture: build the model and call "
        "hf_memwatch.estimate(model, ...) in Python")


def infer_task(config: Any) -> str:
    """The task from the config's ``architectures`` (``causal-lm`` when it says nothing)."""
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    for arch in getattr(config, "architectures", None) or []:
        if arch.endswith("ForSequenceClassification"):
            return "seq-cls"
        if arch.endswith("ForMaskedLM"):
            return "masked-lm"
        if arch.endswith("ForConditionalGeneration") or arch.endswith("ForSeq2SeqLM"):
            return "seq2seq"
        if arch.endswith("ForCausalLM") or arch.endswith("LMHeadModel"):
            return "causal-lm"
    return "causal-lm"


def auto_class(task: str) -> Any:
    """The ``AutoModelFor...`` class of ``task``."""
    import transformers

    return {
        "causal-lm": transformers.AutoModelForCausalLM,
        "seq-cls": transformers.AutoModelForSequenceClassification,
        "masked-lm": transformers.AutoModelForMaskedLM,
        "seq2seq": transformers.AutoModelForSeq2SeqLM,
    }[task]


def task_of_module(model: torch.nn.Module) -> str:
    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        return "seq-cls"
    if name.endswith("ForMaskedLM"):
        return "masked-lm"
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return "seq2seq"
    return "causal-lm"



# -- the fake model --------------------------------------------------------------------------
def fake_copy(model: torch.nn.Module, fake_mode: Any, device: str) -> torch.nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are fake tensors on ``device``.

    No weight is copied: each parameter/buffer is replaced (through ``deepcopy``'s memo) by a fake
    tensor of the same shape, dtype and ``requires_grad``; tied weights stay tied because the memo
    maps one object to one fake.
    """
    memo = _fake_twins(model, fake_mode, device)
    _drop_foreign_hooks(model, memo)
    copied = copy.deepcopy(model, memo)
    rebind_patched_forwards(copied, memo)  # TRL's fused-LM-head forward: the copy's modules, not the live ones
    return copied


def fake_in_place(model: torch.nn.Module, fake_mode: Any, device: str) -> torch.nn.Module:
    """``model`` itself, each parameter and buffer swapped for its fake twin (as :func:`fake_copy` makes them).

    Only for a module built here and held by nobody else (the meta-device base PEFT was applied to):
    nothing is copied, so no module object is duplicated — measured on the Llama-3.1-70B-shaped LoRA of
    ``benchmarks/planning_cost.py`` (560 adapted layers), the ``deepcopy`` alone was about 1 s of CPU.
    A quantized base keeps :func:`fake_copy` (its layers hold references the copy must follow).
    """
    memo = _fake_twins(model, fake_mode, device)
    for module in model.modules():
        named = [*module.named_parameters(recurse=False, remove_duplicate=False),
                 *module.named_buffers(recurse=False, remove_duplicate=False)]
        for name, tensor in named:  # Module.__setattr__: a parameter re-registered, a buffer keeps its persistence
            setattr(module, name, memo[id(tensor)])
    return model


def _fake_twins(model: torch.nn.Module, fake_mode: Any, device: str) -> dict[int, Any]:
    """``id`` of each parameter and buffer of ``model`` -> its fake twin on ``device`` (tied ones: one twin)."""
    memo: dict[int, Any] = {}
    target = torch.device(device)
    tensors = list(model.parameters()) + list(model.buffers())
    holders = Counter(tensor_storage_key(t) for t in {id(t): t for t in tensors}.values()
                      if not is_quantized_param(t))
    for tensor in tensors:
        if id(tensor) in memo:
            continue
        if is_quantized_param(tensor):  # bitsandbytes: its quantization state must come along
            memo[id(tensor)] = fake_quantized_param(tensor, fake_mode, memo)
            continue
        with torch.no_grad():
            fake = _zero3_partitioned(tensor, fake_mode, target)
            if fake is None and _alone_on_meta(tensor, holders):
                with fake_mode:  # what from_tensor + to(target) gives, a quarter of the cost (measured)
                    fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=target)
            fake = fake_mode.from_tensor(tensor.detach()) if fake is None else fake
            if fake.device != target:
                with fake_mode:
                    fake = fake.to(target)
        if isinstance(tensor, torch.nn.Parameter):
            fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = fake
    return memo


def _alone_on_meta(tensor: torch.Tensor, holders: Counter) -> bool:
    """A meta tensor that is all of a storage no other parameter or buffer shares: a fresh fake of its
    shape and strides is its exact twin (a view into more storage, an expanded tensor or a shared storage
    goes through ``from_tensor``)."""
    if tensor.device.type != "meta" or tensor.storage_offset() != 0:
        return False
    return (holders[tensor_storage_key(tensor)] == 1
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


def _zero3_partitioned(tensor: torch.Tensor, fake_mode: Any, target: torch.device) -> torch.Tensor | None:
    """A fake of the whole parameter where DeepSpeed's ``zero.Init`` left only this rank's partition.

    A model built after ``TrainingArguments(deepspeed=<ZeRO-3>)`` (``from_config``/``from_pretrained``
    run under ``deepspeed.zero.Init``) holds parameters of shape ``[0]``; DeepSpeed keeps the whole
    shape in ``ds_shape`` (``deepspeed/runtime/zero/partition_parameters.py``, ``_convert_to_deepspeed_param``).
    The step replays the whole model, as the engine gathers it (measured: the sweep's ZeRO-3 draws were
    refused with "no trainable parameter" before)."""
    shape = getattr(tensor, "ds_shape", None)
    if shape is None or tensor.numel() != 0:
        return None
    with fake_mode:
        return torch.empty(tuple(shape), dtype=tensor.dtype, device=target)


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _drop_foreign_hooks(model: torch.nn.Module, memo: dict[int, Any]) -> None:
    """Keep plain-function hooks in the copy; drop bound methods (a callback's, a monitor's).

    A bound method's ``deepcopy`` copies its object — for a training callback that is the whole
    Trainer, optimizer state included — and running it on the fake copy would feed the live
    monitor fake events.
    """
    for module in model.modules():
        for attr in _HOOK_DICTS:
            hooks = getattr(module, attr, None)
            if hooks:
                memo[id(hooks)] = OrderedDict(
                    (key, hook) for key, hook in hooks.items() if isinstance(hook, types.FunctionType)
                )


def build_fake_model(config: Any, task: str, fake_mode: Any, device: str) -> torch.nn.Module:
    """Instantiate the task's model class from ``config`` under ``fake_mode`` (nothing allocated).

    ``device="meta"`` with a null context for ``fake_mode`` gives a meta-device model (for PEFT).
    """
    auto = auto_class(task)
    try:
        with fake_mode, torch.device(device):
            with no_init_weights():  # values are irrelevant, and initialising costs seconds
                model = auto.from_config(copy.deepcopy(config))
            model.tie_weights()  # skipped with the initialisation
    except ValueError as exc:
        raise MemWatchConfigError(f"task {task!r} is not available for {type(config).__name__}: {exc}") from None
    return model


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(all, trainable) parameter counts, tied weights once."""
    seen: set[int] = set()
    total = trainable = 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()
        if param.requires_grad:
            trainable += param.numel()
    return total, trainable


def resolve_adapter(model_or_config: Any, lora: LoraSpec | None,
                     adapter: str | os.PathLike | None) -> tuple[Any, Any]:
    """(the base model or config, the saved adapter's ``PeftConfig`` or None)."""
    if adapter is None and is_adapter_dir(model_or_config):
        adapter, model_or_config = model_or_config, None
    peft_config = None
    if adapter is not None:
        if lora is not None:
            raise MemWatchConfigError("give either a LoRA spec or an adapter folder, not both")
        peft_config, base = load_adapter(adapter)
        if model_or_config is None:
            if base is None:
                raise MemWatchConfigError(f"{os.fspath(adapter)}: the adapter names no base model; give MODEL")
            model_or_config = base
    if lora is not None and not isinstance(lora, LoraSpec):
        raise MemWatchConfigError(f"lora must be a LoraSpec; got {type(lora).__name__}")
    if model_or_config is None:
        raise MemWatchConfigError("no model: give a model, a config or an adapter folder")
    return model_or_config, peft_config


def fake_model(model_or_config: Any, task: str | None, fake_mode: Any, lora: LoraSpec | None = None,
               peft_config: Any = None, quantization: QuantSpec | None = None) -> tuple[torch.nn.Module, Any, str]:
    """(fake model, its config, task) from a config, a path or a built module (never copied).

    ``lora``/``peft_config``: PEFT applied to a meta-device base (frozen base, trainable adapters);
    ``quantization``: the base loaded as ``BitsAndBytesConfig`` would (a config or path only). Every
    target device is simulated on fake CPU tensors.
    """
    wants_peft = peft_config is not None or lora is not None
    if isinstance(model_or_config, torch.nn.Module):
        task = task or task_of_module(model_or_config)
        if wants_peft:
            model_or_config = apply_peft(meta_copy(model_or_config), peft_config or lora.peft_config(task))
        model = fake_copy(model_or_config, fake_mode, "cpu")
        return model, getattr(model, "config", None), task
    config, task = config_and_task(model_or_config, task)
    if wants_peft or quantization is not None:
        meta = build_fake_model(config, task, contextlib.nullcontext(), "meta")
        adapted = adapted_meta(meta, peft_config or (lora and lora.peft_config(task)), quantization)
        model = fake_built(adapted, quantization, fake_mode)
    else:
        model = build_fake_model(config, task, fake_mode, "cpu")
    return model, model.config, task


def config_and_task(model_or_config: Any, task: str | None) -> tuple[Any, str]:
    """The ``PretrainedConfig`` of a config or path, and the task (``task``, else inferred from it)."""
    config = load_config(model_or_config)
    task = task or infer_task(config)
    check_choice("task", task, TASKS)
    return config, task


def adapted_meta(meta: torch.nn.Module, peft_config: Any, quantization: QuantSpec | None) -> torch.nn.Module:
    """A meta-device base quantized (``quantization``) and adapted (``peft_config``), where given."""
    if quantization is not None:
        meta = quantize_meta(meta, quantization)
    return meta if peft_config is None else apply_peft(meta, peft_config)


def fake_built(meta: torch.nn.Module, quantization: QuantSpec | None, fake_mode: Any) -> torch.nn.Module:
    """The fake model of a meta-device model built here (:func:`adapted_meta`'s): ours alone, made fake in
    place, unless quantized (its layers hold references the copy must follow: :func:`fake_copy`)."""
    return fake_copy(meta, fake_mode, "cpu") if quantization is not None else fake_in_place(meta, fake_mode, "cpu")
