"""What an estimate is asked: one frozen :class:`EstimateRequest`: a :class:`RunConfig`, the estimate's own settings, the card.

:func:`hf_memwatch.estimate`'s keywords are the request's fields (the old ``batch_size``, ``accum``,
``checkpointing`` accepted for one release with a warning: :mod:`~hf_memwatch.core.renamed`); the request travels
whole — resolved against a Trainer's own configuration (:meth:`EstimateRequest.resolved`), validated
(:meth:`EstimateRequest.validate`), then read by the step and eval replays. A setting left ``None`` is
the Trainer's own, else :class:`RunConfig`'s default (``optim`` for a CUDA target: the Trainer's
default, ``adamw_torch_fused``: :mod:`~hf_memwatch.estimation.cuda_optim`).

Example:
    >>> request = EstimateRequest(micro_batch_size=8, seq_len=128).resolved(None)
    >>> request.gradient_accumulation_steps, request.optim, request.target_len
    (1, 'adamw_torch', 128)
    >>> request.validate()
    >>> request.run.effective_batch, request.replace(micro_batch_size=4).run.micro_batch_size
    (8, 4)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ..core.categories import ESTIMATE_CLASSES
from ..core.choices import DEVICES, PRECISIONS, SHARDS, TASKS  # noqa: F401 - estimation's names for them
from ..core.errors import MemWatchConfigError
from ..core.renamed import accepts_renamed, renamed_keywords
from ..core.run_config import RunConfig
from ..core.units import parse_bytes
from .generation import GenerationSettings

CLASS_NAMES = ESTIMATE_CLASSES  # core's one list, under the name estimation's API has exported

# The keywords that go to the request's RunConfig (RunConfig's own names; estimate()'s keywords of those names)
RUN_SETTINGS = ("micro_batch_size", "gradient_accumulation_steps", "activation_checkpointing", "optim", "precision",
                "device", "world_size", "shard", "max_grad_norm", "seq_len", "task", "seq2seq_target_len",
                "eval_batch_size", "eval_accumulation_steps", "prediction_loss_only", "predict_with_generate",
                "generation_max_length", "generation_num_beams", "engine")
# the run settings resolution fills when not given (the Trainer's own, else RunConfig's default)
_RESOLVED = ("micro_batch_size", "gradient_accumulation_steps", "activation_checkpointing", "optim", "precision",
             "device", "world_size", "shard", "max_grad_norm")
_GIVEN_DEFAULTS = {"prediction_loss_only": False}  # a run setting not given reads None, these read their default
# the old keywords of the run's fields (accepted for one release, warned: core/renamed.py)
_OLD_FIELDS = {"checkpointing": "activation_checkpointing"}


@dataclass(frozen=True)
class EstimateSettings:
    """The estimate's own settings (not the run's): budget, depth extrapolation, the sample, adapters,
    quantization, the eval loop's length, what is replayed and reported."""

    budget: int | str | None = None
    extrapolate_layers: bool | None = None
    sample_index: int | None = None
    lora: Any = None  # a LoraSpec
    adapter: str | os.PathLike | None = None
    quantization: Any = None  # a QuantSpec
    eval_samples: int | None = None
    eval_seq_len: int | None = None
    eval_in_training: bool = True
    optimizer_step: bool = True
    top_tensors: int = 0


_SETTINGS = tuple(f.name for f in dataclasses.fields(EstimateSettings))
_PARTS = ("settings", "run", "given", "gpu")


@accepts_renamed(_OLD_FIELDS)
@dataclass(frozen=True, init=False)
class EstimateRequest:
    """One estimate: the run (a :class:`RunConfig`, ``run``), the estimate's own ``settings`` and the CUDA card.

    Built from :func:`hf_memwatch.estimate`'s keywords: those of :data:`RUN_SETTINGS` go to the run, the
    others to :class:`EstimateSettings`, ``gpu`` (a name of ``core.gpus.GPUS`` or a ``GpuSpec``; None: the
    local card, else assumed) stays beside them. Before :meth:`resolved` the run settings are only the
    ones ``given`` (None: the Trainer's own, else RunConfig's default) and ``run`` is None; after it,
    ``run`` is the whole :class:`RunConfig` (its counts checked as RunConfig checks them) — unless no
    micro-batch is known (an eval loop's request, :meth:`EvalRequest.estimate_request`): then the
    resolved settings stay ``given`` and ``run`` None (:meth:`validate` names the missing micro-batch). Each keyword reads back as an attribute of its name
    (``request.precision``: the run's, ``request.budget``: the settings').
    """

    settings: EstimateSettings
    run: RunConfig | None  # None until resolved
    given: tuple[tuple[str, Any], ...]  # the run settings given before resolution (name, value)
    gpu: Any

    def __init__(self, *, settings: EstimateSettings | None = None, run: RunConfig | None = None,
                 gpu: Any = None, **keywords: Any) -> None:
        unknown = set(keywords) - set(RUN_SETTINGS) - set(_SETTINGS)
        if unknown:
            raise TypeError(f"EstimateRequest() got unexpected keyword arguments: {', '.join(sorted(unknown))}")
        own = {name: value for name, value in keywords.items() if name in _SETTINGS}
        settings = dataclasses.replace(settings or EstimateSettings(), **own)
        given = {name: value for name, value in keywords.items() if name in RUN_SETTINGS}
        if run is not None and given:
            run, given = run.replace(**given), {}
        object.__setattr__(self, "settings", settings)
        object.__setattr__(self, "run", run)
        object.__setattr__(self, "given", tuple((name, given[name]) for name in RUN_SETTINGS if name in given))
        object.__setattr__(self, "gpu", gpu)

    def __getattr__(self, name: str) -> Any:
        """A keyword's value: the run's (given, before resolution) or the settings'."""
        if name in RUN_SETTINGS:
            if self.run is not None:
                return getattr(self.run, name)
            return dict(self.given).get(name, _GIVEN_DEFAULTS.get(name))
        if name in _SETTINGS:
            return getattr(self.settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def replace(self, **changes: Any) -> EstimateRequest:
        """A copy with ``changes`` applied, each keyword routed to its part (the run, the settings, ``gpu``)."""
        changes = renamed_keywords("EstimateRequest.replace", changes, _OLD_FIELDS)
        gpu = changes.pop("gpu", self.gpu)
        if self.run is None:
            return EstimateRequest(settings=self.settings, gpu=gpu, **{**dict(self.given), **changes})
        return EstimateRequest(settings=self.settings, run=self.run, gpu=gpu, **changes)

    def resolved(self, trainer: Any) -> EstimateRequest:
        """The request with its :class:`RunConfig`: every run setting not given filled from ``trainer``'s
        (its ``seq_len`` stays the request's: the Trainer's comes from its dataset), else RunConfig's defaults."""
        if self.run is not None:
            return self
        given = dict(self.given)
        if trainer is not None:
            own = RunConfig.from_trainer(trainer)
            defaults = {name: getattr(own, name) for name in _RESOLVED}
            defaults["device"] = "cuda" if own.device == "cuda" else "cpu"
            defaults["predict_with_generate"] = own.predict_with_generate
        else:
            defaults = {f.name: f.default for f in dataclasses.fields(RunConfig) if f.name in _RESOLVED}
            defaults["micro_batch_size"] = None
            defaults["predict_with_generate"] = False
        values = {name: given.get(name, _GIVEN_DEFAULTS.get(name)) for name in RUN_SETTINGS}
        values.update({name: default for name, default in defaults.items() if values[name] is None})
        if trainer is None and given.get("optim") is None:  # a CUDA target: the Trainer's own default (cuda_optim)
            from .cuda_optim import default_optim

            values["optim"] = default_optim(values["device"])
        if trainer is not None and values["predict_with_generate"]:
            for name in ("generation_max_length", "generation_num_beams"):
                if values[name] is None:
                    values[name] = getattr(own, name)
        if values["micro_batch_size"] is None:  # no training step to configure (an eval loop's request): no run
            return EstimateRequest(settings=self.settings, gpu=self.gpu, **values)
        return EstimateRequest(settings=self.settings, run=RunConfig(**values), gpu=self.gpu)

    # -- derived values --------------------------------------------------------------------
    @property
    def target_len(self) -> int | None:
        """The seq2seq labels' length (default: ``seq_len``)."""
        return self.seq2seq_target_len or self.seq_len

    @property
    def eval_len(self) -> int | None:
        """The eval batches' length (default: ``seq_len``)."""
        return self.eval_seq_len or self.seq_len

    @property
    def eval_target_len(self) -> int | None:
        """The eval batches' seq2seq labels' length."""
        return self.seq2seq_target_len or self.eval_seq_len or self.seq_len

    @property
    def budget_bytes(self) -> int | None:
        """``budget`` in bytes (None: no budget)."""
        return None if self.budget is None else parse_bytes(self.budget)

    @property
    def generation(self) -> GenerationSettings | None:
        """The generation the eval loop runs (None: no ``predict_with_generate``)."""
        return generation_settings(bool(self.predict_with_generate), self.generation_max_length,
                                   self.generation_num_beams)

    # -- validation ------------------------------------------------------------------------
    def validate(self) -> None:
        """Fail fast, with one line naming the public keyword, on settings that cannot work."""
        for name in ("micro_batch_size", "seq_len", "gradient_accumulation_steps", "world_size"):
            check_positive(name, getattr(self, name))
        if self.seq2seq_target_len is not None:
            check_positive("seq2seq_target_len", self.seq2seq_target_len)
        if self.task is not None:
            check_choice("task", self.task, TASKS)
        check_choice("precision", self.precision, PRECISIONS)
        from .optim import SUPPORTED_OPTIMS

        if self.optim not in SUPPORTED_OPTIMS:
            raise MemWatchConfigError(f"unsupported optim {self.optim!r}; choose one of {', '.join(SUPPORTED_OPTIMS)}")
        check_choice("device", self.device, DEVICES)
        if self.gpu is not None:
            from ..core.gpus import GpuSpec, gpu_spec

            if self.device != "cuda":
                raise MemWatchConfigError(f"gpu={self.gpu!r} is for a CUDA target: pass device='cuda'")
            if not isinstance(self.gpu, GpuSpec):
                gpu_spec(self.gpu)
        check_choice("shard", self.shard, SHARDS)
        if self.shard != "none" and self.world_size < 2:
            raise MemWatchConfigError(f"shard={self.shard!r} needs world_size >= 2; got {self.world_size}")
        self.validate_eval()

    def validate_eval(self) -> None:
        """Fail fast on evaluation settings: batch size and samples come together."""
        if (self.eval_batch_size is None) != (self.eval_samples is None):
            raise MemWatchConfigError(
                "eval_batch_size and eval_samples go together (the loop's batches and its length)")
        if self.eval_batch_size is None:
            if self.eval_accumulation_steps is not None or self.eval_seq_len is not None:
                raise MemWatchConfigError(
                    "eval_accumulation_steps / eval_seq_len need eval_batch_size and eval_samples")
            return
        check_positive("eval_batch_size", self.eval_batch_size)
        check_positive("eval_samples", self.eval_samples)
        if self.eval_accumulation_steps is not None:
            check_positive("eval_accumulation_steps", self.eval_accumulation_steps)
        if self.eval_seq_len is not None:
            check_positive("eval_seq_len", self.eval_seq_len)


@dataclass(frozen=True, kw_only=True)
class EvalRequest:
    """One evaluation loop's estimate (:func:`hf_memwatch.estimation.estimate.estimate_eval`), named as
    :class:`RunConfig` and :class:`EstimateRequest` name things: no training step is replayed.

    ``optimizer_state_bytes``: optimizer state live beside the loop (an eval inside ``train()``);
    ``preprocess_argmax``: the loop keeps ``logits.argmax(-1)`` (``preprocess_logits_for_metrics``)
    instead of the logits; ``predict_with_generate``, ``generation_max_length``,
    ``generation_num_beams``: as the ``Seq2SeqTrainingArguments`` of those names.

    Example:
        >>> EvalRequest(eval_batch_size=8, eval_samples=64, seq_len=32).estimate_request().precision
        'fp32'
    """

    eval_batch_size: int
    eval_samples: int
    seq_len: int
    task: str | None = None
    precision: str = "fp32"
    device: str = "cpu"
    eval_accumulation_steps: int | None = None
    prediction_loss_only: bool = False
    seq2seq_target_len: int | None = None
    predict_with_generate: bool = False
    generation_max_length: int | None = None
    generation_num_beams: int | None = None
    optimizer_state_bytes: int = 0
    preprocess_argmax: bool = False

    @classmethod
    def of(cls, run: RunConfig, *, eval_samples: int, **loop: Any) -> EvalRequest:
        """The loop ``run`` configures (its eval batch, accumulation, precision, generation); ``loop``:
        this request's fields that differ (the eval batch planned, the states beside the loop, ...)."""
        fields = dict(eval_batch_size=int(run.eval_batch_size or 8), seq_len=run.seq_len, precision=run.precision,
                      device="cuda" if run.device == "cuda" else "cpu",
                      eval_accumulation_steps=run.eval_accumulation_steps,
                      prediction_loss_only=bool(run.prediction_loss_only))
        if run.predict_with_generate:
            fields.update(predict_with_generate=True, generation_max_length=run.generation_max_length,
                          generation_num_beams=run.generation_num_beams)
        return cls(**{**fields, **loop}, eval_samples=eval_samples)

    def replace(self, **changes: Any) -> EvalRequest:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def estimate_request(self) -> EstimateRequest:
        """The :class:`EstimateRequest` the eval replay reads."""
        return EstimateRequest(
            task=self.task, precision=self.precision, device=self.device, seq_len=self.seq_len,
            eval_batch_size=self.eval_batch_size, eval_samples=self.eval_samples,
            eval_accumulation_steps=self.eval_accumulation_steps, prediction_loss_only=self.prediction_loss_only,
            seq2seq_target_len=self.seq2seq_target_len, predict_with_generate=self.predict_with_generate,
            generation_max_length=self.generation_max_length, generation_num_beams=self.generation_num_beams)


def check_positive(name: str, value: Any) -> None:
    """Raise :class:`MemWatchConfigError` unless ``value`` is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MemWatchConfigError(f"{name} must be a positive integer; got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise :class:`MemWatchConfigError` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise MemWatchConfigError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")


def generation_settings(predict_with_generate: bool, max_length: int | None,
                        num_beams: int | None) -> GenerationSettings | None:
    """The generation the eval loop runs (None: no ``predict_with_generate``)."""
    if not predict_with_generate:
        if max_length is not None or num_beams is not None:
            raise MemWatchConfigError("generation_max_length / generation_num_beams need predict_with_generate")
        return None
    return GenerationSettings(max_length=max_length, num_beams=num_beams)
