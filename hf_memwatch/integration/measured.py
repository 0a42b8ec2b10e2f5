"""The measured fallback: a run the estimator cannot replay is planned from micro-steps measured live.

Where the estimator cannot replay a Trainer's step (a custom ``training_step`` or ``compute_loss``,
an operator the fake-tensor replay does not know, a model that reads its inputs through NumPy), the
auto mode does not train unprotected. :func:`plan_by_measuring`, before ``train()`` builds its loop:

1. measures, on the live model, micro-steps (``trainer.training_step``: forward, loss, backward;
   no optimizer step, no weight updated) as the run will take them — in the mixed precision
   ``Trainer.train()`` applies (accelerate's autocast wrapper around the model's forward, which
   ``train()`` installs only when it prepares the model: measured without it, IWOPD's bf16 micro-step
   was 12.1% under the run's, 1,067,136 vs 1,213,824 B above the weights; with it 2,834,048 B, the
   run's 2,834,064 B) — on the longest sample
   of the dataset (the worst batch the sampler can form, not the run's first: that may be its
   shortest). A micro-step of a plan with gradient accumulation is measured with the gradients of the
   earlier micro-steps resident (``.grad`` already allocated, the backward adding into it, as in
   every micro-step but the first), a micro-step without accumulation with none;
2. per checkpointing setting, the micro-step peak is read off the measured micro-batches: exact
   where measured, on the chord between the two measured neighbours in between (the peak is the
   highest of affine functions of the micro-batch — convex —, so a chord lies above it), and beyond
   the largest measured on the line through the two largest. That extrapolation can lie *under* a
   convex peak (IWOPD: the line through micro-batches 1 and 2 put 4 at 822,668 B, measured
   1,067,136 B: the gradients make the peak at 1 and 2, the activations at 4), so the plan chosen is
   measured itself and the choice made again until the chosen micro-step rests on no extrapolation
   (:func:`plan_by_measuring`); :data:`MEASURED_MARGIN` covers the allocator's rounding;
3. adds the optimizer's part, which no micro-step shows: its states and the optimizer step's
   temporaries, replayed on fake parameters (nothing allocated) with the optimizer the Trainer will
   build;
4. hands that predictor to the one chooser (:func:`~hf_memwatch.planning.chooser.plan_run`), which
   raises the micro-batch as far as the measurements and the budget allow. Nothing fits: the run
   stops before training with the figures (:class:`~hf_memwatch.core.errors.PlanError`).

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

from ..compat.accelerate import forward_wrapped_for_mixed_precision
from ..core.errors import PlanError, is_oom_error
from ..core.records import PlannedBatch
from ..core.run_config import RunConfig, model_is_checkpointing
from ..core.units import format_bytes
from ..estimation.kernel_workspaces import run_cpu_kernel
from ..estimation.trainer_replay import (
    RngStates,
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

# What a measured micro-step may miss (the allocator's rounding, a batch of other samples formed
# slightly otherwise): every measured prediction is raised by it.
MEASURED_MARGIN = 0.03
# The micro-batches each line is first measured at (two points make the line).
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
    """One micro-step measured live: its micro-batch, checkpointing, whether earlier micro-steps'
    gradients were resident (``gradient_accumulation``: a later micro-step of an accumulation; the plan
    record's key, written ``accumulating`` before), the highest live bytes (weights included; None: out
    of memory) and the live bytes before it."""

    micro_batch_size: int
    activation_checkpointing: bool
    peak: int | None
    before: int
    gradient_accumulation: bool = False

    def key(self) -> tuple[int, bool, bool]:
        return self.micro_batch_size, self.activation_checkpointing, self.gradient_accumulation

    def as_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "activation_checkpointing": self.activation_checkpointing,
                "gradient_accumulation": self.gradient_accumulation, "peak": self.peak, "before": self.before}


@contextlib.contextmanager
def no_trace(trainer: Any) -> Iterator[None]:
    """Everything a live micro-step changes, restored on exit: RNG states, the Trainer's counters and
    ``state``, module modes, buffers and gradients (the gradients it made are dropped)."""
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


@contextlib.contextmanager
def mixed_precision(trainer: Any) -> Iterator[None]:
    """The model's forward wrapped as ``Accelerator.prepare_model`` wraps it for native mixed precision
    (autocast, outputs converted to fp32) — which ``train()`` does only when it prepares the model, after
    planning — unless it is wrapped already; put back on exit."""
    accelerator, model = getattr(trainer, "accelerator", None), trainer.model
    if not getattr(accelerator, "native_amp", False) or forward_wrapped_for_mixed_precision(model):
        yield
        return
    from types import MethodType

    from accelerate.utils import convert_outputs_to_fp32
    from accelerate.utils.modeling import get_mixed_precision_context_manager

    had, saved = "forward" in vars(model), vars(model).get("forward")
    autocast = get_mixed_precision_context_manager(True, accelerator.autocast_handler)
    forward = model.forward
    if hasattr(forward, "__func__"):  # as accelerate wraps it
        model.forward = MethodType(autocast(forward.__func__), model)
        model.forward = MethodType(convert_outputs_to_fp32(model.forward.__func__), model)
    else:
        model.forward = convert_outputs_to_fp32(autocast(forward))
    try:
        yield
    finally:
        if had:
            model.forward = saved
        else:
            vars(model).pop("forward", None)


def _resident_gradients(trainer: Any) -> list[torch.Tensor]:
    """``.grad`` of every trainable parameter allocated (zeros), as after a first micro-step of an
    accumulated step: the next backward adds into them (no_trace puts the old ones back)."""
    grads = []
    for param in trainer.model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
            grads.append(param.grad)
    return grads


def measure_micro_step(trainer: Any, items: list[Any], checkpointing: bool, accumulating: bool = False) -> Measurement:
    """One ``training_step`` of the live model on ``items`` (collated as the Trainer collates them),
    in the run's mixed precision, with earlier micro-steps' gradients resident where ``accumulating``,
    measured by the device's allocator (CUDA) or the storage tracker (CPU); nothing left behind."""
    device = torch.device(trainer.args.device)
    model = trainer.model
    toggled = checkpointing and not model_is_checkpointing(model)
    if toggled:
        enable_checkpointing_now(trainer)
    try:
        with no_trace(trainer), mixed_precision(trainer):
            batch = collate(trainer, copy.deepcopy(items))
            grads = _resident_gradients(trainer) if accumulating else []
            backend = backend_for(device)
            tracker = StorageTracker(device.type) if device.type == "cpu" else None
            if tracker is not None:
                tracker.kernel_call = run_cpu_kernel  # kernels' own allocations, as the live run counts them
                tracker.register(_weights(trainer))
                tracker.register(v for v in _tensors(batch))
                tracker.register(grads)
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
            del batch, grads
    finally:
        if toggled:
            _disable_checkpointing(model)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return Measurement(len(items), checkpointing, None if peak is None else int(peak), int(before or 0), accumulating)


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
    creates the states, the second holds them through a whole step. The optimizer is built outside
    the fake mode (bitsandbytes fills its quantization maps with ``tolist()``) and, for 8-bit
    bitsandbytes, keeps embeddings' states in 32 bits as ``Trainer.create_optimizer`` does; its CPU
    kernels are replayed as they allocate (:class:`~hf_memwatch.estimation.fake_dispatch.EstimateTracker`).
    A custom optimizer handed to the Trainer is rebuilt as the estimate rebuilds it
    (:func:`~hf_memwatch.estimation.user_optimizer.rebuild`: its groups' options, bitsandbytes' rules).
    """
    import types
    import warnings

    from ..compat.torch_internals import FakeTensorMode, disable_current_modes
    from ..estimation.fake_dispatch import EstimateTracker
    from ..estimation.optim import optimizer_class_and_kwargs
    from ..estimation.user_optimizer import is_bitsandbytes, rebuild, user_optimizer
    from ..measure.saved_tensors import SavedTensorRegistry

    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    custom = user_optimizer(trainer, optim)
    if custom is not None and custom.cls_and_kwargs is not None:
        cls, kwargs = custom.cls_and_kwargs
    else:
        cls, kwargs = optimizer_class_and_kwargs(optim, trainer.model)
    device_type = trainer.model.device.type if hasattr(trainer.model, "device") else "cpu"
    with disable_current_modes():
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode:
            params = [torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.device)) for p in trainable]
        if custom is not None and custom.instance is not None:
            optimizer = rebuild(custom.instance, {id(live): fake for live, fake in zip(trainable, params, strict=True)},
                                "cpu")  # fake tensors on the live device: torch picks the implementation
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                optimizer = cls(params, **kwargs)
        if (custom is None or custom.instance is None) and "bitsandbytes" in str(cls) and kwargs.get("optim_bits") == 8:
            from bitsandbytes.optim import GlobalOptimManager

            fakes = {id(live): fake for live, fake in zip(trainable, params, strict=True)}
            manager = GlobalOptimManager.__new__(GlobalOptimManager)
            manager.initialize()
            for module in trainer.model.modules():
                if isinstance(module, torch.nn.Embedding) and id(module.weight) in fakes:
                    manager.register_module_override(types.SimpleNamespace(weight=fakes[id(module.weight)]),
                                                     "weight", {"optim_bits": 32})
            optimizer.mng = manager
        tracker = EstimateTracker(device_type, SavedTensorRegistry(),
                                  bnb_cpu_kernels=device_type == "cpu" and is_bitsandbytes(optimizer))
        with fake_mode, tracker:
            tracker.register(params)
            for param in params:
                param.grad = torch.empty_like(param)
            tracker.reset_peak()
            held = tracker.allocated
            for _ in range(2):
                optimizer.step()
            states = tracker.allocated - held
            step = tracker.peak - held
    return max(int(states), 0), max(int(step), 0)


@dataclass
class MeasuredPredictor:
    """Predicts plans of ``run`` from micro-steps measured live (see the module docstring).

    ``items(m)`` gives the samples of a micro-batch of ``m``; micro-steps are measured when first
    needed, unless :attr:`frozen` (after planning: training has begun, nothing more is measured).
    """

    trainer: Any
    run: RunConfig
    items: Any
    margin: float = MEASURED_MARGIN
    calls: int = 0
    frozen: bool = False
    measurements: list[Measurement] = field(default_factory=list)
    optimizers: dict[str, tuple[int, int]] = field(default_factory=dict)
    budget: int | None = None  # no micro-step is measured that the figures in hand put over it
    ruled_out: set[tuple[int, bool, bool]] = field(default_factory=set)  # ... and those are over it

    def gradients(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.trainer.model.parameters() if p.requires_grad)

    def lower_bound(self, micro: int, checkpointing: bool, accumulating: bool) -> int:
        """A floor under a micro-step's peak from those measured: a micro-batch no larger, checkpointed
        where this one is not, peaks no higher (with accumulation: less the resident gradients, where
        this one has none); OVER where such a micro-step did not fit the device."""
        floor = 0
        for m in self.measurements:
            if m.micro_batch_size <= micro and (m.activation_checkpointing or not checkpointing):
                if m.peak is None:
                    return OVER
                floor = max(floor, m.peak - (self.gradients() if m.gradient_accumulation and not accumulating else 0))
        return floor

    def measured(self, micro: int, checkpointing: bool, accumulating: bool) -> Measurement:
        """The micro-step measured live (once); not measured — peak None — where the figures in hand
        put it over the budget already (measuring it would take the memory the budget forbids)."""
        for found in self.measurements:
            if found.key() == (micro, checkpointing, accumulating):
                return found
        if self.frozen:
            raise RuntimeError(f"micro-batch {micro} with checkpointing {checkpointing} was not measured")
        if self.budget is not None and self.lower_bound(micro, checkpointing, accumulating) > self.budget:
            self.ruled_out.add((micro, checkpointing, accumulating))
            return Measurement(micro, checkpointing, None, 0, accumulating)
        found = measure_micro_step(self.trainer, self.items(micro), checkpointing, accumulating)
        self.measurements.append(found)
        return found

    def points(self, checkpointing: bool, accumulating: bool) -> dict[int, int | None]:
        """Micro-batch -> measured peak of one setting."""
        return {m.micro_batch_size: m.peak for m in self.measurements
                if (m.activation_checkpointing, m.gradient_accumulation) == (checkpointing, accumulating)}

    def extrapolated(self, micro: int, checkpointing: bool, accumulating: bool) -> bool:
        """Whether the micro-step peak of ``micro`` rests on no measurement of its own setting and
        micro-batch, nor on a chord between two (a line beyond them may lie under the peak, and one
        without accumulation is read off the accumulated line): measure it before relying on it."""
        points = self.points(checkpointing, accumulating)
        if micro in points:
            return False
        return not accumulating or micro > max(points, default=0)

    def micro_step_peak(self, micro: int, checkpointing: bool, accumulating: bool) -> int:
        """The micro-step peak of a micro-batch of ``micro``: measured, on the chord between measured
        neighbours, or beyond them on the line through the two largest. Without accumulation
        (``micro`` is the effective batch) it is read off the accumulated line (whose gradients are
        resident all through: no lower) until measured itself."""
        if (micro, checkpointing, accumulating) in self.ruled_out:
            return OVER
        if self.run.effective_batch < 2 or micro == LINE_POINTS[0] or micro in self.points(checkpointing, accumulating):
            found = self.measured(micro, checkpointing, accumulating).peak
            return OVER if found is None else found
        for anchor in LINE_POINTS:
            if anchor < self.run.effective_batch and self.measured(anchor, checkpointing, True).peak is None:
                return OVER
        points = self.points(checkpointing, True)
        if micro in points:
            return OVER if points[micro] is None else int(points[micro])
        below = [m for m in points if m < micro]
        above = [m for m in points if m > micro]
        if not above and len(below) < 2:  # one point (an effective batch of 2): what it adds, scaled
            (low,) = below
            first = self.measurements[[m.key() for m in self.measurements].index((low, checkpointing, True))]
            return OVER if first.peak is None else first.before + (first.peak - first.before) * micro // low
        low, high = (max(below), min(above)) if above else sorted(below)[-2:]
        if points[low] is None or points[high] is None:
            return OVER
        slope = max(points[high] - points[low], 0) / (high - low)
        return int(math.ceil(points[low] + slope * (micro - low)))

    def optimizer(self, optim: str) -> tuple[int, int]:
        if optim not in self.optimizers:
            self.optimizers[optim] = optimizer_bytes(self.trainer, optim)
        return self.optimizers[optim]

    def peak(self, plan: Plan) -> int:
        """The step peak of ``plan``, margin included: the largest of the micro-step with the optimizer's
        states resident (with accumulation: measured with the earlier micro-steps' gradients resident)
        and the optimizer step (weights, gradients, states and its temporaries)."""
        self.calls += 1
        accumulating = plan.gradient_accumulation_steps > 1
        micro = self.micro_step_peak(plan.micro_batch_size, plan.activation_checkpointing, accumulating)
        if micro >= OVER:
            return OVER
        try:
            states, step = self.optimizer(plan.optim)
        except Exception:  # noqa: BLE001 - an optimizer whose step cannot be sized: not a plan to choose
            return OVER
        gradients = self.gradients()
        before = max(m.before - (gradients if m.gradient_accumulation else 0) for m in self.measurements)
        need = max(micro + states, before + gradients + step)
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


def choose_measured(run: RunConfig, predictor: MeasuredPredictor, budget: int) -> PlanResult:
    """The chooser's plan from ``predictor``, chosen again after measuring the chosen micro-step
    wherever it lay beyond every micro-batch measured (each round measures a larger one or rules one
    out, so the rounds end by the effective batch)."""
    while True:
        result = plan_run(run, predictor, budget)
        chosen = result.chosen
        if chosen is None:
            return result
        setting = (chosen.micro_batch_size, chosen.activation_checkpointing, chosen.gradient_accumulation_steps > 1)
        if not predictor.extrapolated(*setting):
            return result
        predictor.measured(*setting)


def plan_by_measuring(trainer: Any, run: RunConfig, budget: int, why: BaseException) -> tuple[PlanResult, Any, dict]:
    """(the chosen plan, its predictor, the :class:`~hf_memwatch.core.records.PlanRecord` fields) for ``run`` against ``budget`` (usable bytes)
    from micro-steps measured live; raises :class:`PlanError` (with the figures) when nothing fits."""
    index, length, items = sample_items(trainer)
    predictor = MeasuredPredictor(trainer, run, items, budget=budget)
    # The catalogue's most conservative micro-step first: its figure bounds what is measured next.
    predictor.measured(1, run.activation_checkpointing or not run.checkpointing_unavailable, run.effective_batch > 1)
    text = str(why).splitlines()[0] if str(why) else ""
    cause = text.removeprefix("the estimator cannot replay this run: ")[:200] or type(why).__name__
    result = choose_measured(run.replace(seq_len=int(length or 1)), predictor, budget)
    if result.chosen is None:
        closest = result.best_effort()
        least = int(closest.predicted_peak if closest.predicted_peak is not None else predictor.peak(closest))
        raise over_budget_error(
            f"hf-memwatch: the estimator cannot replay this run ({cause}), and the least of the plans measured "
            f"live ({closest.describe()}) needs {format_bytes(least)}, over the budget {format_bytes(budget)} by "
            f"{format_bytes(least - budget)}: nothing fits. Raise the budget, or use a smaller model or sequences.",
            least, budget)
    predictor.frozen = True
    result.chosen.reason = (f"measured (the estimator cannot replay this run: {cause}): "
                            + result.chosen.reason.replace("predicted", "measured"))
    sizes = sorted({m.micro_batch_size for m in predictor.measurements})
    fields = {"source": "measured", "measurements": [m.as_dict() for m in predictor.measurements],
              "sample": PlannedBatch(index=index, seq_len=length, source="measured",
                                     notes=[f"{m} x sample {index} per micro-batch measured live" for m in sizes],
                                     indices=[int(index)] * result.chosen.micro_batch_size,
                                     tokens=None if length is None else int(length) * result.chosen.micro_batch_size)}
    return result, predictor, fields
