"""Pre-flight prediction of a Trainer optimizer step's peak memory, without allocating the model.

:func:`estimate` builds the model (or a fake copy of the one given) under ``FakeTensorMode``, so
every tensor has its real shape, dtype and device but no memory, and runs the step the Trainer
really runs — the same loss path (``num_items_in_batch``, accelerate's autocast wrapper and its
fp32 output conversion), ``loss.backward()``, ``clip_grad_norm_``, the optimizer class and kwargs
``Trainer.get_optimizer_cls_and_kwargs`` picks, ``zero_grad(set_to_none=True)`` — twice, so the
lazily created optimizer state coexists with the second step's activations. A
:class:`~hf_memwatch.measure.tracker.StorageTracker` counts live storages as the allocator would and
records the class split at the peak.

Usage:
    >>> from transformers import GPT2Config                                  # doctest: +SKIP
    >>> est = estimate(GPT2Config(n_layer=2), batch_size=8, seq_len=256)    # doctest: +SKIP
    >>> est.peak_bytes, est.peak_phase, est.classes["activations"]           # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import types
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..core.errors import MemWatchConfigError, unknown_keywords
from ..core.run_config import RunConfig
from ..core.units import format_bytes, parse_bytes
from ..measure.attribution import is_quantized_param, weight_storages
from ..measure.peak_tensors import PeakTensors
from ..measure.tracker import recording_allocations
from .cuda_device import cuda_step_reserve
from .generation import GenerationSettings
from .layers import AUTO_MIN_LAYERS, SHORT_DEPTHS, extrapolate, homogeneous_layers, truncated
from .peft import LoraSpec, apply_peft, is_adapter_dir, load_adapter, meta_copy
from .quantized import QuantSpec, fake_quantized_param, quantize_meta
from .rebind import rebind_patched_forwards
from .shard import engine_classes, shard_classes
from .step import CUDA_BLOCK, LOGITS, LOGITS_FP32, simulate_step
from .trainer_replay import (
    TrainerStateGuard,
    held_models,
    is_trainer,
    longest_allowed_length,
    worst_case_batch,
)
from .trl_replay import TrainerReplay, dataloader_batch_size

TASKS = ("causal-lm", "seq-cls", "masked-lm", "seq2seq")
PRECISIONS = ("fp32", "bf16", "fp16")
SHARDS = ("none", "zero1", "zero2", "zero3", "fsdp")
DEVICES = ("cpu", "cuda")
CLASS_NAMES = ("weights", "gradients", "optimizer_states", "activations", "temporaries", "other")


@dataclass
class MemoryEstimate:
    """Predicted peak of one Trainer optimizer step (per rank), with its split by class.

    ``classes`` is the split *at the moment of the peak* and sums to ``peak_bytes``.
    ``phase_peaks`` gives the highest live bytes inside each phase of the step. ``details``
    names the biggest single tensors of a language-model step inside the class that holds them at
    the peak: ``logits`` (every storage shaped tokens x vocabulary: the LM head's output, the
    loss's log-softmax, their gradients) and ``logits_fp32_upcast`` (the fp32 ones under mixed
    precision). A breakdown, not an addition: they are already in ``classes``.
    """

    peak_bytes: int
    peak_phase: str
    classes: dict[str, int]
    params: int
    trainable_params: int
    fits: bool | None
    budget: int | None = None
    phase_peaks: dict[str, int] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    frozen_models: dict[str, int] = field(default_factory=dict)
    # inside a class at the peak, the bytes of named tensors: {"activations": {"logits": ...}, ...}
    details: dict[str, dict[str, int]] = field(default_factory=dict)
    # The evaluation loop (with ``eval_batch_size``/``eval_samples``; None when not asked):
    # its peak, the phase holding it (eval_forward | eval_accumulate | eval_gather) and its split.
    eval_peak_bytes: int | None = None
    eval_peak_phase: str | None = None
    eval_classes: dict[str, int] | None = None
    # CUDA only (device="cuda"; see estimation/cuda_device.py): the caching allocator's peak reserved
    # bytes (its rules replayed over the step's allocations), what the process holds on the card at
    # that moment (reserved + the CUDA context measured on this machine's device + NCCL buffers; None
    # where no CUDA device is at hand) and those parts.
    reserved_bytes: int | None = None
    device_bytes: int | None = None
    device_overheads: dict[str, int | None] = field(default_factory=dict)
    # The tensors alive at the predicted peak (``top_tensors`` > 0): the largest, by module and operator.
    peak_tensors: PeakTensors | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (the CLI's ``--json`` object)."""
        return asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        """One JSON object: ``peak_bytes``, ``peak_phase``, ``classes``, ``params``, ... ."""
        return json.dumps(self.to_dict(), **kwargs)


def logits_bytes(estimate: MemoryEstimate) -> int:
    """Bytes of logits (and their fp32 upcast) live at the estimate's peak, whichever class holds them."""
    return sum(nbytes for named in estimate.details.values() for name, nbytes in named.items()
               if name in (LOGITS, LOGITS_FP32))


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
            config_cls = AutoConfig.for_model(data["model_type"]).__class__
            return config_cls.from_dict(data)
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise MemWatchConfigError(f"{path}: no config.json in this directory")
            return AutoConfig.from_pretrained(path)
        if os.path.sep in path or path.endswith(".json"):
            raise MemWatchConfigError(f"{path}: no such file or directory")
        return AutoConfig.from_pretrained(path)  # a hub id, where the network allows
    except MemWatchConfigError:
        raise
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MemWatchConfigError(f"cannot load a config from {path!r}: {first}") from None


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


def _task_of_module(model: torch.nn.Module) -> str:
    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        return "seq-cls"
    if name.endswith("ForMaskedLM"):
        return "masked-lm"
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return "seq2seq"
    return "causal-lm"


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MemWatchConfigError(f"{name} must be a positive integer; got {value!r}")


def validate(
    *, batch_size: Any, seq_len: Any, task: str | None, precision: str, optim: str, accum: Any,
    device: str, world_size: Any, shard: str, seq2seq_target_len: Any,
) -> None:
    """Fail fast, with one line, on arguments that cannot work."""
    from .optim import SUPPORTED_OPTIMS

    _check_positive("batch_size", batch_size)
    _check_positive("seq_len", seq_len)
    _check_positive("accum", accum)
    _check_positive("world_size", world_size)
    if seq2seq_target_len is not None:
        _check_positive("seq2seq_target_len", seq2seq_target_len)
    if task is not None and task not in TASKS:
        raise MemWatchConfigError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if precision not in PRECISIONS:
        raise MemWatchConfigError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if optim not in SUPPORTED_OPTIMS:
        raise MemWatchConfigError(f"unsupported optim {optim!r}; choose one of {', '.join(SUPPORTED_OPTIMS)}")
    if device not in DEVICES:
        raise MemWatchConfigError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if shard not in SHARDS:
        raise MemWatchConfigError(f"unknown shard {shard!r}; choose one of {', '.join(SHARDS)}")
    if shard != "none" and world_size < 2:
        raise MemWatchConfigError(f"shard={shard!r} needs world_size >= 2; got {world_size}")


# -- the fake model --------------------------------------------------------------------------
def fake_copy(model: torch.nn.Module, fake_mode: Any, device: str) -> torch.nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are fake tensors on ``device``.

    No weight is copied: each parameter/buffer is replaced (through ``deepcopy``'s memo) by a fake
    tensor of the same shape, dtype and ``requires_grad``; tied weights stay tied because the memo
    maps one object to one fake.
    """
    memo: dict[int, Any] = {}
    target = torch.device(device)
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in memo:
            continue
        if is_quantized_param(tensor):  # bitsandbytes: its quantization state must come along
            memo[id(tensor)] = fake_quantized_param(tensor, fake_mode, memo)
            continue
        with torch.no_grad():
            fake = fake_mode.from_tensor(tensor.detach())
            if fake.device != target:
                with fake_mode:
                    fake = fake.to(target)
        if isinstance(tensor, torch.nn.Parameter):
            fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = fake
    _drop_foreign_hooks(model, memo)
    copied = copy.deepcopy(model, memo)
    rebind_patched_forwards(copied, memo)  # TRL's fused-LM-head forward: the copy's modules, not the live ones
    return copied


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
    from transformers.initialization import no_init_weights

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


def _resolve_adapter(model_or_config: Any, lora: LoraSpec | None,
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


# -- the estimate ----------------------------------------------------------------------------
def estimate(
    model_or_config: Any,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    task: str | None = None,
    precision: str | None = None,
    optim: str | None = None,
    checkpointing: bool | None = None,
    accum: int | None = None,
    device: str | None = None,
    budget: int | str | None = None,
    max_grad_norm: float | None = None,
    world_size: int | None = None,
    shard: str | None = None,
    seq2seq_target_len: int | None = None,
    extrapolate_layers: bool | None = None,
    sample_index: int | None = None,
    lora: LoraSpec | None = None,
    adapter: str | os.PathLike | None = None,
    quantization: QuantSpec | None = None,
    eval_batch_size: int | None = None,
    eval_samples: int | None = None,
    eval_accumulation_steps: int | None = None,
    eval_seq_len: int | None = None,
    prediction_loss_only: bool = False,
    eval_in_training: bool = True,
    predict_with_generate: bool | None = None,
    generation_max_length: int | None = None,
    generation_num_beams: int | None = None,
    optimizer_step: bool = True,
    engine: Any = None,
    top_tensors: int = 0,
    **unknown: Any,
) -> MemoryEstimate:
    """Predict the peak memory of one Trainer optimizer step (per device), split by class.

    ``model_or_config``: a ``PretrainedConfig``, a model directory / ``config.json`` path, a built
    ``nn.Module`` (never copied: a fake twin is made, frozen and tied parameters respected), or a
    built ``Trainer``. Given a Trainer, its own ``training_step`` is replayed (``compute_loss`` with
    subclass overrides: TRL's trainers), on batches its collator forms from the longest sample of
    its dataset (or ``sample_index``); every setting left ``None`` is the Trainer's own
    (:class:`~hf_memwatch.core.run_config.RunConfig`), and the Trainer is left as it was.
    ``batch_size`` is the per-device micro-batch, ``accum`` the gradient accumulation steps,
    ``precision`` ``fp32``/``bf16``/``fp16`` (mixed precision as the Trainer runs it: fp32
    weights, autocast), ``optim`` a ``TrainingArguments.optim`` name, ``device`` the target
    (``cpu`` or ``cuda``), ``budget`` bytes or a size such as ``"24GiB"``. ``world_size`` and
    ``shard`` (``zero1``/``zero2``/``zero3``/``fsdp``) divide the model states per rank.
    ``extrapolate_layers``: simulate 2 and 3 layers of a homogeneous stack and extend the line
    (exact, see :mod:`hf_memwatch.estimation.layers`); ``None`` = when the model has 6+ layers.
    ``lora`` (a :class:`~hf_memwatch.estimation.peft.LoraSpec`) or ``adapter`` (a folder PEFT's
    ``save_pretrained`` wrote; ``model_or_config`` None = its ``base_model_name_or_path``) applies
    PEFT's ``get_peft_model`` to the fake base: frozen base, trainable adapters. A model path that
    is itself an adapter folder is taken as ``adapter``. ``quantization`` (a
    :class:`~hf_memwatch.estimation.quantized.QuantSpec`: 4-bit nf4/fp4 with or without double
    quantization, or 8-bit) loads the base from a config or path as ``BitsAndBytesConfig`` does,
    prepared by PEFT's ``prepare_model_for_kbit_training`` (QLoRA with ``lora``/``adapter``); a
    built model or Trainer is estimated as it is loaded, its bitsandbytes layers as they are.

    ``top_tensors`` = N > 0: ``peak_tensors`` lists the N largest tensors alive at the predicted peak
    (shape, dtype, class, operator, module) and every tensor then grouped by module and operator
    (:mod:`hf_memwatch.estimation.peak`); 0 (default) keeps no census, as planning does.

    With ``eval_batch_size`` and ``eval_samples`` the evaluation loop is predicted too
    (``eval_peak_bytes``, ``eval_peak_phase``, ``eval_classes``; :mod:`hf_memwatch.estimation.eval_loop`):
    ``eval_accumulation_steps``, ``eval_seq_len`` (default ``seq_len``), ``prediction_loss_only``
    as the ``TrainingArguments`` of those names; ``eval_in_training``: the loop runs inside
    ``train()``, the optimizer state live (False: a standalone ``evaluate()``).
    ``predict_with_generate``, ``generation_max_length``, ``generation_num_beams``: ``Seq2SeqTrainer``'s
    generation-based prediction (:mod:`hf_memwatch.estimation.generation`; given a Trainer, None
    = its ``Seq2SeqTrainingArguments``'): the generated tokens, the KV cache of max length x beams.

    ``engine`` (a :class:`~hf_memwatch.core.engine.Engine`; given a Trainer, None = the one its
    accelerator will build) adds what DeepSpeed holds beyond the ZeRO split (fp32 master partition,
    buckets, ZeRO-3 prefetch, offload: :func:`~hf_memwatch.estimation.shard.engine_classes`); it
    applies when its shard and world size are the estimate's.

    ``optimizer_step=False`` replays the forward and backward alone, without optimizer state:
    about a third faster, and a floor under the step's peak (lower by at least the optimizer
    states) — what a planner needs to rule a configuration out (a ``notes`` entry says so).

    Example:
        >>> from transformers import GPT2Config                                   # doctest: +SKIP
        >>> cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000)    # doctest: +SKIP
        >>> estimate(cfg, batch_size=8, seq_len=256, budget="1GiB").fits         # doctest: +SKIP
        True
    """
    if unknown:
        raise MemWatchConfigError(unknown_keywords("estimate", unknown, estimate))
    trainer = model_or_config if is_trainer(model_or_config) else None
    generation = _generation_of(trainer, predict_with_generate, generation_max_length, generation_num_beams)
    run = _settings(trainer, dict(
        batch_size=batch_size, seq_len=seq_len, precision=precision, optim=optim, checkpointing=checkpointing,
        accum=accum, device=device, max_grad_norm=max_grad_norm, world_size=world_size, shard=shard,
    ))
    batch_size, seq_len, precision, optim = run["batch_size"], run["seq_len"], run["precision"], run["optim"]
    checkpointing, accum, device = run["checkpointing"], run["accum"], run["device"]
    max_grad_norm, world_size, shard = run["max_grad_norm"], run["world_size"], run["shard"]
    notes: list[str] = []
    sample = None
    if trainer is not None:
        _check_positive("batch_size", batch_size)
        sample, sample_len, note = worst_case_batch(trainer, dataloader_batch_size(trainer, batch_size, accum), sample_index)
        if sample is None:
            seq_len = seq_len or longest_allowed_length(trainer)
            if seq_len is None:
                raise MemWatchConfigError(f"{note}, and the run sets no max_length: pass seq_len")
            notes.append(f"{note} ({seq_len} tokens)")
        else:
            seq_len = sample_len or seq_len or 1
            notes.append(f"{note} ({seq_len} tokens)")
        model_or_config = trainer.model
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    validate(
        batch_size=batch_size, seq_len=seq_len, task=task, precision=precision, optim=optim, accum=accum,
        device=device, world_size=world_size, shard=shard, seq2seq_target_len=seq2seq_target_len,
    )
    _validate_eval(eval_batch_size, eval_samples, eval_accumulation_steps, eval_seq_len)
    budget_bytes = None if budget is None else parse_bytes(budget)
    model_or_config, peft_config = _resolve_adapter(model_or_config, lora, adapter)
    if quantization is not None and not isinstance(quantization, QuantSpec):
        raise MemWatchConfigError(f"quantization must be a QuantSpec; got {type(quantization).__name__}")
    if quantization is not None and isinstance(model_or_config, torch.nn.Module):
        raise MemWatchConfigError("quantization is for a config or a path: a built model is estimated as it "
                                  "was loaded (its bitsandbytes layers are read)")
    # Outer dispatch modes (a live MemWatch tracker, a profiler's) must not see the fake step.
    with _disable_current_modes():
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        wants_peft = peft_config is not None or lora is not None
        if isinstance(model_or_config, torch.nn.Module):
            task = task or _task_of_module(model_or_config)
            if wants_peft:
                model_or_config = apply_peft(meta_copy(model_or_config), peft_config or lora.peft_config(task))
            model = fake_copy(model_or_config, fake_mode, "cpu")  # every target is simulated on CPU
            config = getattr(model, "config", None)
        else:
            config = load_config(model_or_config)
            task = task or infer_task(config)
            if wants_peft or quantization is not None:
                meta = build_fake_model(config, task, contextlib.nullcontext(), "meta")
                if quantization is not None:
                    meta = quantize_meta(meta, quantization)
                if wants_peft:
                    meta = apply_peft(meta, peft_config or lora.peft_config(task))
                model = fake_copy(meta, fake_mode, "cpu")
            else:
                model = build_fake_model(config, task, fake_mode, "cpu")
            config = model.config
        params, trainable = count_params(model)
        if trainable == 0:
            raise MemWatchConfigError("the model has no trainable parameter")

        run = dict(
            config=config, task=task, batch_size=batch_size, seq_len=seq_len,
            target_len=seq2seq_target_len or seq_len, precision=precision, optim=optim,
            checkpointing=checkpointing, accum=accum, device=device, max_grad_norm=max_grad_norm,
            trainer=trainer, sample=sample, optimizer_step=optimizer_step, top=top_tensors,
            replay=None if trainer is None else TrainerReplay(
                trainer, lambda module: fake_copy(module, fake_mode, "cpu"), batch_size, accum),
        )
        if run["replay"] is not None:
            notes.extend(run["replay"].notes)
        guard = TrainerStateGuard(trainer, accum) if trainer is not None else contextlib.nullcontext()
        recording = recording_allocations() if device == "cuda" else contextlib.nullcontext([])
        try:
            with guard, recording as traces:
                phase_classes, phase_details, phase_tensors = _simulate(
                    model, fake_mode, config, extrapolate_layers, notes, run)
        except (MemWatchConfigError, KeyboardInterrupt):
            raise
        except Exception as exc:  # the model cannot run this configuration: say so in one line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise MemWatchConfigError(
                f"{type(model).__name__} cannot run a {task} training step with these settings: "
                f"{type(exc).__name__}: {first}"
            ) from exc
    frozen_models: dict[str, int] = {}
    if trainer is not None:
        # Frozen models the Trainer holds (TRL's reference model, a teacher) are resident weights.
        trained = set(weight_storages(trainer.model, None))
        for name, module in held_models(trainer).items():
            held = {k: v for k, v in weight_storages(module, None).items() if k not in trained}
            frozen_models[name] = sum(_on_target(nbytes, device) for nbytes in held.values())
        if run["replay"] is None or not run["replay"].held_weights:  # else: in the replay's live set
            for classes in phase_classes.values():
                classes["weights"] += sum(frozen_models.values())
        if frozen_models:
            notes.append("weights include models the Trainer holds: " + ", ".join(
                f"{name} ({format_bytes(nbytes)})" for name, nbytes in frozen_models.items()))
    if not optimizer_step:
        notes.append("forward and backward only (optimizer_step=False): no optimizer state or step, "
                     "a floor under the step's peak")
    if engine is None and trainer is not None:
        engine = RunConfig.from_trainer(trainer).engine
    if engine is not None and (engine.shard != shard or engine.world_size != world_size):
        engine = None  # asked for another layout than the run's engine: the ZeRO split alone
    per_phase = {phase: engine_classes(shard_classes(classes, model, world_size, shard, notes, precision), model,
                                       engine, notes, precision, device)[0]
                 for phase, classes in phase_classes.items()}
    phase_peaks = {phase: sum(classes.values()) for phase, classes in per_phase.items()}
    peak_phase = max(phase_peaks, key=lambda p: phase_peaks[p])
    peak = phase_peaks[peak_phase]
    reserved_bytes = device_bytes = None
    device_overheads: dict[str, int | None] = {}
    if device == "cuda":
        reserved_bytes, device_bytes, device_overheads = cuda_step_reserve(
            traces, peak=peak, extrapolated=any(note.startswith("depth extrapolated") for note in notes),
            world_size=world_size, shard=shard, held_bytes=sum(frozen_models.values()), notes=notes)
    evaluation = None
    if eval_batch_size is not None:
        states = per_phase.get("step_end", {}).get("optimizer_states", 0) if eval_in_training else 0
        evaluation = _estimate_eval_loop(
            model, fake_mode, config=config, task=task, batch_size=eval_batch_size, samples=eval_samples,
            seq_len=eval_seq_len or seq_len, target_len=seq2seq_target_len or eval_seq_len or seq_len,
            accumulation_steps=eval_accumulation_steps, prediction_loss_only=prediction_loss_only,
            precision=precision, device=device, optimizer_state_bytes=states, generation=generation)
        notes.extend(evaluation.notes)
        if shard != "none":
            notes.append("eval: the weights are counted whole (sharded evaluation is not modelled)")
    return MemoryEstimate(
        peak_bytes=peak,
        peak_phase=peak_phase,
        classes=dict(per_phase[peak_phase]),
        params=params,
        trainable_params=trainable,
        fits=None if budget_bytes is None else peak <= budget_bytes,
        budget=budget_bytes,
        phase_peaks=phase_peaks,
        config={
            "model": type(model).__name__, "task": task, "batch_size": batch_size, "seq_len": seq_len,
            "precision": precision, "optim": optim, "checkpointing": checkpointing, "accum": accum,
            "device": device, "world_size": world_size, "shard": shard,
            "seq2seq_target_len": seq2seq_target_len,
            "lora": None if lora is None else asdict(lora),
            "adapter": None if adapter is None else os.fspath(adapter),
            "generation": None if generation is None else asdict(generation),
            "quantization": None if quantization is None else asdict(quantization),
        },
        notes=notes,
        frozen_models=frozen_models,
        details=phase_details.get(peak_phase, {}),
        eval_peak_bytes=None if evaluation is None else evaluation.peak_bytes,
        eval_peak_phase=None if evaluation is None else evaluation.peak_phase,
        eval_classes=None if evaluation is None else evaluation.classes,
        reserved_bytes=reserved_bytes,
        device_bytes=device_bytes,
        device_overheads=device_overheads,
        peak_tensors=phase_tensors.get(peak_phase),
    )


def generation_settings(predict_with_generate: bool, max_length: int | None,
                        num_beams: int | None) -> GenerationSettings | None:
    """The generation the eval loop runs (None: no ``predict_with_generate``)."""
    if not predict_with_generate:
        if max_length is not None or num_beams is not None:
            raise MemWatchConfigError("generation_max_length / generation_num_beams need predict_with_generate")
        return None
    return GenerationSettings(max_length=max_length, num_beams=num_beams)


def _generation_of(trainer: Any, predict_with_generate: bool | None, max_length: int | None,
                   num_beams: int | None) -> GenerationSettings | None:
    """The generation settings given, else (with a Trainer) its arguments' (:class:`RunConfig`)."""
    if trainer is not None:
        own = RunConfig.from_trainer(trainer)
        predict_with_generate = own.predict_with_generate if predict_with_generate is None else predict_with_generate
        if predict_with_generate:
            max_length = own.generation_max_length if max_length is None else max_length
            num_beams = own.generation_num_beams if num_beams is None else num_beams
    return generation_settings(bool(predict_with_generate), max_length, num_beams)


def _validate_eval(batch_size: Any, samples: Any, accumulation_steps: Any, seq_len: Any) -> None:
    """Fail fast on evaluation arguments: batch size and samples come together."""
    if (batch_size is None) != (samples is None):
        raise MemWatchConfigError("eval_batch_size and eval_samples go together (the loop's batches and its length)")
    if batch_size is None:
        if accumulation_steps is not None or seq_len is not None:
            raise MemWatchConfigError("eval_accumulation_steps / eval_seq_len need eval_batch_size and eval_samples")
        return
    _check_positive("eval_batch_size", batch_size)
    _check_positive("eval_samples", samples)
    if accumulation_steps is not None:
        _check_positive("eval_accumulation_steps", accumulation_steps)
    if seq_len is not None:
        _check_positive("eval_seq_len", seq_len)


def _estimate_eval_loop(model: torch.nn.Module, fake_mode: Any, **run: Any) -> Any:
    """:func:`~hf_memwatch.estimation.eval_loop.simulate_eval`, outer dispatch modes disabled, one-line errors."""
    from torch.utils._python_dispatch import _disable_current_modes

    from .eval_loop import simulate_eval

    with _disable_current_modes():
        try:
            return simulate_eval(model, fake_mode, **run)
        except (MemWatchConfigError, KeyboardInterrupt):
            raise
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise MemWatchConfigError(
                f"{type(model).__name__} cannot run a {run.get('task')} evaluation loop with these settings: "
                f"{type(exc).__name__}: {first}"
            ) from exc


def estimate_eval(
    model_or_config: Any,
    *,
    eval_batch_size: int,
    eval_samples: int,
    seq_len: int,
    task: str | None = None,
    precision: str = "fp32",
    device: str = "cpu",
    eval_accumulation_steps: int | None = None,
    prediction_loss_only: bool = False,
    seq2seq_target_len: int | None = None,
    optimizer_state_bytes: int = 0,
    preprocess_argmax: bool = False,
    predict_with_generate: bool = False,
    generation_max_length: int | None = None,
    generation_num_beams: int | None = None,
) -> Any:
    """Predict one evaluation loop's peak (no training step simulated): for planners and remedies.

    Returns an :class:`~hf_memwatch.estimation.eval_loop.EvalSimulation` (``peak_bytes``,
    ``peak_phase``, ``classes`` summing to the peak, ``host_bytes``, ``notes``).
    ``optimizer_state_bytes``: optimizer state live beside the loop (an eval inside ``train()``;
    e.g. ``estimate(...).classes["optimizer_states"]``). ``preprocess_argmax``: the loop keeps
    ``logits.argmax(-1)`` (``preprocess_logits_for_metrics``) instead of the logits.
    ``predict_with_generate``, ``generation_max_length``, ``generation_num_beams``: as the
    ``Seq2SeqTrainingArguments`` of those names (:mod:`hf_memwatch.estimation.generation`: every
    sequence generated to ``generation_max_length``, the worst case).

    Example:
        >>> estimate_eval(cfg, eval_batch_size=64, eval_samples=512, seq_len=32).peak_bytes   # doctest: +SKIP
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    _check_positive("seq_len", seq_len)
    _validate_eval(eval_batch_size, eval_samples, eval_accumulation_steps, None)
    if precision not in PRECISIONS:
        raise MemWatchConfigError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if device not in DEVICES:
        raise MemWatchConfigError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    with _disable_current_modes():
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        model, config, task = _fake_model(model_or_config, task, fake_mode)
    return _estimate_eval_loop(
        model, fake_mode, config=config, task=task, batch_size=eval_batch_size, samples=eval_samples,
        seq_len=seq_len, target_len=seq2seq_target_len or seq_len, accumulation_steps=eval_accumulation_steps,
        prediction_loss_only=prediction_loss_only, precision=precision, device=device,
        optimizer_state_bytes=optimizer_state_bytes, preprocess_argmax=preprocess_argmax,
        generation=generation_settings(predict_with_generate, generation_max_length, generation_num_beams))


def _fake_model(model_or_config: Any, task: str | None, fake_mode: Any) -> tuple[torch.nn.Module, Any, str]:
    """(fake model, its config, task) from a config, a path or a built module (never copied)."""
    if isinstance(model_or_config, torch.nn.Module):
        model = fake_copy(model_or_config, fake_mode, "cpu")
        return model, getattr(model, "config", None), task or _task_of_module(model)
    config = load_config(model_or_config)
    task = task or infer_task(config)
    if task not in TASKS:
        raise MemWatchConfigError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    model = build_fake_model(config, task, fake_mode, "cpu")
    return model, model.config, task


_DEFAULTS = dict(precision="fp32", optim="adamw_torch", checkpointing=False, accum=1, device="cpu",
                 max_grad_norm=1.0, world_size=1, shard="none")


def _settings(trainer: Any, given: dict[str, Any]) -> dict[str, Any]:
    """The settings of the estimate: those given, else the Trainer's own, else the defaults."""
    if trainer is not None:
        own = RunConfig.from_trainer(trainer).estimate_kwargs()
        own["seq_len"] = None
    else:
        own = dict(_DEFAULTS, batch_size=None, seq_len=None)
    return {name: (own.get(name) if value is None else value) for name, value in given.items()}


def _on_target(nbytes: int, device: str) -> int:
    """One storage's bytes as ``device``'s allocator holds them (CUDA rounds each block up to 512 B)."""
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK if device == "cuda" else nbytes


def _simulate(model: torch.nn.Module, fake_mode: Any, config: Any, extrapolate_layers: bool | None,
              notes: list[str], run: dict[str, Any]) -> tuple[dict[str, dict[str, int]], dict[str, Any], dict[str, Any]]:
    """Per-phase class splits, details and peak tensors of the step: by depth extrapolation where exact
    and wanted.

    The details (logits) do not depend on depth: the deeper short simulation's are kept; so are its
    peak tensors (a note says so: the layers beyond hold more of the same).
    """
    stack = homogeneous_layers(model, config) if extrapolate_layers is not False else None
    depth = getattr(config, "num_hidden_layers", 0) or 0
    if stack is not None and (extrapolate_layers or depth >= AUTO_MIN_LAYERS):
        short, details, tensors = {}, {}, {}
        for layers in SHORT_DEPTHS:
            with truncated(stack, config, layers):
                simulation = simulate_step(model, fake_mode, **run)
            short[layers], details = simulation.phase_classes, simulation.phase_details
            tensors = simulation.phase_tensors
        extended = extrapolate(short, depth)
        if extended is not None:
            notes.append(f"depth extrapolated from {SHORT_DEPTHS[0]} and {SHORT_DEPTHS[1]} simulated layers")
            if tensors:
                notes.append(f"peak tensors: those of the {SHORT_DEPTHS[1]}-layer simulation")
            return extended, details, tensors
    simulation = simulate_step(model, fake_mode, **run)
    return simulation.phase_classes, simulation.phase_details, simulation.phase_tensors


def largest_fitting_batch(
    model_or_config: Any, *, budget: int | str, seq_len: int, max_batch: int = 4096, **kwargs: Any
) -> int:
    """The largest micro-batch whose predicted peak fits ``budget`` (0 when even 1 does not).

    Activations grow linearly with the batch, so two estimates give a line; the answer is checked
    (and corrected) with one or two more.

    Example:
        >>> largest_fitting_batch(cfg, budget="2GiB", seq_len=512)   # doctest: +SKIP
        23
    """
    budget_bytes = parse_bytes(budget)
    kwargs.pop("batch_size", None)
    kwargs.pop("budget", None)

    def peak(batch: int) -> int:
        return estimate(model_or_config, batch_size=batch, seq_len=seq_len, **kwargs).peak_bytes

    return largest_fitting(peak, budget_bytes, max_batch)


def largest_fitting(peak_of: Any, budget: int, max_batch: int) -> int:
    """Largest ``b`` in [1, max_batch] with ``peak_of(b) <= budget``; 0 when none.

    Extrapolates the line through ``peak_of(1)`` and ``peak_of(2)`` then verifies, falling back to
    bisection over the verified bracket (``peak_of`` is assumed non-decreasing).
    """
    cache: dict[int, int] = {}

    def fits(batch: int) -> bool:
        if batch not in cache:
            cache[batch] = peak_of(batch)
        return cache[batch] <= budget

    if not fits(1):
        return 0
    if max_batch == 1:
        return 1
    slope = max(peak_of_cached(cache, peak_of, 2) - cache[1], 1)
    guess = max(1, min(max_batch, 1 + (budget - cache[1]) // slope))
    low, high = 1, max_batch + 1  # fits(low), not fits(high) (high virtual)
    if fits(guess):
        low = guess
        if guess < max_batch and not fits(guess + 1):
            return guess
    else:
        high = guess
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


def peak_of_cached(cache: dict[int, int], peak_of: Any, batch: int) -> int:
    """``peak_of(batch)`` through ``cache``."""
    if batch not in cache:
        cache[batch] = peak_of(batch)
    return cache[batch]
