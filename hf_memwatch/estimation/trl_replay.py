"""Replaying steps that are more than a forward and backward: generation inside training, held models.

TRL's online trainers do inside ``training_step`` what no plain step does: GRPO and RLOO generate
``num_generations`` completions of ``max_completion_length`` tokens per prompt (in
``_prepare_inputs``, once per ``steps_per_generation`` micro-steps) and score them with reward
functions — Python callables or sequence-classification models — and a reference model; Online
DPO, Nash-MD and XPO sample completions and score them with a reward or judge model; GKD generates
on-policy with probability ``lmbda`` and runs its teacher's forward. :class:`TrainerReplay` lets the
estimator replay that very code on fake tensors:

* for the replay, the Trainer's ``model`` / ``model_wrapped`` are the fake model and every model it
  holds (:func:`~hf_memwatch.measure.held_models.held_model_slots`: ``ref_model``, ``teacher_model``,
  the entries of ``reward_funcs``) a fake copy — their forwards are counted, and their weights
  (:attr:`TrainerReplay.held_weights`, those not shared with the trained model) are resident
  ``weights`` from the start, as the tracker must know them: a view of a storage it does not know
  (the ``weight.t()`` of every linear layer) would count as a new allocation, live as long as the
  weight;
* each fake model's ``generate`` decodes every token it may (``max_new_tokens``, else up to
  ``max_length``: no completion ends early, the worst case) with its KV cache, and values read back
  answer as a clean batch's (:func:`~hf_memwatch.estimation.generation.generating_to_max_length`):
  completions read back as token lists (``tolist()``) are full-length lists of id 1, so reward
  callables get strings of that many tokens;
* GRPO's and RLOO's dataloader batch is the generation batch (``per_device_train_batch_size`` x
  ``steps_per_generation``, the latter as the configuration derives it for the micro-batch
  estimated: ``generation_batch_size`` kept), and the first two micro-steps are replayed as they run
  — the first generates with no gradient yet, the second reuses the buffered completions with the
  gradients resident;
* GKD's branches (drawn with ``random.random() <= lmbda``) are each replayed, the worst kept
  (:mod:`~hf_memwatch.estimation.branches`, which sets :attr:`TrainerReplay.lmbda`); the draw itself
  is undone with every other RNG (:class:`~hf_memwatch.estimation.trainer_replay.RngStates`).

Everything set here is put back on exit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..compat.torch_internals import tensor_storage_key
from ..compat.trainer import set_cached_train_batch_size
from ..compat.trainer_methods import cached_train_batch_size
from ..measure.attribution import weight_storages, weight_tensors
from ..measure.held_models import held_model_slots
from .generation import generating_to_max_length

# Trainers whose training_step generates (TRL class names; subclasses included).
GENERATING_TRAINERS = frozenset({"GRPOTrainer", "RLOOTrainer", "OnlineDPOTrainer", "NashMDTrainer", "XPOTrainer",
                                 "GKDTrainer", "DistillationTrainer", "SDFTTrainer", "SDPOTrainer"})
# Trainers that generate GRPO's way: a generation batch of ``steps_per_generation`` micro-batches,
# buffered and split (TRL's experimental self-distillation trainers SDFT and SDPO copy GRPO's loop).
GENERATION_BATCH_TRAINERS = frozenset({"GRPOTrainer", "RLOOTrainer", "SDFTTrainer", "SDPOTrainer"})
# Trainers whose dataloader yields the whole accumulation window at once (micro-batch x accumulation
# prompts), generated once and split into the micro-steps: TRL's DistillationTrainer.
WINDOW_BATCHING_TRAINERS = frozenset({"DistillationTrainer"})


def _class_names(trainer: Any) -> set[str]:
    return {cls.__name__ for cls in type(trainer).__mro__}


def generates_in_training(trainer: Any) -> bool:
    """Whether ``trainer``'s step generates (or may: GKD with ``lmbda > 0`` or ``seq_kd``)."""
    names = _class_names(trainer)
    if "GKDTrainer" in names:
        return float(getattr(trainer, "lmbda", 0.0) or 0.0) > 0 or bool(getattr(trainer, "seq_kd", False))
    return bool(names & GENERATING_TRAINERS)


def batches_generation(trainer: Any) -> bool:
    """GRPO, RLOO: the dataloader yields ``steps_per_generation`` micro-batches at once (the generation batch)."""
    args = getattr(trainer, "args", None)
    return bool(_class_names(trainer) & GENERATION_BATCH_TRAINERS) and \
        getattr(args, "steps_per_generation", None) is not None


def steps_per_generation(trainer: Any, batch_size: int) -> int:
    """The ``steps_per_generation`` a configuration with micro-batch ``batch_size`` has: GRPO's and RLOO's
    config derives it from ``generation_batch_size`` (per_device x processes x steps), which is kept.

    Example: ``per_device_train_batch_size=8`` (1 step per generation, 8 completions) planned as
    4 x 2 generates the same 8 completions once every 2 micro-steps.
    """
    args = trainer.args
    world = max(1, int(getattr(args, "world_size", 1) or 1))
    generation_batch = getattr(args, "generation_batch_size", None)
    if isinstance(generation_batch, int) and generation_batch > 0:
        return max(1, generation_batch // (batch_size * world))
    return int(args.steps_per_generation)


def dataloader_batch_size(trainer: Any, batch_size: int, accum: int | None = None) -> int:
    """Samples the training dataloader yields per micro-step for micro-batch ``batch_size`` and
    accumulation ``accum`` (None: the Trainer's).

    Example: DistillationTrainer at 2 x 4 loads 8 prompts, generates their completions in the first
    micro-step and trains on 2 of them in each of the 4.
    """
    if batches_generation(trainer):
        return batch_size * steps_per_generation(trainer, batch_size)
    if _class_names(trainer) & WINDOW_BATCHING_TRAINERS:
        return batch_size * max(1, int(accum or getattr(trainer.args, "gradient_accumulation_steps", 1) or 1))
    return batch_size


def replayed_micro_steps(trainer: Any, accum: int) -> int:
    """Micro-steps replayed as they run (0: the one-micro-step shortcut of a plain step)."""
    return min(accum, 2) if generates_in_training(trainer) and accum > 1 else 0


def new_tokens(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[int, int]:
    """(prompt length, tokens ``generate`` may add) for one call, as its generation config says."""
    inputs = kwargs.get("input_ids", args[0] if args else None)
    prompt = int(inputs.shape[-1]) if isinstance(inputs, torch.Tensor) else 0
    config = kwargs.get("generation_config") or getattr(module, "generation_config", None)
    limit = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if limit is None:
        max_length = kwargs.get("max_length", getattr(config, "max_length", None)) or 20
        limit = max(int(max_length) - prompt, 0)
    return prompt, int(limit)


def _generation_core(module: torch.nn.Module) -> torch.nn.Module:
    """The model whose decoding loop runs (a PEFT model's base)."""
    base = getattr(module, "get_base_model", None)
    return base() if callable(base) else module


@contextlib.contextmanager
def decoding_every_token(module: torch.nn.Module, tracker: Any,
                         on_generating: Callable[[bool], None]) -> Iterator[None]:
    """Within, ``module.generate`` (this instance only) decodes every token it may; ``on_generating``
    is told when each call starts (True) and ends (False)."""
    core = _generation_core(module)

    def generate(*args: Any, **kwargs: Any) -> Any:
        prompt, steps = new_tokens(module, args, kwargs)
        on_generating(True)
        try:
            with generating_to_max_length(core, tracker, steps, prompt + steps):
                return type(module).generate(module, *args, **kwargs)
        finally:
            on_generating(False)

    module.generate = generate  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.generate


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """Within, ``name``'s Python logger says nothing below ERROR (TRL's "all rewards are None" on fake values)."""
    target = logging.getLogger(name)
    level = target.level
    target.setLevel(logging.ERROR)
    try:
        yield
    finally:
        target.setLevel(level)


class TrainerReplay:
    """A built Trainer's models swapped for fake ones (and back) around a replayed step.

    ``copier(module)`` makes a fake copy of a held model (the estimator's ``fake_copy``, under its
    fake mode); ``batch_size`` and ``accum`` are the configuration estimated, written into the
    arguments the step reads for the replay (GRPO reads ``steps_per_generation`` and the micro-batch).
    """

    def __init__(self, trainer: Any, copier: Callable[[torch.nn.Module], torch.nn.Module], batch_size: int,
                 accum: int) -> None:
        self.trainer = trainer
        self.batch_size, self.accum = batch_size, accum
        self.slots = held_model_slots(trainer)
        self.fakes: dict[int, torch.nn.Module] = {}
        self.held_weights: list[torch.Tensor] = []  # the fakes' weights not shared with the trained model
        trained = set(weight_storages(trainer.model, None))
        for attribute, key in self.slots.values():
            value = getattr(trainer, attribute)
            module = value if key is None else value[key]
            if id(module) not in self.fakes:
                fake = self.fakes[id(module)] = copier(module)
                real_tensors, fake_tensors = weight_tensors(module), weight_tensors(fake)
                if len(real_tensors) == len(fake_tensors):
                    self.held_weights.extend(f for r, f in zip(real_tensors, fake_tensors)
                                             if tensor_storage_key(r) not in trained)
                else:  # pragma: no cover - a copy is the same structure
                    self.held_weights.extend(fake_tensors)
        self.generating = False
        self.notes: list[str] = []
        if generates_in_training(trainer):
            self.notes.append("generation inside the step replayed: every completion to its longest "
                              "(max_new_tokens / max_completion_length), no early end")
        # GKD's draw (random.random() <= lmbda) forced for the replay: 1.0 on-policy, -1.0 never; each branch
        # the draw can take is replayed by estimation.branches.worst_branch, which sets it
        self.lmbda: float | None = None

    def micro_steps(self) -> int:
        return replayed_micro_steps(self.trainer, self.accum)

    def _arguments(self) -> dict[str, Any]:
        """The arguments the replay reads, as the configuration estimated sets them."""
        values: dict[str, Any] = {"per_device_train_batch_size": self.batch_size,
                                  "gradient_accumulation_steps": self.accum}
        if batches_generation(self.trainer):
            values["steps_per_generation"] = steps_per_generation(self.trainer, self.batch_size)
        return values

    @contextlib.contextmanager
    def running(self, model: torch.nn.Module, tracker: Any, close_phase: Callable[[str], None]) -> Iterator[None]:
        """Within: the Trainer trains ``model`` (fake), holds fake copies, generates to the end.

        ``close_phase("generation")`` ends each ``generate`` call; :attr:`generating` is True inside one
        (the model's forwards there are decoding steps, not the step's forward).
        """
        trainer, args = self.trainer, self.trainer.args
        saved_models = {name: getattr(trainer, name) for name in ("model", "model_wrapped") if hasattr(trainer, name)}
        # Other attributes that are the trained model itself (SDFT's and SDPO's "live" teacher_model):
        # the teacher forward runs on the fake model too (left real, it was not counted: -3.8%).
        trained_ids = {id(value) for value in saved_models.values()}
        saved_models.update({name: value for name, value in vars(trainer).items()
                             if name not in saved_models and id(value) in trained_ids
                             and isinstance(value, torch.nn.Module)})
        saved_containers = {attribute: getattr(trainer, attribute) for attribute, _ in self.slots.values()}
        saved_args = {name: getattr(args, name) for name in self._arguments() if hasattr(args, name)}
        saved_batch = cached_train_batch_size(trainer)
        fakes = [model, *self.fakes.values()]

        def generating(started: bool) -> None:
            if not started:
                close_phase("generation")  # the decoding loop's high: the KV cache, the sampled tokens
            self.generating = started

        with contextlib.ExitStack() as stack:
            try:
                for name in saved_models:
                    setattr(trainer, name, model)
                for attribute, original in saved_containers.items():
                    setattr(trainer, attribute, self._with_fakes(original))
                for name, value in self._arguments().items():
                    if name in saved_args:
                        setattr(args, name, value)
                if saved_batch is not None:
                    set_cached_train_batch_size(trainer, self.batch_size * max(1, int(getattr(args, "n_gpu", 1) or 1)))
                if self.lmbda is not None:
                    trainer.lmbda = self.lmbda  # a plain attribute: the state guard puts the user's back
                for fake in fakes:
                    if hasattr(fake, "generate"):
                        stack.enter_context(decoding_every_token(fake, tracker, generating))
                stack.enter_context(_quiet_logger("trl"))  # its checks of fake values are not the user's
                yield
            finally:
                stack.close()
                for name, value in saved_models.items():
                    setattr(trainer, name, value)
                for attribute, original in saved_containers.items():
                    setattr(trainer, attribute, original)
                for name, value in saved_args.items():
                    setattr(args, name, value)
                if saved_batch is not None:
                    set_cached_train_batch_size(trainer, saved_batch)

    def _with_fakes(self, value: Any) -> Any:
        """``value`` (a held model or a container of some) with each held model's fake copy in its place."""
        def swap(item: Any) -> Any:
            return self.fakes.get(id(item), item) if isinstance(item, torch.nn.Module) else item

        if isinstance(value, list):
            return [swap(item) for item in value]
        if isinstance(value, tuple):
            return tuple(swap(item) for item in value)
        if isinstance(value, dict):
            return {key: swap(item) for key, item in value.items()}
        return swap(value)


__all__ = ["TrainerReplay", "batches_generation", "dataloader_batch_size", "decoding_every_token",
           "generates_in_training", "new_tokens", "replayed_micro_steps", "steps_per_generation"]
