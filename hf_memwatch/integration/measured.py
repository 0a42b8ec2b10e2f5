"""The measured fallback: a run the estimator cannot replay is planned from micro-steps measured live.

Where the estimator cannot replay a Trainer's step (a custom ``training_step`` or ``compute_loss``,
an operator the fake-tensor replay does not know, a model that reads its inputs through NumPy), the
auto mode does not train unprotected. :func:`plan_by_measuring`, before ``train()`` builds its loop:

1. measures, on the live model, one micro-step (``trainer.training_step``: forward, loss, backward;
   no optimizer step, no weight updated) of the most conservative plan of the catalogue — micro-batch
   1, activation checkpointing on where the model has it — on the longest sample of the dataset (the
   worst batch the sampler can form, not the run's first: that may be its shortest). Over the budget:
   the run stops before training with the figures (:class:`~hf_memwatch.core.errors.PlanError`);
2. fits, per checkpointing setting the chooser asks about, the line ``peak(m) = a + b·m`` through
   micro-steps measured at micro-batches 1 and 2 (the peak is close to affine in the micro-batch;
   :data:`MEASURED_MARGIN` covers the rest);
3. adds the optimizer's part, which no micro-step shows: its states and the optimizer step's
   temporaries, replayed on fake parameters (nothing allocated) with the optimizer the Trainer will
   build; with gradient accumulation the gradients of earlier micro-steps are live through later
   ones, so their bytes are added too;
4. hands that predictor to the one chooser (:func:`~hf_memwatch.planning.chooser.plan_run`), which
   raises the micro-batch as far as the line and the budget allow.

Every measurement leaves no trace (:func:`no_trace`): the RNG states (Python, NumPy, torch, CUDA), the
Trainer's plain counters and ``state``, the modules' train/eval modes, buffers and gradients are
restored, checkpointing is switched back off where it was off, and no batch is drawn from the user's
iterator (samples are read by index). The run is then the hand-configured run of the plan chosen.
The ``plan`` record says ``source: "measured"`` and lists the ``measurements``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import PlanError, is_oom_error
from ..core.records import PlannedBatch
from ..core.run_config import RunConfig, model_is_checkpointing
from ..core.units import format_bytes
from ..estimation.trainer_replay import (
    TrainerStateGuard,
    collate,
    is_one_pass,
    longest_index,
    training_dataset,
)
from ..measure.backends import backend_for
from ..measure.held_models import held_models
from ..measure.tracker import StorageTracker
from ..planning.chooser import PlanResult, plan_run
from ..planning.plan import Plan
from .apply import enable_checkpointing_now

# What a line through two measured micro-steps may miss (rounding of the allocator, a slightly
# super-linear attention term at larger micro-batches): every measured prediction is raised by it.
MEASURED_MARGIN = 0.03
# The micro-batches each line is measured at (two points make the line).
LINE_POINTS = (1, 2)
OVER = 1 << 62  # the peak given to a plan that could not be measured (an OOM while measuring)


def over_budget_error(message: str, need: int | None, budget: int | None) -> PlanError:
    """A :class:`PlanError` that carries the figures (``need``: the least predicted or measured peak,
    ``budget``: what it was compared with), so that an explicit ``allow_over_budget`` can say how far over."""
    error = PlanError(message)
    error.need, error.budget = need, budget  # type: ignore[attr-defined]
    return error


@dataclass(frozen=True)
class Measurement:
    """One micro-step measured live: its micro-batch, checkpointing, and the highest live bytes
    (weights included; None: out of memory) and the live bytes before it."""

    micro_batch_size: int
    activation_checkpointing: bool
    peak: int | None
    before: int

    def as_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "activation_checkpointing": self.activation_checkpointing,
                "peak": self.peak, "before": self.before}


@contextlib.contextmanager
def no_trace(trainer: Any) -> Iterator[None]:
    """Everything a live micro-step changes, restored on exit: RNG states, the Trainer's counters and
    ``state``, module modes, buffers and gradients (the gradients it made are dropped)."""
    from .auto import RngStates  # the auto mode's own (imported here: auto imports this module)

    model = trainer.model
    rng = RngStates.capture()
    modes = [(module, module.training) for module in model.modules()]
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    grads = [(param, param.grad) for param in model.parameters()]
    try:
        with TrainerStateGuard(trainer, int(getattr(trainer.args, "gradient_accumulation_steps", 1) or 1)):
            vars(trainer).pop("_prepare_input", None)  # the guard's fake-batch shortcut: this batch is real
            yield
    finally:
        for param, grad in grads:
            param.grad = grad
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for module, training in modes:
            module.training = training
        rng.restore()


def _weights(trainer: Any) -> list[torch.Tensor]:
    tensors = [*trainer.model.parameters(), *trainer.model.buffers()]
    for module in held_models(trainer).values():
        tensors += [*module.parameters(), *module.buffers()]
    return tensors


def measure_micro_step(trainer: Any, items: list[Any], checkpointing: bool) -> Measurement:
    """One ``training_step`` of the live model on ``items`` (collated as the Trainer collates them),
    measured by the device's allocator (CUDA) or the storage tracker (CPU); nothing left behind."""
    device = torch.device(trainer.args.device)
    model = trainer.model
    toggled = checkpointing and not model_is_checkpointing(model)
    if toggled:
        enable_checkpointing_now(trainer)
    try:
        with no_trace(trainer):
            batch = collate(trainer, copy.deepcopy(items))
            backend = backend_for(device)
            tracker = StorageTracker(device.type) if device.type == "cpu" else None
            if tracker is not None:
                tracker.register(_weights(trainer))
                tracker.register(v for v in _tensors(batch))
            elif backend.kind == "none":
                raise RuntimeError(f"no allocator statistics on {device}: the micro-step cannot be measured")
            before = tracker.allocated if tracker is not None else backend.read().allocated
            if tracker is None:
                backend.reset_peak()
            try:
                with tracker if tracker is not None else contextlib.nullcontext():
                    trainer.training_step(model, batch)
                peak = tracker.peak if tracker is not None else backend.read().peak
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                peak = None
            del batch
    finally:
        if toggled:
            _disable_checkpointing(model)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return Measurement(len(items), checkpointing, None if peak is None else int(peak), int(before or 0))


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


def _disable_checkpointing(model: Any) -> None:
    target = getattr(model, "module", model)
    if hasattr(target, "activation_checkpointing_disable"):
        target.activation_checkpointing_disable()
    else:
        target.gradient_checkpointing_disable()


def optimizer_bytes(trainer: Any, optim: str) -> tuple[int, int]:
    """(states, step) of ``optim`` on the Trainer's trainable parameters: the bytes of states it keeps
    and the most it holds beyond the parameters and gradients during a step (states + temporaries).

    Two optimizer steps replayed on fake parameters and gradients (nothing allocated): the first
    creates the states, the second holds them through a whole step. A custom optimizer handed to the
    Trainer is rebuilt from its class and ``defaults``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..estimation.optim import optimizer_class_and_kwargs

    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    custom = getattr(trainer, "optimizer", None)
    if custom is not None:
        cls, kwargs = type(custom), dict(custom.defaults)
    else:
        cls, kwargs = optimizer_class_and_kwargs(optim, trainer.model)
    device_type = trainer.model.device.type if hasattr(trainer.model, "device") else "cpu"
    tracker = StorageTracker(device_type)
    with FakeTensorMode(), tracker:
        params = [torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.device)) for p in trainable]
        for param in params:
            param.grad = torch.empty_like(param)
        tracker.reset_peak()
        held = tracker.allocated
        optimizer = cls(params, **kwargs)
        for _ in range(2):
            optimizer.step()
        states = tracker.allocated - held
        step = tracker.peak - held
    return max(int(states), 0), max(int(step), 0)


@dataclass
class MeasuredPredictor:
    """Predicts plans of ``run`` from micro-steps measured live (see the module docstring).

    ``items(m)`` gives the samples of a micro-batch of ``m``; lines are measured when first asked
    for, unless :attr:`frozen` (after planning: training has begun, nothing more is measured).
    """

    trainer: Any
    run: RunConfig
    items: Any
    margin: float = MEASURED_MARGIN
    calls: int = 0
    frozen: bool = False
    measurements: list[Measurement] = field(default_factory=list)
    optimizers: dict[str, tuple[int, int]] = field(default_factory=dict)

    def measured(self, micro: int, checkpointing: bool) -> Measurement:
        for found in self.measurements:
            if (found.micro_batch_size, found.activation_checkpointing) == (micro, checkpointing):
                return found
        if self.frozen:
            raise RuntimeError(f"micro-batch {micro} with checkpointing {checkpointing} was not measured")
        found = measure_micro_step(self.trainer, self.items(micro), checkpointing)
        self.measurements.append(found)
        return found

    def micro_step_peak(self, micro: int, checkpointing: bool) -> int:
        """The forward/backward peak of a micro-batch of ``micro``: measured, or on the measured line."""
        first = self.measured(LINE_POINTS[0], checkpointing)
        if first.peak is None:
            return OVER
        if micro == LINE_POINTS[0] or self.run.effective_batch < 2:
            return first.peak
        second = self.measured(LINE_POINTS[1], checkpointing)
        if second.peak is None:
            return OVER
        slope = max(second.peak - first.peak, 0) / (LINE_POINTS[1] - LINE_POINTS[0])
        return int(math.ceil(first.peak + slope * (micro - LINE_POINTS[0])))

    def optimizer(self, optim: str) -> tuple[int, int]:
        if optim not in self.optimizers:
            self.optimizers[optim] = optimizer_bytes(self.trainer, optim)
        return self.optimizers[optim]

    def peak(self, plan: Plan) -> int:
        """The step peak of ``plan``, margin included: the largest of the micro-step with the optimizer's
        states resident (and the gradients of earlier micro-steps, with accumulation) and the optimizer
        step (weights, gradients, states and its temporaries)."""
        self.calls += 1
        micro = self.micro_step_peak(plan.micro_batch_size, plan.activation_checkpointing)
        if micro >= OVER:
            return OVER
        try:
            states, step = self.optimizer(plan.optim)
        except Exception:  # noqa: BLE001 - an optimizer whose step cannot be sized: not a plan to choose
            return OVER
        gradients = sum(p.numel() * p.element_size() for p in self.trainer.model.parameters() if p.requires_grad)
        before = self.measurements[0].before
        accumulated = gradients if plan.gradient_accumulation_steps > 1 else 0
        need = max(micro + states + accumulated, before + gradients + step)
        return int(math.ceil(need * (1.0 + self.margin)))


def sample_items(trainer: Any) -> Any:
    """``items(m)``: ``m`` copies of the longest sample of the training dataset (read by index)."""
    dataset = training_dataset(trainer)
    if dataset is None or is_one_pass(dataset) or len(dataset) == 0:
        raise RuntimeError("no training dataset that can be read by index: no micro-step can be measured before "
                           "training")
    index, length = longest_index(dataset)
    item = dataset[index]
    return index, length, (lambda m: [copy.deepcopy(item) for _ in range(m)])


def conservative_plan(run: RunConfig) -> Plan:
    """The catalogue's most conservative plan of ``run``: micro-batch 1, checkpointing where available."""
    checkpointing = run.checkpointing or not run.checkpointing_unavailable
    return Plan(1, run.effective_batch, checkpointing, run.optim)


def plan_by_measuring(trainer: Any, run: RunConfig, budget: int, why: BaseException) -> tuple[PlanResult, Any, dict]:
    """(the chosen plan, its predictor, the :class:`~hf_memwatch.core.records.PlanRecord` fields) for ``run`` against ``budget`` (usable bytes)
    from micro-steps measured live; raises :class:`PlanError` (with the figures) when nothing fits."""
    index, length, items = sample_items(trainer)
    predictor = MeasuredPredictor(trainer, run, items)
    safest = conservative_plan(run)
    least = predictor.peak(safest)
    text = str(why).splitlines()[0] if str(why) else ""
    cause = text.removeprefix("the estimator cannot replay this run: ")[:200] or type(why).__name__
    if least > budget:
        raise over_budget_error(
            f"hf-memwatch: the estimator cannot replay this run ({cause}), and the most conservative plan measured "
            f"live ({safest.describe()}) needs {format_bytes(least)}, over the budget {format_bytes(budget)} by "
            f"{format_bytes(least - budget)}: nothing fits. Raise the budget, or use a smaller model or sequences.",
            least, budget)
    result = plan_run(run.replace(seq_len=int(length or 1)), predictor, budget)
    if result.chosen is None:  # cannot happen with the conservative plan fitting; kept for the figures
        raise over_budget_error(f"hf-memwatch: no measured plan fits the budget {format_bytes(budget)}", least, budget)
    predictor.frozen = True
    result.chosen.reason = (f"measured (the estimator cannot replay this run: {cause}): "
                            + result.chosen.reason.replace("predicted", "measured"))
    fields = {"source": "measured", "measurements": [m.as_dict() for m in predictor.measurements],
              "sample": PlannedBatch(index=index, seq_len=length, source="measured",
                                     notes=[f"{m} x sample {index} per micro-batch measured live" for m in LINE_POINTS],
                                     indices=[int(index)] * result.chosen.micro_batch_size,
                                     tokens=None if length is None else int(length) * result.chosen.micro_batch_size)}
    return result, predictor, fields
