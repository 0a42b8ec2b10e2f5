"""The auto mode: ``MemWatch(auto=True, budget=...)`` plans a run that fits before it starts.

How it reaches the run without an extra call from the user: at ``on_init_end`` the callback wraps
the Trainer instance's ``train`` (:meth:`AutoMode.install`). Before the original ``train()`` runs —
before a dataloader, optimizer or scheduler exists, before any batch of the configured size was
ever formed — :meth:`AutoMode.before_train`:

1. resolves the budget (:mod:`hf_memwatch.planning.budget`);
2. measures the live model with *probes*: forward + backward of real training samples padded to the
   worst-case sequence length, at micro-batches 1 and 2, with and without activation checkpointing,
   gradients resident (as in every accumulation micro-step after the first); and the optimizer's
   state and step temporaries on zero-filled copies of each distinct parameter shape
   (:class:`Probe`). RNG states, buffers and gradients are restored afterwards, so the run is the one
   a hand-configured run would be;
3. predicts every candidate plan (micro-batches dividing the per-device effective batch,
   checkpointing on/off, 8-bit AdamW or not), keeps those under the budget and picks the fastest
   by a simple throughput model (:func:`relative_throughput`);
4. writes it into the Trainer (:func:`~hf_memwatch.planning.remedies.apply_plan`), records it (timeline
   ``plan`` event, one log line, the callback's saved state) and calls the original ``train()``.

No restart of the training loop is needed: nothing ran yet. During training,
:meth:`AutoMode.after_step` turns on activation checkpointing between two steps when a measured
peak comes within :data:`CHECKPOINT_TRIGGER` of the budget.

On resume from a checkpoint the recorded plan is read back from ``trainer_state.json`` and applied
as it was: the optimizer state and the step count in the checkpoint belong to that plan.
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import MemWatchConfigError, PlanError
from ..core.units import format_bytes
from ..measure.attribution import weight_storages
from ..measure.backends import AllocatorBackend, backend_for
from ..measure.distributed import expected_ddp_bucket_bytes
from ..measure.storage import collect_storages, nested_tensors
from ..planning import planner
from ..planning.budget import Budget, BudgetSpec, resolve_budget
from ..planning.remedies import (
    Plan,
    apply_plan,
    checkpointing_unavailable_reason,
    current_plan,
    eight_bit_optim_name,
    eight_bit_unavailable_reason,
    enable_checkpointing_now,
)

logger = logging.getLogger("hf_memwatch")

# A plan that changes a configuration which already fits must fit with this much to spare.
UPGRADE_HEADROOM = 0.85
# Checkpointing is switched on between steps once a measured peak reaches this share of the budget.
CHECKPOINT_TRIGGER = 0.95
# Margin on the predicted growth above the weights: for what the probes cannot see (extrapolation
# past the largest probe, allocator rounding). Measured raw predictions were within 0.1% (docs/auto.md).
PREDICTION_SAFETY = 1.03
PROBE_SIZES = (1, 2, 4)
# Two probe segments whose per-sample growths differ by less than this share lie on one line.
COLLINEAR_TOLERANCE = 0.01
# Plans whose predicted throughputs differ by less than this are a tie, won by the fewest changes
# (the cost model is not finer than that).
THROUGHPUT_TIE = 0.02
MAX_LENGTH_SCAN = 4096  # map-style datasets: items scanned for the longest sample
ITERABLE_SCAN = 64  # iterable datasets: items read from a fresh iterator


# -- throughput model -----------------------------------------------------------------------------
def relative_throughput(plan: Plan, reference: Plan, seq_len: int) -> float:
    """Predicted samples/s of ``plan`` relative to ``reference`` — the planner's documented cost model.

    Smaller micro-batches use the hardware worse, checkpointing recomputes the forward (x 1/1.33),
    8-bit AdamW is free; see :mod:`hf_memwatch.planning.planner`.

    Example:
        >>> ref = Plan(8, 1, False, "adamw_torch")
        >>> round(relative_throughput(Plan(4, 2, False, "adamw_torch"), ref, seq_len=256), 3)
        0.667
    """
    return planner.relative_throughput(
        plan.micro_batch_size, plan.activation_checkpointing, seq_len,
        reference.micro_batch_size, reference.activation_checkpointing,
    )


# -- probes ---------------------------------------------------------------------------------------
@dataclass
class ProbeResult:
    """What the probes measured on the live model (bytes)."""

    weights: int
    gradients: int
    # checkpointing -> {micro-batch: (peak of a first micro-step, peak of one with gradients resident)}
    forward_backward: dict[bool, dict[int, tuple[int, int]]] = field(default_factory=dict)
    optimizer_states: dict[str, int] = field(default_factory=dict)  # optim -> bytes
    optimizer_temporaries: dict[str, int] = field(default_factory=dict)
    seq_len: int | None = None
    engine: int = 0  # held for the whole run by a distributed engine: DDP's gradient buckets

    def forward_backward_peak(self, micro_batch: int, checkpointing: bool, accumulation: int) -> int:
        """Forward + backward peak at ``micro_batch``, linear between/after the probed sizes.

        Without accumulation every micro-step starts with no gradient (``zero_grad(set_to_none=True)``);
        with it, later micro-steps run with the gradients resident and add into them.
        """
        measured = self.forward_backward[checkpointing]
        points = {size: peaks[0] if accumulation == 1 else max(peaks) for size, peaks in measured.items()}
        if micro_batch in points:
            return points[micro_batch]
        # Beyond the probes: the line through the two largest ones (the smallest sizes are the least
        # linear: kernels pick other paths at a batch of one). The probe made them straddle no change
        # of peak regime where it could (see :func:`refinement_size`).
        (b1, p1), (b2, p2) = sorted(points.items())[-2:] if len(points) > 1 else (*points.items(), *points.items())
        per_sample = max(0.0, (p2 - p1) / (b2 - b1)) if b2 != b1 else float(p2 - self.weights - self.gradients)
        return int(p2 + per_sample * (micro_batch - b2))

    def predict(self, plan: Plan) -> int:
        """The step peak of ``plan``: the larger of forward/backward and optimizer-step peaks."""
        states = self.optimizer_states[plan.optim]
        forward_backward = self.forward_backward_peak(
            plan.micro_batch_size, plan.activation_checkpointing, plan.gradient_accumulation_steps
        )
        optimizer_step = self.weights + self.gradients + states + self.optimizer_temporaries[plan.optim]
        peak = max(forward_backward + states, optimizer_step) + self.engine
        return int(self.weights + PREDICTION_SAFETY * (peak - self.weights))


def _per_sample(points: dict[int, int], small: int, large: int) -> float:
    return (points[large] - points[small]) / (large - small)


def refinement_size(measured: dict[int, tuple[int, int]]) -> int | None:
    """A micro-batch to probe between the two largest probes, or None when their line can be trusted.

    A step's peak is the largest of several moments, each growing linearly with the micro-batch:
    early in backward (activations, the logits' gradient: grows fast) or at its end (every parameter
    gradient plus the sum for a tied weight: grows by the batch's input bytes only). Small probes
    can peak at the flat moment and larger ones at the steep one; a line through one of each
    under-predicts every larger micro-batch. That shows as a segment steeper than the one before
    it; the midpoint of the top segment is then probed, so the extrapolation runs along the shortest
    top segment there is (never less steep, the peak being convex in the micro-batch).

    Example (measured: GPT-2 of the tests, 32 tokens, first micro-step peaks; micro-batch 2 peaks
    at the end of backward, 4 early in it):
        >>> refinement_size({1: (5_747_208, 0), 2: (5_747_720, 0), 4: (8_426_760, 0)})
        3
        >>> refinement_size({1: (5_747_208, 0), 2: (5_747_720, 0), 3: (6_909_704, 0), 4: (8_426_760, 0)}) is None
        True
    """
    sizes = sorted(measured)
    if len(sizes) < 3 or sizes[-1] - sizes[-2] < 2:
        return None
    small, middle, large = sizes[-3:]
    for series in ({s: p[0] for s, p in measured.items()}, {s: max(p) for s, p in measured.items()}):
        below, top = _per_sample(series, small, middle), _per_sample(series, middle, large)
        if top - below > COLLINEAR_TOLERANCE * max(abs(top), 1.0):
            return (middle + large) // 2
    return None


class Probe:
    """Measured probes of a live Trainer's model, leaving no trace on the run."""

    def __init__(self, trainer: Any, backend: AllocatorBackend) -> None:
        self.trainer = trainer
        self.model = trainer.model
        self.backend = backend
        self.device = torch.device(trainer.args.device)
        self._longest: Any = None

    # -- samples ------------------------------------------------------------------------------
    def _dataset(self) -> Any:
        dataset = self.trainer.train_dataset
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self.trainer._remove_unused_columns(dataset, description="training")
        except ImportError:
            pass
        return dataset

    def _collate(self, items: list[Any]) -> dict[str, Any]:
        collator = self.trainer.data_collator
        if not hasattr(self.trainer.train_dataset, "column_names"):
            collator = self.trainer._get_collator_with_removed_columns(collator, description="training")
        return collator(items)

    def samples(self, count: int) -> tuple[dict[str, Any], int]:
        """``count`` copies of the dataset's longest sample (in a scan of its first items), collated.

        The worst case of sequence length is what sizes activations; the collator pads as in training.
        """
        if self._longest is None:
            dataset = self._dataset()
            if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
                items = [item for _, item in zip(range(ITERABLE_SCAN), iter(dataset), strict=False)]
            else:
                items = [dataset[i] for i in range(min(len(dataset), MAX_LENGTH_SCAN))]
            if not items:
                raise PlanError("MemWatch(auto=True) found no training sample to measure")
            self._longest = max(items, key=_sequence_length)
        return self._collate([self._longest] * count), _sequence_length(self._longest)

    # -- forward + backward -------------------------------------------------------------------
    def forward_backward(
        self, sizes: Iterable[int], checkpointing: bool, limit: int | None = None
    ) -> dict[int, tuple[int, int]]:
        """Peak device bytes of two accumulation micro-steps at each micro-batch size.

        Sizes past the first whose peak exceeds ``limit`` are not run (they could not fit, and
        running them could exhaust the device). Sizes between the two largest are added where their
        peaks came from different moments of the step (:func:`refinement_size`).
        """
        model = self.model
        was_checkpointing = bool(getattr(model, "is_activation_checkpointing", False))
        had_input_hook = hasattr(model, "_require_grads_hook")
        if checkpointing and not was_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable()
            else:  # transformers 4.x
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            measured: dict[int, tuple[int, int]] = {}
            for size in sorted(sizes):
                measured[size] = self._measure_micro_steps(size)
                if limit is not None and max(measured[size]) > limit:
                    break
            # Probes peaking in different regimes: one more between the two largest (no larger
            # than what already ran), until the top segment is one line or cannot be split.
            while (size := refinement_size(measured)) is not None:
                measured[size] = self._measure_micro_steps(size)
            return measured
        finally:
            if checkpointing and not was_checkpointing:
                if hasattr(model, "activation_checkpointing_disable"):
                    model.activation_checkpointing_disable()
                else:
                    model.gradient_checkpointing_disable()
                if not had_input_hook and hasattr(model, "_require_grads_hook"):
                    model.disable_input_require_grads()

    def _measure_micro_steps(self, size: int) -> tuple[int, int]:
        trainer, model = self.trainer, self.model
        batch, _ = self.samples(size)
        inputs = trainer._prepare_inputs(batch)
        self.backend.register(list(model.parameters()) + list(model.buffers()))
        self.backend.register(v for v in inputs.values() if isinstance(v, torch.Tensor))
        self.backend.start_tracking()
        peaks = []
        try:
            # Two micro-steps: the second runs with the first one's gradients resident, as accumulation does.
            for _ in range(2):
                self.backend.reset_peak()
                model.train()
                with trainer.compute_loss_context_manager():
                    loss = trainer.compute_loss(model, inputs)
                loss.backward()
                del loss
                peaks.append(int(self.backend.read().peak or 0))
        finally:
            self.backend.stop_tracking()
            model.zero_grad(set_to_none=True)
        return peaks[0], peaks[1]

    # -- optimizer ----------------------------------------------------------------------------
    def optimizer(self, optim: str) -> tuple[int, int]:
        """(state bytes for all trainable parameters, temporaries of one step) for ``optim``.

        The optimizer runs one step on zero-filled copies of each distinct trainable parameter shape
        (the real weights are never touched); state bytes are then summed over every parameter. As
        ``Trainer.create_optimizer`` does for bitsandbytes 8-bit optimizers, embedding weights keep
        32-bit states (there through bitsandbytes' global override registry, here through a second
        optimizer with ``optim_bits=32``, so the registry the real optimizer reads stays untouched).
        """
        from transformers.training_args import OptimizerNames

        args = copy.copy(self.trainer.args)
        args.optim = OptimizerNames(optim)
        optimizer_cls, optimizer_kwargs = self.trainer.get_optimizer_cls_and_kwargs(args, self.model)
        embedding_ids = {
            id(module.weight) for module in self.model.modules() if isinstance(module, torch.nn.Embedding)
        }
        keep_32_bit = "bitsandbytes" in str(optimizer_cls) and optimizer_kwargs.get("optim_bits") == 8
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        shapes: dict[tuple[Any, ...], int] = {}
        for param in trainable:
            key = (tuple(param.shape), param.dtype, keep_32_bit and id(param) in embedding_ids)
            shapes[key] = shapes.get(key, 0) + 1
        copies = {key: torch.zeros(key[0], dtype=key[1], device=self.device, requires_grad=True) for key in shapes}
        for tensor in copies.values():
            tensor.grad = torch.zeros_like(tensor)
        groups = [
            ([t for key, t in copies.items() if key[2] == is_embedding], kwargs)
            for is_embedding, kwargs in ((False, optimizer_kwargs), (True, {**optimizer_kwargs, "optim_bits": 32}))
        ]
        optimizers = [optimizer_cls(params, **kwargs) for params, kwargs in groups if params]
        step_peak = max(self._optimizer_step_peak(optimizer) for optimizer in optimizers)
        state_of = {id(t): state for optimizer in optimizers for t, state in optimizer.state.items()}
        states = {key: sum(collect_storages(nested_tensors(state_of.get(id(t), {})), self.device).values())
                  for key, t in copies.items()}
        state_total = sum(states[key] * count for key, count in shapes.items())
        temporaries = max(0, step_peak - max(
            sum(states[key] for key, t in copies.items() if any(t is q for q in params)) for params, _ in groups
        ))
        if self.device.type == "cuda":  # foreach/fused kernels hold temporaries for all parameters at once
            group = sum(t.numel() * t.element_size() for t in copies.values()) or 1
            temporaries = int(temporaries * sum(p.numel() * p.element_size() for p in trainable) / group)
        # Release the copies and states now: optimizers sit in reference cycles (and bitsandbytes in
        # a global registry), which would keep them alive into training until a garbage collection.
        for optimizer in optimizers:
            optimizer.state.clear()
            optimizer.param_groups.clear()
        for tensor in copies.values():
            tensor.grad = None
        del optimizers, copies, state_of
        gc.collect()
        return state_total, temporaries

    def _optimizer_step_peak(self, optimizer: Any) -> int:
        """Bytes the first ``optimizer.step()`` adds at its peak (new states and temporaries).

        On the CPU, PyTorch's own allocator events (``torch.profiler``) are read when no profiler is
        running already: fused and bitsandbytes kernels allocate temporaries that no dispatch mode
        sees. Otherwise the backend measures (exact on CUDA; on the CPU, operator outputs only).
        """
        if self.device.type == "cpu" and not torch._C._autograd._profiler_enabled():

            from ..testing.truth import cpu_memory_deltas, cpu_memory_profile

            with cpu_memory_profile() as prof:
                optimizer.step()
            running = peak = 0
            for _, delta in cpu_memory_deltas(prof):
                running += delta
                peak = max(peak, running)
            return peak
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.backend.register(params + [p.grad for p in params])
        self.backend.start_tracking()
        try:
            before = self.backend.read().allocated or 0
            self.backend.reset_peak()
            optimizer.step()
            return max(0, (self.backend.read().peak or 0) - before)
        finally:
            self.backend.stop_tracking()


def _sequence_length(item: Any) -> int:
    """Length of a sample's longest sequence field (0 for samples without one)."""
    if isinstance(item, dict):
        lengths = [len(v) for v in item.values() if hasattr(v, "__len__") and not isinstance(v, str)]
        return max(lengths, default=0)
    return 0


class _PreservedState:
    """Restore every RNG, buffer and gradient a probe may touch, so training is unchanged by it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __enter__(self) -> _PreservedState:
        self.python = random.getstate()
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        try:
            import numpy

            self.numpy = numpy.random.get_state()
        except ImportError:
            self.numpy = None
        self.buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        self.grads = {name: p.grad for name, p in self.model.named_parameters()}
        self.training = self.model.training
        return self

    def __exit__(self, *exc: Any) -> None:
        random.setstate(self.python)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.numpy is not None:
            import numpy

            numpy.random.set_state(self.numpy)
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                if name in self.buffers:
                    buffer.copy_(self.buffers[name])
        for name, param in self.model.named_parameters():
            param.grad = self.grads.get(name)
        self.model.train(self.training)


# -- the estimator beside the probes ------------------------------------------------------------
def _estimator_predictor(trainer: Any, seq_len: int, device_type: str) -> Callable[[Plan], int | None] | None:
    """Peak of a plan by :func:`hf_memwatch.estimation.estimate.estimate` on the live model (nothing allocated).

    The probes measure small micro-batches and extrapolate; where the peak moves from the end of
    backward (gradients) to the forward's activations as the micro-batch grows, the line through small
    probes is too flat (seen: 356 MiB predicted, 461 MiB measured for MiniLM at 32 x 32 tokens). The
    estimator replays the real step at the plan's own size (461 MiB predicted there), so the auto mode
    takes the larger of both. None when the estimator cannot be used; a plan it fails on gets None.
    """
    try:
        from ..estimation.estimate import estimate
    except Exception as exc:  # noqa: BLE001 - planning goes on with the probes alone
        logger.warning("hf-memwatch: the estimator is unavailable (%s); planning from probes only.", exc)
        return None
    args = trainer.args
    precision = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
    world_size = torch.distributed.get_world_size() if _distributed() else 1
    cache: dict[tuple[Any, ...], int | None] = {}
    warned: list[bool] = []

    def predict(plan: Plan) -> int | None:
        key = plan.key()
        if key not in cache:
            try:
                cache[key] = estimate(
                    trainer.model, batch_size=plan.micro_batch_size, seq_len=max(1, seq_len),
                    precision=precision, optim=plan.optim, checkpointing=plan.activation_checkpointing,
                    accum=plan.gradient_accumulation_steps, device=device_type,
                    max_grad_norm=float(getattr(args, "max_grad_norm", 1.0) or 0.0), world_size=world_size,
                ).peak_bytes
            except Exception as exc:  # noqa: BLE001 - e.g. a custom model the estimator cannot replay
                if not warned:
                    warned.append(True)
                    logger.warning("hf-memwatch: the estimator failed on this model (%s: %s); planning from "
                                   "probes only.", type(exc).__name__, exc)
                cache[key] = None
        return cache[key]

    return predict


class _Predictions:
    """Plan peaks: the probes' prediction, raised to the estimator's for every plan it has confirmed.

    :meth:`choose` picks on these figures and has the estimator confirm each pick (the estimator is
    the slower of the two: ~0.2 s a call even for a tiny model), re-choosing until the pick is
    confirmed to fit. So only the configuration as given and the plans that would be chosen are
    estimated, not every candidate.
    """

    def __init__(self, measured: Callable[[Plan], int], estimated: Callable[[Plan], int | None] | None) -> None:
        self.measured = measured
        self.estimated = estimated
        self.confirmed: dict[tuple[Any, ...], int] = {}

    def predict(self, plan: Plan) -> int:
        by_probe = self.measured(plan)
        return max(by_probe, self.confirmed.get(plan.key(), by_probe))

    def confirm(self, plan: Plan) -> None:
        if plan.key() not in self.confirmed:
            by_estimator = self.estimated(plan) if self.estimated is not None else None
            self.confirmed[plan.key()] = by_estimator if by_estimator is not None else self.measured(plan)

    def choose(self, given: Plan, candidates: list[Plan], budget: int) -> Plan | None:
        while True:
            chosen = choose(given, candidates, self.predict, budget)
            if chosen is None or chosen.key() in self.confirmed:
                return chosen
            self.confirm(chosen)


# -- distributed agreement -----------------------------------------------------------------------
def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(plan: Plan, need_bytes: int) -> Plan:
    """The same plan on every rank: the rank that needs the most memory decides for all.

    Single-process runs (and installs without :mod:`hf_memwatch.measure.distributed`) keep ``plan``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return plan
    from ..measure.distributed import agree_plan  # the distributed module (issue 7)

    agreed = agree_plan(plan.as_dict(), need_bytes)
    return Plan(
        micro_batch_size=int(agreed["micro_batch_size"]),
        gradient_accumulation_steps=int(agreed["gradient_accumulation_steps"]),
        activation_checkpointing=bool(agreed["activation_checkpointing"]),
        optim=str(agreed["optim"]),
        predicted_peak=agreed.get("predicted_peak"),
        relative_throughput=float(agreed.get("relative_throughput", 1.0)),
        reason=str(agreed.get("reason", plan.reason)),
    )


def agree_unavailable_remedies(skipped: dict[str, str]) -> dict[str, str]:
    """Remedies unavailable on any rank are excluded on every rank (a collective in distributed runs)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return skipped
    from ..measure.distributed import agree_unavailable

    return agree_unavailable(skipped)


# -- choosing -------------------------------------------------------------------------------------
def candidate_plans(given: Plan, allow_checkpointing: bool, eight_bit: str | None, seq_len: int) -> list[Plan]:
    """Every plan with the effective batch of ``given``: micro-batch | effective, x ckpt x optim."""
    effective = given.micro_batch_size * given.gradient_accumulation_steps
    checkpointing = {given.activation_checkpointing} | ({True} if allow_checkpointing else set())
    optims = {given.optim} | ({eight_bit} if eight_bit else set())
    plans = []
    for micro in planner.divisors(effective):
        for ckpt in sorted(checkpointing):
            for optim in sorted(optims):
                plan = Plan(micro, effective // micro, ckpt, optim)
                plan.relative_throughput = relative_throughput(plan, given, seq_len)
                plans.append(plan)
    return plans


def choose(given: Plan, candidates: list[Plan], predict: Callable[[Plan], int], budget: int) -> Plan | None:
    """The fastest candidate that fits ``budget``; ``given`` itself when it fits and nothing faster does.

    A candidate faster than an already-fitting ``given`` must fit with :data:`UPGRADE_HEADROOM`.
    Plans within :data:`THROUGHPUT_TIE` of the best predicted throughput tie; the tie goes to the
    plan closest to ``given`` (fewest changes).
    """
    for plan in candidates:
        plan.predicted_peak = predict(plan)
    given_fits = predict(given) <= budget
    limit = budget * UPGRADE_HEADROOM if given_fits else budget

    def changes(plan: Plan) -> int:
        return sum(a != b for a, b in zip(plan.key(), given.key(), strict=True))

    fitting = [p for p in candidates if p.predicted_peak is not None and p.predicted_peak <= budget]
    if given_fits:
        fitting = [p for p in fitting if p.key() == given.key() or p.predicted_peak <= limit]
    if not fitting:
        return None
    best = max(p.relative_throughput for p in fitting)
    close = [p for p in fitting if p.relative_throughput >= best - THROUGHPUT_TIE]
    return max(close, key=lambda p: (-changes(p), p.relative_throughput))


def explain(chosen: Plan, given: Plan, budget: Budget, skipped: dict[str, str]) -> str:
    """The one-line reason recorded with a plan."""
    given_peak = format_bytes(given.predicted_peak)
    if chosen.key() == given.key():
        text = f"configuration as given fits: predicted peak {format_bytes(chosen.predicted_peak)} <= budget {format_bytes(budget.usable)}"
    elif (given.predicted_peak or 0) > budget.usable:
        text = (
            f"configuration as given is predicted to peak at {given_peak}, over the budget "
            f"{format_bytes(budget.usable)}; fastest plan that fits: {chosen.describe()} "
            f"(throughput x{chosen.relative_throughput:.2f})"
        )
    else:
        text = (
            f"ample headroom (given configuration predicted at {given_peak} of {format_bytes(budget.usable)}): "
            f"raised to {chosen.describe()} (throughput x{chosen.relative_throughput:.2f})"
        )
    if skipped:
        text += "; skipped: " + "; ".join(f"{name} ({why})" for name, why in skipped.items())
    return text


# -- the auto mode --------------------------------------------------------------------------------
class AutoMode:
    """Plans before ``train()`` and keeps the run under budget between steps.

    ``plan`` (a dict, the ``plan`` event) survives in the callback's saved state.
    """

    def __init__(self, budget: BudgetSpec, record: Callable[[dict[str, Any]], None]) -> None:
        self.budget_spec = budget
        self.record = record  # writes a timeline record and the callback state
        self.budget: Budget | None = None
        self.plan: dict[str, Any] | None = None
        self.probe_seconds: float | None = None
        self._checkpointing_refused = False
        self.installed = False  # train() wrapped: planning happens before the loop is built

    # -- wiring -------------------------------------------------------------------------------
    def install(self, trainer: Any) -> None:
        """Wrap ``trainer.train`` (instance attribute) so planning precedes the original train()."""
        if getattr(trainer.train, "_memwatch_auto", False):
            return
        original = trainer.train

        @functools.wraps(original)
        def train(*args: Any, **kwargs: Any) -> Any:
            resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
            try:
                self.before_train(trainer, resume)
            except (PlanError, MemWatchConfigError):
                raise  # the run cannot fit, or was misconfigured: stop before training
            except Exception as exc:  # noqa: BLE001 - a fault of ours must never kill the run
                logger.warning(
                    "hf-memwatch: auto mode failed while planning (%s: %s); training as configured.",
                    type(exc).__name__,
                    exc,
                )
            return original(*args, **kwargs)

        train._memwatch_auto = True  # type: ignore[attr-defined]
        trainer.train = train
        self.installed = True

    def check_installed(self) -> None:
        """Warn when training starts without a plan: the callback came too late to wrap ``train()``."""
        if not self.installed and self.plan is None:
            logger.warning(
                "hf-memwatch: MemWatch(auto=True) was added after the Trainer was built (add_callback), so it "
                "could not plan before training; pass it as Trainer(callbacks=[MemWatch(auto=True)])."
            )

    # -- before train -------------------------------------------------------------------------
    def before_train(self, trainer: Any, resume_from_checkpoint: Any = None) -> dict[str, Any]:
        """Decide, apply and record the plan. Raises :class:`PlanError` when nothing fits."""
        args = trainer.args
        if getattr(args, "auto_find_batch_size", False):
            logger.warning(
                "hf-memwatch: auto=True plans the batch before training, keeping the effective batch; "
                "the Trainer's auto_find_batch_size is turned off (it would shrink the effective batch after an OOM)."
            )
            args.auto_find_batch_size = False
        backend = backend_for(torch.device(args.device))
        self.budget = resolve_budget(self.budget_spec, backend)
        saved = self._saved_plan(trainer, resume_from_checkpoint)
        if saved is not None:
            plan = Plan(
                int(saved["micro_batch_size"]),
                int(saved["gradient_accumulation_steps"]),
                bool(saved["activation_checkpointing"]),
                str(saved["optim"]),
                predicted_peak=saved.get("predicted_peak"),
                reason="resumed from checkpoint: " + str(saved.get("reason", "")),
            )
        else:
            plan = self._decide_with_peers(trainer, backend, self.budget)
        apply_plan(trainer, plan)
        record = plan.record(self.budget.total)
        self.plan = record
        logger.warning("hf-memwatch plan: %s", plan.reason)
        self.record(record)
        return record

    def _saved_plan(self, trainer: Any, resume: Any) -> dict[str, Any] | None:
        """The plan recorded in a checkpoint's trainer_state.json (``MemWatch`` attributes)."""
        if resume is None or resume is False:
            return None
        if resume is True:
            from transformers.trainer_utils import get_last_checkpoint

            resume = get_last_checkpoint(trainer.args.output_dir)
            if resume is None:
                return None
        path = os.path.join(str(resume), "trainer_state.json")
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as fh:
            stateful = json.load(fh).get("stateful_callbacks", {})
        data = stateful.get("MemWatch")
        data = data[0] if isinstance(data, list) and data else data
        if not isinstance(data, dict):
            return None
        return data.get("attributes", {}).get("auto_plan")

    def _decide_with_peers(self, trainer: Any, backend: AllocatorBackend, budget: Budget) -> Plan:
        """:meth:`_decide`; in a distributed run a rank that fails tells the others, so none waits."""
        from ..measure.distributed import PeerFailure, share_failure

        try:
            return self._decide(trainer, backend, budget)
        except PeerFailure as exc:
            if exc.fatal:  # another rank's plan error stops every rank with its message
                raise PlanError(f"hf-memwatch: {exc}") from exc
            raise
        except Exception as exc:
            share_failure(exc, fatal=isinstance(exc, (PlanError, MemWatchConfigError)))
            raise

    def _decide(self, trainer: Any, backend: AllocatorBackend, budget: Budget) -> Plan:
        model = trainer.model
        given = current_plan(trainer)
        weights = sum(weight_storages(model, backend.device).values())
        if weights >= budget.usable:
            raise PlanError(
                f"hf-memwatch: the budget {budget.describe()} is below what the weights alone need "
                f"({format_bytes(weights)}): {format_bytes(weights - budget.usable)} missing. No remedy here "
                "(accumulation, activation checkpointing, 8-bit AdamW) reduces weight memory; raise the budget, "
                "use a smaller model, lower precision or sharding."
            )
        skipped: dict[str, str] = {}
        if not given.activation_checkpointing and (why := checkpointing_unavailable_reason(model)):
            skipped["activation checkpointing"] = why
        if why := eight_bit_unavailable_reason(trainer):
            skipped["8-bit AdamW"] = why
        skipped = agree_unavailable_remedies(skipped)
        ckpt_reason = skipped.get("activation checkpointing")
        eight_bit = None
        if "8-bit AdamW" not in skipped and "8bit" not in given.optim:
            eight_bit = eight_bit_optim_name(backend.device.type)
        started = time.perf_counter()
        effective = given.micro_batch_size * given.gradient_accumulation_steps
        probe = Probe(trainer, backend)
        gradients = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        result = ProbeResult(weights=weights, gradients=gradients, engine=expected_ddp_bucket_bytes(trainer))
        sizes = [size for size in PROBE_SIZES if size <= effective]
        with _PreservedState(model):
            _, result.seq_len = probe.samples(1)
            seq_len = result.seq_len or 1
            result.forward_backward[given.activation_checkpointing] = probe.forward_backward(
                sizes, given.activation_checkpointing, limit=budget.usable
            )
            for optim in {given.optim} | ({eight_bit} if eight_bit else set()):
                states, temporaries = probe.optimizer(optim)
                result.optimizer_states[optim] = states
                result.optimizer_temporaries[optim] = temporaries
            predictions = _Predictions(result.predict, _estimator_predictor(trainer, seq_len, backend.device.type))
            predictions.confirm(given)
            given.predicted_peak = predictions.predict(given)
            candidates = candidate_plans(given, allow_checkpointing=False, eight_bit=eight_bit, seq_len=seq_len)
            chosen = predictions.choose(given, candidates, budget.usable)
            if not ckpt_reason and not given.activation_checkpointing:
                with_checkpointing = candidate_plans(given, allow_checkpointing=True, eight_bit=eight_bit,
                                                     seq_len=seq_len)
                # Probe checkpointing only when a plan with it could beat the best one without it.
                if chosen is None or max(p.relative_throughput for p in with_checkpointing) > chosen.relative_throughput + THROUGHPUT_TIE:
                    result.forward_backward[True] = probe.forward_backward(sizes, True, limit=budget.usable)
                    candidates = with_checkpointing
                    chosen = predictions.choose(given, candidates, budget.usable)
        self.probe_seconds = time.perf_counter() - started
        if chosen is None:
            best = min(candidates, key=lambda p: p.predicted_peak or 0)
            raise PlanError(
                f"hf-memwatch: no plan fits the budget {budget.describe()}. The configuration as given is predicted "
                f"at {format_bytes(given.predicted_peak)}; the best plan ({best.describe()}) still needs "
                f"{format_bytes(best.predicted_peak)}."
                + (" Unavailable: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) if skipped else "")
            )
        if chosen.key() != given.key() or (given.predicted_peak or 0) > budget.usable:
            for name, why in skipped.items():
                logger.warning("hf-memwatch: remedy %s skipped: %s", name, why)
        chosen.reason = explain(chosen, given, budget, skipped if chosen.key() != given.key() else {})
        # The rank that must cut the most from the configured run decides (issue 7): its plan fits
        # every rank with a larger budget. A chosen plan's own peak would pick the laxest rank.
        chosen = agree(chosen, int(given.predicted_peak or 0) - budget.usable)
        return chosen

    # -- between steps ------------------------------------------------------------------------
    def after_step(self, trainer: Any, step_record: dict[str, Any] | None) -> dict[str, Any] | None:
        """Turn on activation checkpointing when a measured step peak approaches the budget."""
        if self.plan is None or not step_record or trainer is None:
            return None
        if self.budget is None:  # a callback the Trainer rebuilt from checkpoint state
            self.budget = resolve_budget(self.budget_spec, backend_for(torch.device(trainer.args.device)))
        peak = step_record.get("peak")
        if peak is None or self.plan.get("activation_checkpointing") or self._checkpointing_refused:
            return None
        if peak < CHECKPOINT_TRIGGER * self.budget.usable:
            return None
        why = checkpointing_unavailable_reason(trainer.model)
        if not why and _distributed():
            # Every rank must run the same plan, and agreeing here would be a collective per step
            # that a rank whose monitoring failed would never join: the agreed plan stays.
            why = "in a distributed run the ranks keep the plan agreed before training"
        if why:
            logger.warning("hf-memwatch: step peak %s is near the budget, but %s", format_bytes(peak), why)
            self._checkpointing_refused = True  # warn once
            return None
        enable_checkpointing_now(trainer.model)
        record = dict(
            self.plan,
            activation_checkpointing=True,
            reason=(
                f"step {step_record.get('step')} peaked at {format_bytes(peak)}, "
                f"{peak / self.budget.usable:.0%} of the budget {format_bytes(self.budget.usable)}: "
                "activation checkpointing turned on between steps"
            ),
        )
        self.plan = record
        logger.warning("hf-memwatch plan: %s", record["reason"])
        self.record(record)
        return record
