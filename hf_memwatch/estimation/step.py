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
allocator rounds blocks; the optimizer implementation torch picks for CUDA tensors (``fused`` for
the Trainer's default ``adamw_torch_fused``, ``foreach`` for ``adamw_torch``), Adam's step
counters on the host, fp16's GradScaler (:mod:`.cuda_optim`); the cuBLAS workspaces of the card
and bitsandbytes' CUDA routing of the 4-bit GEMM (:mod:`.cuda_libs`); bitsandbytes' fused CUDA
optimizer kernels (no temporaries) instead of its Python CPU kernels; dropout, SDPA and the kernels'
workspaces as CUDA runs them on the target's card (:mod:`~hf_memwatch.estimation.cuda_kernels`: the
fused dropout's bool mask, the SDPA backend ``sdp_utils`` picks and what it saves). Autocast is CPU
autocast casting as CUDA autocast does (its op lists: :mod:`.cuda_autocast`; softmax, norms, ``pow``,
losses in fp32).

Phase names are those of the timeline snapshot that closes each interval: ``after_forward``
(forward and loss), ``after_backward``, ``after_optimizer`` (clipping and the optimizer step),
``step_end`` (``zero_grad``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..compat.trainer_methods import counts_items_in_batch, num_items_in_batch
from ..core.categories import (
    AFTER_BACKWARD,
    AFTER_FORWARD,
    AFTER_OPTIMIZER,
    FORWARD_BACKWARD_PHASES,
    STEP_END,
)
from ..measure.attribution import weight_tensors
from ..measure.peak_tensors import PeakCensus, PeakTensors
from ..measure.saved_tensors import SavedTensorRegistry
from .branches import earlier_micro_step_replayed, micro_step
from .classify import Phases, forward_windows, refs
from .cuda_libs import cublas_workspaces
from .cuda_optim import step_scaler, steps_on_host
from .fake_dispatch import CUDA_BLOCK, LOGITS, LOGITS_FP32, name_frozen_weights
from .layers import recompute_windows
from .optimizer_swap import OptimizerSwap, SwapMismatch, swap_off
from .peak import PeakCensusWatch
from .replay import REPLAY_DEVICE, TRAINING, model_in_mode, new_tracker, tracked
from .trainer_mirror import (
    MIXED_DTYPES,
    accepts_loss_kwargs,
    disable_checkpointing,
    enable_checkpointing,
    forward_loss,
    loss_shifts_labels,
    make_batch,
    packed_rows,
    padded_rows,
)
from .trainer_replay import batch_tensors, fake_batch
from .user_optimizer import is_bitsandbytes, optimizer_for

__all__ = ["CUDA_BLOCK", "FORWARD_BACKWARD_PHASES", "GENERATION_PHASE", "LOGITS", "LOGITS_FP32", "StepInputs",
           "StepSimulation", "simulate_step"]


@dataclass
class StepSimulation:
    """What one simulated step left: for each phase, the class split at its highest point."""

    phase_classes: dict[str, dict[str, int]]
    notes: list[str] = field(default_factory=list)
    # per phase, inside each class, the bytes of named tensors at that high (see LOGITS)
    phase_details: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    # per phase, the tensors alive at that high (with ``top`` > 0; :mod:`hf_memwatch.estimation.peak`)
    phase_tensors: dict[str, PeakTensors] = field(default_factory=dict)
    # per split phase, each interval's windows in time order: (label, classes) (``simulate_step``'s ``windows``)
    phase_windows: dict[str, list[list[tuple[Any, dict[str, int]]]]] = field(default_factory=dict)

    def replace(self, **changes: Any) -> StepSimulation:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class StepInputs:
    """What a step replay reads beside the request: the model's config and, for a Trainer, its parts.

    ``trainer``: each micro-step is that Trainer's own ``training_step``; ``sample`` (a collated batch
    of real tensors): every micro-batch is a fake copy of it instead of a synthetic batch; ``replay``
    (a :class:`~hf_memwatch.estimation.trl_replay.TrainerReplay`): the Trainer's other models swapped
    for fakes around its micro-steps.
    """

    config: Any
    trainer: Any = None
    sample: Any = None
    replay: Any = None


# -- the step --------------------------------------------------------------------------------
# The phases of a step before its optimizer step (keys of ``StepSimulation.phase_classes``).
GENERATION_PHASE = "generation"  # a step that generates (TRL's online trainers): the decoding loop's high


def simulate_step(model: torch.nn.Module, fake_mode: Any, request: Any, inputs: StepInputs,
                  steps: int = 2, windows: torch.nn.ModuleList | None = None) -> StepSimulation:
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
    (``replay.micro_steps()``). ``windows`` (the checkpointed layer stack): the backward split where each
    layer's recomputation begins, every window's classes kept (``phase_windows``; :mod:`.layers`).
    """
    try:
        return _simulate_step(model, fake_mode, request, inputs, steps, windows)
    except SwapMismatch:  # a reused forward/backward that did not fit: the step replayed in full
        with swap_off():
            return _simulate_step(model, fake_mode, request, inputs, steps, windows)


def _simulate_step(model: torch.nn.Module, fake_mode: Any, request: Any, inputs: StepInputs,
                   steps: int, windows: torch.nn.ModuleList | None) -> StepSimulation:
    sample = inputs.sample
    with model_in_mode(model, request, TRAINING):
        enabled = bool(request.activation_checkpointing) and enable_checkpointing(model, getattr(inputs.trainer, "args", None))
        run = _StepRun(model, request, inputs, optimizer_for(model, request, inputs.trainer))
        try:
            with tracked(fake_mode, run.tracker, packed_rows(sample), padded_rows(sample)), \
                    recompute_windows(windows, run.phases), forward_windows(model, run.phases):
                run.saved.start()
                try:
                    run.replay_step(steps, windows is not None)
                finally:
                    run.saved.stop()
                    if run.phases.census is not None:
                        run.phases.census.close()
        finally:
            if enabled:
                disable_checkpointing(model)
    return run.simulation()


class _StepRun:
    """One replayed step's state: the tracker and the phases it closes, the optimizer, the batches' refs."""

    def __init__(self, model: torch.nn.Module, request: Any, inputs: StepInputs, optimizer: Any) -> None:
        self.model, self.request, self.inputs, self.optimizer = model, request, inputs, optimizer
        self.device = REPLAY_DEVICE  # every target simulated on fake CPU tensors
        self.saved = saved = SavedTensorRegistry()
        self.tracker = tracker = new_tracker(
            request, saved, bnb_cpu_kernels=(request.device == "cpu" and is_bitsandbytes(optimizer)))
        weights_of_model = weight_tensors(model)  # quantization state included
        top = request.top_tensors
        if top > 0:
            tracker.census = PeakCensus()  # before the weights: it knows every storage the tracker does
        tracker.register(weights_of_model)
        replay = inputs.replay
        held_weights = list(replay.held_weights) if replay is not None else []  # a Trainer's other models
        tracker.register(held_weights)
        name_frozen_weights(tracker, model)
        vocab = getattr(inputs.config, "vocab_size", None)
        if request.task != "seq-cls" and isinstance(vocab, int) and vocab > 1:  # after the weights: never named
            tracker.name_logits(vocab, request.micro_batch_size, request.precision in MIXED_DTYPES)
        weights = refs(tracker, weights_of_model + held_weights)
        self.other: dict[int, Any] = {}
        self.phases = phases = Phases(tracker, model, optimizer, weights, self.other)
        if top > 0:
            phases.census = PeakCensusWatch(tracker, saved, model, optimizer, weights, self.other, top)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if request.device == "cuda":
            steps_on_host(optimizer, tracker)
        self.scaler = step_scaler(request, tracker)  # fp16 on CUDA: accelerate's GradScaler

    def new_batch(self) -> dict[str, Any]:
        """A copy of the Trainer's sample, else a synthetic batch."""
        request, sample = self.request, self.inputs.sample
        if sample is not None:
            return fake_batch(sample)
        return make_batch(self.inputs.config, request.task, request.micro_batch_size, request.seq_len,
                          request.target_len, self.device)

    def keep(self, tensors: Any) -> None:
        """Count ``tensors`` as ``other`` (inputs, the loss accumulator, the item count)."""
        self.other.update(refs(self.tracker, tensors))

    def replay_step(self, steps: int, split: bool = False) -> None:
        """The earlier steps' optimizer state, the micro-steps, then clipping, the step and ``zero_grad``.

        Inside a plan the micro-steps of a candidate that differs only in the optimizer from one replayed
        before are that one's (:mod:`.optimizer_swap`; ``split``: the backward split into windows)."""
        model, optimizer, phases, request = self.model, self.optimizer, self.phases, self.request
        # held from the first step on: the cuBLAS workspaces (CUDA), the GradScaler's scale (fp16 on CUDA)
        self.held = cublas_workspaces(self.tracker) + (self.scaler.start(self.device) if self.scaler else [])
        self.keep(self.held)
        tr_loss = torch.tensor(0.0, device=self.device)
        self.keep([tr_loss])
        lookahead = self.new_batch()
        for _ in range(steps - 1 if request.optimizer_step else 0):
            _prime_optimizer(optimizer, self.params)
        # A step begins with no gradient: the Trainer zeroes them (set to None) after every optimizer
        # step, as priming does; the model handed in may hold some.
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        phases.close(AFTER_OPTIMIZER)
        batches = [lookahead] + [self.new_batch() for _ in range(request.gradient_accumulation_steps - 1)]
        lookahead = self.new_batch()
        for b in batches + [lookahead]:
            self.keep(batch_tensors(b))
        num_items = self.num_items(batches)
        replayed = self.replayed(batches)
        self.tracker.reset_peak()
        swap = OptimizerSwap.of(self, steps, split)
        skipped = swap is not None and swap.begin({
            "batch": batches + [lookahead], "labels": getattr(self, "label_views", []),
            "num_items": [num_items], "tr_loss": [tr_loss], "held": self.held})
        if not skipped:
            for index, inputs in enumerate(replayed):
                with micro_step(last=index == len(replayed) - 1):
                    loss = self.micro_step(inputs, num_items)
                del inputs
                tr_loss += loss
                del loss
        del batches, replayed
        if swap is not None:
            swap.end()
        if not request.optimizer_step:
            return
        scaler = self.scaler
        if request.max_grad_norm and request.max_grad_norm > 0:
            if scaler is not None:
                scaler.unscale_(optimizer)  # accelerate's clip_grad_norm_
            torch.nn.utils.clip_grad_norm_(self.params, request.max_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
        phases.close(AFTER_OPTIMIZER)
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        phases.close(STEP_END)

    def num_items(self, batches: list[dict[str, Any]]) -> Any:
        """``num_items_in_batch``: the Trainer's own count, else the tokens its loss counts (None: not taken)."""
        trainer, device = self.inputs.trainer, self.device
        num_items = None
        if trainer is not None and counts_items_in_batch():
            num_items = num_items_in_batch(trainer, batches, torch.device(device))
            if isinstance(num_items, torch.Tensor):
                self.keep([num_items])
        elif accepts_loss_kwargs(self.model):
            shifts = loss_shifts_labels(self.model)
            labels = [b["labels"][..., 1:] if shifts else b["labels"] for b in batches]
            num_items = sum(lab.ne(-100).sum() for lab in labels).to(device)
            # Views of the labels, held to the step's end as the replay always has (a modelling quirk to
            # review on its own: it keeps the batches' label storages through the optimizer step).
            self.label_views = labels
            self.keep([num_items])
        return num_items

    def replayed(self, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The micro-batches worth replaying (all stay prefetched)."""
        replay = self.inputs.replay
        natural = replay.micro_steps() if replay is not None else 0
        if natural:
            # A step that generates: its first micro-step (no gradient yet) and the next (gradients
            # resident, the buffered completions) differ; both replayed as they run.
            return batches[:natural]
        if len(batches) > 1 and earlier_micro_step_replayed():
            # An engine's race needs the earlier micro-step's backward (estimation/branches.py): the first
            # replayed as it runs (no gradient yet), then the next on what it left.
            return batches[:2]
        if len(batches) > 1:
            # Every micro-step after the first runs with the gradients resident and adds into them:
            # the same live set as the first plus the gradients, so its peak is the step's (the
            # first one's cannot be higher). It alone is replayed, the gradients made resident as
            # the first micro-step leaves them.
            for param in self.params:
                param.grad = torch.zeros_like(param)
            return batches[1:2]
        return batches[:1]

    def micro_step(self, inputs: dict[str, Any], num_items: Any) -> torch.Tensor:
        """One micro-step's forward, loss and backward; the detached loss."""
        model, phases, trainer, replay = self.model, self.phases, self.inputs.trainer, self.inputs.replay
        if trainer is not None:
            # The Trainer's own micro-step: forward and loss (subclass overrides included), its
            # scaling, backward. "after_forward" closes when the model's forward returns.
            hook = model.register_forward_hook(_close_after_forward(phases, replay))
            try:
                with (replay.running(model, self.tracker, phases.close) if replay is not None
                      else contextlib.nullcontext()), (
                        self.scaler.installed(trainer) if self.scaler else contextlib.nullcontext()):
                    loss = trainer.training_step(model, inputs, num_items)
            finally:
                hook.remove()
            del inputs
            phases.close(AFTER_BACKWARD)
            return loss
        loss = forward_loss(model, inputs, num_items)
        del inputs
        if num_items is None:
            loss = loss / self.request.gradient_accumulation_steps
        phases.close(AFTER_FORWARD)
        if self.scaler is not None:
            self.scaler.backward(loss)
        else:
            loss.backward()
        phases.close(AFTER_BACKWARD)
        return loss.detach()

    def simulation(self) -> StepSimulation:
        """The phases' highs (without the optimizer step: the forward/backward and generation phases)."""
        phases = self.phases
        if self.request.optimizer_step:
            return StepSimulation(dict(phases.best), [], dict(phases.details), dict(phases.tensors),
                                  dict(phases.windows))
        kept = (*FORWARD_BACKWARD_PHASES, GENERATION_PHASE)
        return StepSimulation(
            {phase: phases.best[phase] for phase in kept if phase in phases.best},
            [], {phase: phases.details.get(phase, {}) for phase in kept if phase in phases.best},
            {phase: t for phase, t in phases.tensors.items() if phase in kept},
            {phase: w for phase, w in phases.windows.items() if phase in kept})


def _close_after_forward(phases: Phases, replay: Any) -> Any:
    """The forward hook that closes ``after_forward`` (not on a decoding step inside ``generate``)."""
    def hook(*_: Any) -> None:
        if replay is None or not replay.generating:
            phases.close(AFTER_FORWARD)
    return hook


def _prime_optimizer(optimizer: Any, params: list[torch.nn.Parameter]) -> None:
    """An earlier optimizer step, short: create the lazily built state (gradients of the right shapes).

    The forward and backward of the earlier step are the later one's without optimizer state, so
    they cannot be higher and are not replayed; the state creation itself is tracked.
    """
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
