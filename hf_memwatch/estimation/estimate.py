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
    >>> est = estimate(GPT2Config(n_layer=2), micro_batch_size=8, seq_len=256)    # doctest: +SKIP
    >>> est.peak_bytes, est.peak_phase, est.classes["activations"]           # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..compat.stack import check_stack
from ..core.categories import STEP_END
from ..core.errors import MemWatchConfigError, unknown_keywords
from ..core.gpus import card_fits, gpu_record, target_gpu
from ..core.renamed import RenamedKeys, renamed_keywords
from ..core.run_config import RunConfig
from ..engines.registry import rules_for
from ..measure.peak_tensors import PeakTensors
from .branches import StepBranches, branch_peaks, highest_rank, races, worst_branch
from .cuda_autocast import policy_notes
from .cuda_device import cuda_step_reserve
from .cuda_paged import recording_cuda_allocations
from .depth import simulate_at_depth
from .expert_loop import expert_loop_notes
from .fake_model import auto_class, count_params, fake_copy, fake_model, load_config, resolve_adapter
from .memo import active, built_model
from .peft import LoraSpec
from .quantized import QuantSpec
from .request import (
    CLASS_NAMES,
    DEVICES,
    PRECISIONS,
    SHARDS,
    TASKS,
    EstimateRequest,
    EvalRequest,
    check_choice,
    check_positive,
)
from .short_model import ShortModel, fake_model_at_depth
from .short_model import usable as short_usable
from .step import LOGITS, LOGITS_FP32, StepInputs, StepSimulation
from .trainer_replay import TrainerStateGuard, frozen_model_bytes, is_trainer
from .trl_replay import TrainerReplay, dataloader_batch_size
from .user_optimizer import with_user_optimizer
from .worst_batch import longest_allowed_length, worst_case_batch

# Names other packages import from here (cli/estimate.py); the model builder, request: fake_model, request.
__all__ = ["CLASS_NAMES", "DEVICES", "PRECISIONS", "SHARDS", "TASKS", "EstimateRequest", "MemoryEstimate",
           "auto_class", "estimate", "estimate_eval", "load_config", "logits_bytes"]


@dataclass
class MemoryEstimate:
    """Predicted peak of one Trainer optimizer step (per rank), with its split by class.

    ``classes`` is the split *at the moment of the peak* and sums to ``peak_bytes``.
    ``phase_peaks`` gives the highest live bytes inside each phase of the step. ``details``
    names the biggest single tensors of a language-model step inside the class that holds them at
    the peak: ``logits`` (every storage shaped tokens x vocabulary: the LM head's output, the
    loss's log-softmax, their gradients) and ``logits_fp32_upcast`` (the fp32 ones under mixed
    precision). A breakdown, not an addition: they are already in ``classes``. ``fits``: the peak
    within ``budget``; without a budget, for a CUDA target, whether the step fits the card
    (``config["gpu"]``: the device total, else the predicted reserve, against its memory:
    :func:`~hf_memwatch.core.gpus.card_fits`); None for a CPU target without a budget.
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
    # A step whose memory takes one of several branches (a random draw's, GKD's lmbda, by name; a race
    # between threads, ZeRO-1/2's reduction copy on gloo's thread: "held" / "freed first";
    # estimation/branches.py): each branch's peak, ``peak_bytes`` the highest. Empty where the step
    # takes none (and a race's inside a plan, which replays the worst alone).
    branches: dict[str, int] = field(default_factory=dict)
    # What this estimate itself cost: wall seconds and this process's CPU seconds (issue 36's budget for
    # the replay; a plan's estimates after its first share the fake model, estimation/memo.py).
    seconds: float = 0.0
    cpu_seconds: float = 0.0

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


# -- the facade ------------------------------------------------------------------------------
def estimate(
    model_or_config: Any, *, micro_batch_size: int | None = None, seq_len: int | None = None,
    task: str | None = None, precision: str | None = None, optim: str | None = None,
    activation_checkpointing: bool | None = None, gradient_accumulation_steps: int | None = None,
    device: str | None = None, budget: int | str | None = None,
    max_grad_norm: float | None = None, world_size: int | None = None, shard: str | None = None,
    seq2seq_target_len: int | None = None, extrapolate_layers: bool | None = None, sample_index: int | None = None,
    lora: LoraSpec | None = None, adapter: str | os.PathLike | None = None, quantization: QuantSpec | None = None,
    eval_batch_size: int | None = None, eval_samples: int | None = None, eval_accumulation_steps: int | None = None,
    eval_seq_len: int | None = None, prediction_loss_only: bool = False, eval_in_training: bool = True,
    predict_with_generate: bool | None = None, generation_max_length: int | None = None,
    generation_num_beams: int | None = None, optimizer_step: bool = True, engine: Any = None,
    top_tensors: int = 0, gpu: Any = None, **unknown: Any,
) -> MemoryEstimate:
    """Predict the peak memory of one Trainer optimizer step (per device), split by class.

    ``model_or_config``: a ``PretrainedConfig``, a model directory / ``config.json`` path, a built
    ``nn.Module`` (never copied: a fake twin is made) or a built ``Trainer`` (its own ``training_step``
    replayed on batches its collator forms from its longest sample, or ``sample_index``; every setting
    left ``None`` is the Trainer's own, and the Trainer is left as it was). Every keyword is the
    :class:`~hf_memwatch.estimation.request.EstimateRequest` field of that name, documented there
    (``micro_batch_size``: the per-device micro-batch); the old ``batch_size``, ``accum`` and
    ``checkpointing`` are accepted for one release with a ``FutureWarning`` (:mod:`~hf_memwatch.core.renamed`).

    Example:
        >>> from transformers import GPT2Config                                   # doctest: +SKIP
        >>> cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000)    # doctest: +SKIP
        >>> estimate(cfg, micro_batch_size=8, seq_len=256, budget="1GiB").fits         # doctest: +SKIP
        True
    """
    if unknown:
        unknown = renamed_keywords("estimate", unknown)  # the old names, warned
        micro_batch_size, gradient_accumulation_steps, activation_checkpointing = (
            _one_of(name, given, unknown) for name, given in (
                ("micro_batch_size", micro_batch_size), ("gradient_accumulation_steps", gradient_accumulation_steps),
                ("activation_checkpointing", activation_checkpointing)))
        if unknown:
            raise MemWatchConfigError(unknown_keywords("estimate", unknown, estimate))
    request = EstimateRequest(
        micro_batch_size=micro_batch_size, gradient_accumulation_steps=gradient_accumulation_steps, seq_len=seq_len,
        task=task, precision=precision, optim=optim, activation_checkpointing=activation_checkpointing,
        device=device, budget=budget,
        max_grad_norm=max_grad_norm, world_size=world_size, shard=shard, seq2seq_target_len=seq2seq_target_len,
        extrapolate_layers=extrapolate_layers, sample_index=sample_index, lora=lora, adapter=adapter,
        quantization=quantization, eval_batch_size=eval_batch_size, eval_samples=eval_samples,
        eval_accumulation_steps=eval_accumulation_steps, eval_seq_len=eval_seq_len,
        prediction_loss_only=prediction_loss_only, eval_in_training=eval_in_training,
        predict_with_generate=predict_with_generate, generation_max_length=generation_max_length,
        generation_num_beams=generation_num_beams, optimizer_step=optimizer_step, engine=engine,
        top_tensors=top_tensors, gpu=gpu)
    return estimate_request(model_or_config, request)


def _one_of(name: str, given: Any, renamed: dict[str, Any]) -> Any:
    """A keyword given under its new name or (popped from ``renamed``) its old one, not both."""
    if name not in renamed:
        return given
    if given is not None:
        raise MemWatchConfigError(f"estimate: pass {name}= only (its deprecated name was given too)")
    return renamed.pop(name)


# -- the engine ------------------------------------------------------------------------------
def estimate_request(model_or_config: Any, request: EstimateRequest) -> MemoryEstimate:
    """:func:`estimate` of one :class:`EstimateRequest` (its run settings None: the Trainer's, the defaults)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = _estimate_request(model_or_config, request)
    result.seconds, result.cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu
    return result


def _estimate_request(model_or_config: Any, request: EstimateRequest) -> MemoryEstimate:
    check_stack()  # an unverified transformers/torch: one line naming the supported range
    trainer = model_or_config if is_trainer(model_or_config) else None
    request = request.resolved(trainer)
    request.generation  # noqa: B018 - fail fast on generation settings that cannot work
    notes: list[str] = []
    sample = None
    if trainer is not None:
        request, sample = _trainer_batch(trainer, request, notes)
        request = with_user_optimizer(trainer, request, notes)  # optimizers=(opt, None): opt replayed
        model_or_config = trainer.model
    request.validate()
    if request.device == "cuda":  # the card every architecture choice of the replay reads
        card, assumed = target_gpu(request.gpu)
        request = request.replace(gpu=card)
        if assumed:
            notes.append(assumed)
        notes.extend(policy_notes(request.precision))  # CUDA autocast's table borrowed from another torch
    subject = model_or_config
    model_or_config, peft_config = resolve_adapter(model_or_config, request.lora, request.adapter)
    _check_quantization(request.quantization, model_or_config)
    from ..compat.torch_internals import FakeTensorMode, disable_current_modes

    # Outer dispatch modes (a live MemWatch tracker, a profiler's) must not see the fake step.
    with disable_current_modes():
        def build() -> tuple:
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            return (fake_mode, *fake_model_at_depth(model_or_config, request.task, fake_mode, request.lora,
                                                    peft_config, request.quantization))

        fake_mode, model, config, task, short = built_model(subject, request, build)  # one per plan (memo.py)
        if short is not None and not short_usable(request, trainer):  # the engines' rules read the whole model
            model, short = short.full(), None
            config = model.config
        request = request.replace(task=task)
        params, trainable = count_params(model) if short is None else short.counts()
        if trainable == 0:
            raise MemWatchConfigError("the model has no trainable parameter")
        replay = None if trainer is None else TrainerReplay(
            trainer, lambda module: fake_copy(module, fake_mode, "cpu"), request.micro_batch_size,
            request.gradient_accumulation_steps)
        if replay is not None:
            notes.extend(replay.notes)
        inputs = StepInputs(config=config, trainer=trainer, sample=sample, replay=replay)
        engine = _engine_of(request, trainer)
        rules = rules_for(request.shard, request.world_size, engine)
        replays = []  # each rank's where the ranks hold different things and are not live (rules.ranks)
        for rank in rules.ranks(model, engine, request):
            rank_notes = list(notes)
            with rules.for_rank(rank):
                replays.append((rank, rank_notes, *_replay_step(model, fake_mode, request, inputs, rank_notes,
                                                                short)))
    results = []
    for rank, rank_notes, simulation, traces, race in replays:
        with rules.for_rank(rank):
            frozen_models = frozen_model_bytes(trainer, replay, request.device, simulation.phase_classes, rank_notes)
            for other in {id(sim): sim for sim in race.simulations() if sim is not simulation}.values():
                frozen_model_bytes(trainer, replay, request.device, other.phase_classes, [])
            results.append((rank, _result(model, fake_mode, request, inputs, simulation, traces,
                                          _Counts(params, trainable, frozen_models), rank_notes, race, short)))
    return highest_rank(results, request.shard)


def _trainer_batch(trainer: Any, request: EstimateRequest, notes: list[str]) -> tuple[EstimateRequest, Any]:
    """The Trainer's worst-case collated batch (None: synthetic batches) and the request at its length."""
    check_positive("micro_batch_size", request.micro_batch_size)
    loaded = dataloader_batch_size(trainer, request.micro_batch_size, request.gradient_accumulation_steps)
    sample, sample_len, note = worst_case_batch(trainer, loaded, request.sample_index)
    if sample is None:
        seq_len = request.seq_len or longest_allowed_length(trainer)
        if seq_len is None:
            raise MemWatchConfigError(f"{note}, and the run sets no max_length: pass seq_len")
    else:
        seq_len = sample_len or request.seq_len or 1
    notes.append(f"{note} ({seq_len} tokens)")
    return request.replace(seq_len=seq_len), sample


def _check_quantization(quantization: Any, model_or_config: Any) -> None:
    if quantization is not None and not isinstance(quantization, QuantSpec):
        raise MemWatchConfigError(f"quantization must be a QuantSpec; got {type(quantization).__name__}")
    if quantization is not None and isinstance(model_or_config, torch.nn.Module):
        raise MemWatchConfigError("quantization is for a config or a path: a built model is estimated as it "
                                  "was loaded (its bitsandbytes layers are read)")


def _replay_step(model: torch.nn.Module, fake_mode: Any, request: EstimateRequest, inputs: StepInputs,
                 notes: list[str], short: ShortModel | None = None) -> tuple[StepSimulation, list, StepBranches]:
    """The step replayed (Trainer state guarded, CUDA allocations recorded), errors in one line; where
    it meets a race, on its worst branch, and outside a plan on the other branch too. ``short``: ``model``
    stands for its full depth (:mod:`.short_model`)."""
    trainer = inputs.trainer
    engine = _engine_of(request, trainer)
    rules = rules_for(request.shard, request.world_size, engine)
    race = StepBranches()

    def replay(held: bool, branch_notes: list[str], recording: Any) -> tuple[StepSimulation, list]:
        guard = TrainerStateGuard(trainer, request.gradient_accumulation_steps) if trainer is not None \
            else contextlib.nullcontext()
        # what the rank holds while the step runs (FSDP2's shards and gathers, ZeRO-1/2's buckets): its engine's
        flow = rules.flow(model, engine, trainer, request)
        replayed = rules.replay_request(request, engine)  # its autocast
        drawn: dict[str, StepSimulation] = {}
        with races(held) as met, guard, recording as traces, flow:
            simulation = worst_branch(lambda gkd_notes: simulate_at_depth(model, fake_mode, replayed, inputs, gkd_notes,
                                                                           short),
                                      inputs.replay, trainer, branch_notes, traces, drawn)  # GKD's lmbda: every branch
        race.met = met
        if held:
            race.drawn = drawn
        return simulation, traces

    try:
        recording = recording_cuda_allocations() if request.device == "cuda" else contextlib.nullcontext([])
        simulation, traces = replay(True, notes, recording)
        if race.met and active() is None:  # a plan needs the worst branch alone (estimation/memo.py)
            race.freed, _ = replay(False, [], contextlib.nullcontext([]))
    except (MemWatchConfigError, KeyboardInterrupt):
        raise
    except Exception as exc:  # the model cannot run this configuration: say so in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise MemWatchConfigError(
            f"{type(model).__name__} cannot run a {request.task} training step with these settings: "
            f"{type(exc).__name__}: {first}"
        ) from exc
    return simulation, traces, race


@dataclass(frozen=True)
class _Counts:
    """The model's parameter counts and the Trainer's held models' bytes."""

    params: int
    trainable: int
    frozen_models: dict[str, int]


def _engine_of(request: EstimateRequest, trainer: Any) -> Any:
    """The request's engine, else the Trainer's; None when it is another layout than the request's."""
    engine = request.engine
    if engine is None and trainer is not None:
        engine = RunConfig.from_trainer(trainer).engine
    if engine is not None and (engine.shard != request.shard or engine.world_size != request.world_size):
        engine = None  # asked for another layout than the run's engine: the ZeRO split alone
    return engine


def _result(model: torch.nn.Module, fake_mode: Any, request: EstimateRequest, inputs: StepInputs,
            simulation: StepSimulation, traces: list, counts: _Counts, notes: list[str],
            race: StepBranches, short: ShortModel | None = None) -> MemoryEstimate:
    """The :class:`MemoryEstimate`: per-rank classes, the peak, CUDA's reserve, the eval loop, a race's branches."""
    if not request.optimizer_step:
        notes.append("forward and backward only (optimizer_step=False): no optimizer state or step, "
                     "a floor under the step's peak")
    notes.extend(expert_loop_notes(model))  # 4.x MoE blocks: data-dependent routing, an upper bound
    engine = _engine_of(request, inputs.trainer)
    shard, world_size, device = request.shard, request.world_size, request.device
    rules = rules_for(shard, world_size, engine)  # the rank's share, what its engine holds beside (engines/registry.py)
    per_phase = rules.rank_classes(simulation.phase_classes, model, engine, request, notes, simulation.phase_windows)
    phase_peaks = {phase: sum(classes.values()) for phase, classes in per_phase.items()}
    peak_phase = max(phase_peaks, key=lambda p: phase_peaks[p])
    peak = phase_peaks[peak_phase]
    branches = branch_peaks(race, peak, lambda phase_classes: rules.rank_classes(
        phase_classes, model, engine, request, []), notes)
    tensors = simulation.phase_tensors.get(peak_phase)
    if tensors is not None and tensors.peak != peak and (shard != "none" or world_size > 1):
        notes.append(f"peak tensors: the replayed step's at its {peak_phase} high ({tensors.peak:,} B), before the "
                     f"engine's rules give the rank's classes ({peak:,} B: what it shards divided, what it holds "
                     f"beside added): a tensor listed whole may be held in part by the rank, and buffers the rules "
                     f"add are not listed")
    reserved_bytes = device_bytes = None
    device_overheads: dict[str, int | None] = {}
    if device == "cuda":
        reserved_bytes, device_bytes, device_overheads = cuda_step_reserve(
            traces, peak=peak, extrapolated=any(note.startswith("depth extrapolated") for note in notes),
            world_size=world_size, shard=shard, held_bytes=sum(counts.frozen_models.values()), notes=notes,
            gpu=request.gpu, per_rank=rules.per_rank(model, engine, request), carried=rules.carried_reserve,
            resident=rules.resident(model, request, inputs.trainer))
    evaluation = None
    if request.eval_batch_size is not None:
        states = per_phase.get(STEP_END, {}).get("optimizer_states", 0) if request.eval_in_training else 0
        whole = model if short is None else short.full()  # the eval loop replays every layer
        evaluation = _estimate_eval_loop(whole, fake_mode, request, whole.config, states)
        notes.extend(evaluation.notes)
        if shard != "none":
            notes.append("eval: the weights are counted whole (sharded evaluation is not modelled)")
    budget_bytes = request.budget_bytes
    fits = None if budget_bytes is None else peak <= budget_bytes
    if fits is None and device == "cuda":  # no budget: the card's memory (gpus.card_fits)
        fits = card_fits(request.gpu, reserved_bytes, device_bytes, notes)
    return MemoryEstimate(
        peak_bytes=peak, peak_phase=peak_phase, classes=dict(per_phase[peak_phase]), params=counts.params,
        trainable_params=counts.trainable, fits=fits,
        budget=budget_bytes, phase_peaks=phase_peaks, config=_config_record(model, request), notes=notes,
        frozen_models=counts.frozen_models, details=simulation.phase_details.get(peak_phase, {}),
        eval_peak_bytes=None if evaluation is None else evaluation.peak_bytes,
        eval_peak_phase=None if evaluation is None else evaluation.peak_phase,
        eval_classes=None if evaluation is None else evaluation.classes,
        reserved_bytes=reserved_bytes, device_bytes=device_bytes, device_overheads=device_overheads,
        peak_tensors=simulation.phase_tensors.get(peak_phase), branches=branches,
    )


def _config_record(model: torch.nn.Module, request: EstimateRequest) -> dict[str, Any]:
    """``MemoryEstimate.config``: what was estimated, under the public keywords' names."""
    generation = request.generation
    card = {"gpu": gpu_record(request.gpu)} if request.device == "cuda" and request.gpu is not None else {}
    return RenamedKeys({  # the old batch_size/accum/checkpointing keys read for one release, warned
        "model": type(model).__name__, "task": request.task, "micro_batch_size": request.micro_batch_size,
        "seq_len": request.seq_len, "precision": request.precision, "optim": request.optim,
        "activation_checkpointing": request.activation_checkpointing,
        "gradient_accumulation_steps": request.gradient_accumulation_steps,
        "device": request.device, "world_size": request.world_size, "shard": request.shard,
        "seq2seq_target_len": request.seq2seq_target_len,
        "lora": None if request.lora is None else asdict(request.lora),
        "adapter": None if request.adapter is None else os.fspath(request.adapter),
        "generation": None if generation is None else asdict(generation),
        "quantization": None if request.quantization is None else asdict(request.quantization),
        **card,
    })


# -- the evaluation loop ---------------------------------------------------------------------
def _estimate_eval_loop(model: torch.nn.Module, fake_mode: Any, request: EstimateRequest, config: Any,
                        optimizer_state_bytes: int, preprocess_argmax: bool = False) -> Any:
    """:func:`~hf_memwatch.estimation.eval_loop.simulate_eval`, outer dispatch modes disabled, one-line errors."""
    from ..compat.torch_internals import disable_current_modes
    from .eval_loop import EvalInputs, simulate_eval

    inputs = EvalInputs(config=config, optimizer_state_bytes=optimizer_state_bytes,
                        preprocess_argmax=preprocess_argmax)
    with disable_current_modes():
        try:
            return simulate_eval(model, fake_mode, request, inputs)
        except (MemWatchConfigError, KeyboardInterrupt):
            raise
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise MemWatchConfigError(
                f"{type(model).__name__} cannot run a {request.task} evaluation loop with these settings: "
                f"{type(exc).__name__}: {first}"
            ) from exc


def estimate_eval(model_or_config: Any, request: EvalRequest | None = None, /, **fields: Any) -> Any:
    """Predict one evaluation loop's peak (no training step simulated): for planners and remedies.

    ``request``: an :class:`~hf_memwatch.estimation.request.EvalRequest`; or its ``fields`` as
    keywords (a thin facade, as :func:`estimate` is over :class:`EstimateRequest`): ``eval_batch_size``,
    ``eval_samples``, ``seq_len``, ``task``, ``precision`` (default ``fp32``), ``device`` (default
    ``cpu``), ``eval_accumulation_steps``, ``prediction_loss_only``, ``seq2seq_target_len``,
    ``predict_with_generate``, ``generation_max_length``, ``generation_num_beams``
    (:mod:`hf_memwatch.estimation.generation`: every sequence generated to ``generation_max_length``,
    the worst case), ``optimizer_state_bytes`` (optimizer state live beside the loop, e.g.
    ``estimate(...).classes["optimizer_states"]``) and ``preprocess_argmax``.

    Returns an :class:`~hf_memwatch.estimation.eval_loop.EvalSimulation` (``peak_bytes``,
    ``peak_phase``, ``classes`` summing to the peak, ``host_bytes``, ``notes``).

    Example:
        >>> estimate_eval(cfg, eval_batch_size=64, eval_samples=512, seq_len=32).peak_bytes   # doctest: +SKIP
    """
    from ..compat.torch_internals import FakeTensorMode, disable_current_modes

    if request is None:
        try:
            request = EvalRequest(**fields)
        except TypeError as exc:
            raise TypeError(f"estimate_eval(): {exc}") from None
    elif fields:
        raise TypeError("estimate_eval() takes an EvalRequest or its fields as keywords, not both")
    run = request.estimate_request()
    check_positive("seq_len", request.seq_len)
    run.validate_eval()
    check_choice("precision", run.precision, PRECISIONS)
    check_choice("device", run.device, DEVICES)
    with disable_current_modes():
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        model, config, task = fake_model(model_or_config, run.task, fake_mode)
    run.generation  # noqa: B018 - fail fast on generation settings that cannot work
    return _estimate_eval_loop(model, fake_mode, run.replace(task=task), config, request.optimizer_state_bytes,
                               request.preprocess_argmax)
