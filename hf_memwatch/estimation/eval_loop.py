"""The Trainer's evaluation loop (``evaluate()``/``predict()``), replayed on a fake model.

:func:`simulate_eval` mirrors ``Trainer.evaluation_loop`` / ``prediction_step`` /
``EvalLoopContainer`` (transformers 5.x) batch by batch, every tensor fake, the CPU tracker of
:mod:`hf_memwatch.estimation.fake_dispatch` counting storages:

* the eval dataloader is accelerate's ``DataLoaderShard``: the next batch is collated before the
  current one is handed out (two batches of inputs live);
* ``prediction_step``: ``num_items_in_batch`` (when the model takes loss kwargs), the model's
  no-grad forward in eval mode (autocast and the fp32 output conversion under mixed precision, the
  KV cache a causal LM builds with ``use_cache``), ``loss.detach().mean()``, the outputs but
  ``loss`` and ``config.keys_to_ignore_at_inference`` kept as logits;
* the containers: ``losses.repeat(batch_size)``, logits and labels each concatenated with
  ``nested_concat`` onto what is held (``torch.cat``: the old and the new tensor live together);
  every ``eval_accumulation_steps`` batches ``to_cpu_and_numpy``;
* ``get_arrays`` at the end (``nested_numpify``: bf16 becomes fp32 first).

What "moving to the CPU" frees depends on the device. On CUDA the device tensors are dropped. On the
CPU the device *is* the host: ``Tensor.numpy()`` is a view, so the first flushed chunk keeps its torch
storage alive, and from the second flush on ``np.concatenate`` copies everything into numpy's own
memory (not a torch allocation, so invisible to PyTorch's accounting and not counted here; it is
reported in ``notes``) and the torch storages die. Without ``eval_accumulation_steps`` everything
stays on the device until the end.

Only a few batches are replayed: the first two, the last two, the two before the second and the
last flush;
between them the containers are fast-forwarded to the sizes they would have (fresh tensors of the
same shapes: the same bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.categories import EVAL_ESTIMATE_CLASSES
from ..measure.attribution import weight_tensors
from .classify import classify, refs
from .generation import GenerationReplay, check_generation
from .replay import GENERATION, REPLAY_DEVICE, mode_of, model_in_mode, new_tracker, tracked
from .trainer_mirror import (
    accepts_loss_kwargs,
    loss_shifts_labels,
    make_batch,
)

EVAL_CLASSES = EVAL_ESTIMATE_CLASSES  # core's one list


@dataclass
class EvalSimulation:
    """The eval loop's predicted peak, the phase holding it and its split (summing to the peak)."""

    peak_bytes: int
    peak_phase: str
    classes: dict[str, int]
    host_bytes: int = 0  # numpy copies of the outputs on the host (not torch allocations)
    notes: list[str] = field(default_factory=list)


@dataclass
class _Container:
    """``EvalLoopContainer`` with concatenation on (the Trainer's default) and device-aware flushing."""

    cpu_target: bool
    tensors: Any = None
    torch_arrays: Any = None  # on a CPU target: the first flushed chunk, numpy views of torch storage
    host_bytes: int = 0
    flushes: int = 0

    def add(self, value: Any) -> None:
        from transformers.trainer_pt_utils import nested_concat

        self.tensors = value if self.tensors is None else nested_concat(self.tensors, value, padding_index=-100)

    def flush(self) -> None:
        """``to_cpu_and_numpy``: what leaves torch's accounting and what stays."""
        if self.tensors is None:
            return
        self.flushes += 1
        if self.cpu_target:
            converted = _map(self.tensors, lambda t: t.to(torch.float32) if t.dtype == torch.bfloat16 else t)
            if self.torch_arrays is None:
                self.torch_arrays = converted  # numpy views keep these storages
            else:  # np.concatenate copies into numpy memory; the torch storages die
                self.host_bytes = _nbytes(self.torch_arrays) + _nbytes(converted) + self.host_bytes
                self.torch_arrays = None
            del converted
        else:
            self.host_bytes += _nbytes(self.tensors)
        self.tensors = None

    def leaves(self) -> list[torch.Tensor]:
        return _leaves(self.tensors) + _leaves(self.torch_arrays)


def _by_ref(*held: dict[int, Any]) -> dict[int, Any]:
    """The tracker's references of ``held`` (each key -> ref, read at different moments) by their identity:
    a storage freed in between and the one made after it may share a key (an address), and each is an output
    while it lives (measured: the second batch's concatenation reused the first batch's predictions' address,
    and those 512,000 B were counted as temporaries at the loop's high, on a warm fake-tensor cache only)."""
    return {id(ref): ref for refs_at in held for ref in refs_at.values()}


def _map(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


def _leaves(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map(value, found.append)
    return found


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _leaves(value))


@dataclass(frozen=True)
class _Spec:
    """Shape past the first dimension and dtype of one accumulated tensor (per example)."""

    tail: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return math.prod(self.tail) * torch.empty((), dtype=self.dtype).element_size()


def _spec(value: Any) -> Any:
    """The per-example :class:`_Spec` of every tensor in ``value`` (same nesting)."""
    if isinstance(value, torch.Tensor):
        return _Spec(tuple(value.shape[1:]), value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_spec(v) for v in value)
    if isinstance(value, dict):
        return {k: _spec(v) for k, v in value.items()}
    return value


def _specs(value: Any) -> list[_Spec]:
    if isinstance(value, _Spec):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    return [s for v in items for s in _specs(v)]


def _resized(spec: Any, rows: int, fp32_for_bf16: bool = False) -> Any:
    """Fresh tensors for ``spec`` with ``rows`` on the first dimension (bf16 as fp32 when asked)."""
    if isinstance(spec, _Spec):
        dtype = torch.float32 if fp32_for_bf16 and spec.dtype == torch.bfloat16 else spec.dtype
        return torch.empty((rows, *spec.tail), dtype=dtype)
    if isinstance(spec, (list, tuple)):
        return type(spec)(_resized(v, rows, fp32_for_bf16) for v in spec)
    if isinstance(spec, dict):
        return {k: _resized(v, rows, fp32_for_bf16) for k, v in spec.items()}
    return spec


def replayed_batches(batches: int, accumulation_steps: int | None) -> list[int]:
    """Batch indices worth replaying: first two, last two, the two before the second and the last flush.

    Example:
        >>> replayed_batches(100, None), replayed_batches(100, 8)
        ([0, 1, 98, 99], [0, 1, 14, 15, 94, 95, 98, 99])
    """
    picked = {0, 1, batches - 2, batches - 1}
    if accumulation_steps:
        k = accumulation_steps
        last_flush = (batches // k) * k - 1  # index of the last flush batch
        # On the CPU the first flushed chunk stays torch memory until the second flush: the window
        # before the second flush holds it beside a full window of outputs.
        picked |= {last_flush - 1, last_flush, 2 * k - 2, 2 * k - 1}
    return sorted(i for i in picked if 0 <= i < batches)


@dataclass(frozen=True)
class EvalInputs:
    """What an eval replay reads beside the request.

    ``optimizer_state_bytes``: optimizer state live during the loop (an eval inside ``train()``).
    ``preprocess_argmax``: ``preprocess_logits_for_metrics`` returns ``logits.argmax(-1)``.
    ``use_cache``: ``TrainingArguments.use_cache`` (the Trainer sets ``config.use_cache`` from it,
    default False: no KV cache in the eval forward).
    """

    config: Any
    optimizer_state_bytes: int = 0
    preprocess_argmax: bool = False
    use_cache: bool = False


def simulate_eval(model: torch.nn.Module, fake_mode: Any, request: Any, inputs: EvalInputs) -> EvalSimulation:
    """Replay ``Trainer.evaluation_loop`` over ``request.eval_samples`` examples in batches of
    ``request.eval_batch_size``, at ``request.eval_len`` tokens (:class:`EvalInputs` for the rest).

    ``request.generation``: ``Seq2SeqTrainer`` with ``predict_with_generate`` (None: without); the replay's
    mode is then :data:`~hf_memwatch.estimation.replay.GENERATION` and the prediction step
    :func:`~hf_memwatch.estimation.generation.generation_prediction_step` (unless
    ``prediction_loss_only``, where the Trainer takes the plain step too: :func:`~.replay.mode_of`).
    """
    mode = mode_of(request)
    with model_in_mode(model, request, mode, use_cache=inputs.use_cache):
        replay = GenerationReplay(request.generation) if mode is GENERATION else None
        if replay is not None:
            check_generation(model, replay.settings, request.eval_len)
        run = _EvalRun(model, request, inputs, replay)
        with tracked(fake_mode, run.tracker):
            run.replay_loop()
    return run.simulation()


class _EvalRun:
    """One replayed loop's state: the tracker, the containers, the highest classified snapshot."""

    def __init__(self, model: torch.nn.Module, request: Any, inputs: EvalInputs, replay: Any) -> None:
        self.model, self.request, self.inputs, self.replay = model, request, inputs, replay
        self.device = REPLAY_DEVICE
        self.tracker = tracker = new_tracker(request)
        weights_of_model = weight_tensors(model)  # quantization state included
        tracker.register(weights_of_model)
        self.weights = refs(tracker, weights_of_model)
        batch_size, samples = request.eval_batch_size, request.eval_samples
        self.batches = batches = math.ceil(samples / batch_size)
        self.sizes = [batch_size] * (batches - 1) + [samples - (batches - 1) * batch_size]
        self.containers = {name: _Container(request.device == "cpu") for name in ("losses", "preds", "labels")}
        self.best: dict[str, Any] = {"bytes": -1}
        self.template: dict[str, Any] = {}
        # The previous batch's losses, logits and labels: locals of ``evaluation_loop`` that live
        # until the next prediction step's results replace them (deleted only at a flush).
        self.last_outputs: list[torch.Tensor] = []
        self.ignore = list(getattr(inputs.config, "keys_to_ignore_at_inference", ["past_key_values"]) or []) + [
            "loss"]
        self.takes_loss_kwargs, self.shifts = accepts_loss_kwargs(model), loss_shifts_labels(model)

    def close(self, phase: str, outputs: dict[int, Any], other: dict[int, Any]) -> None:
        """Classify the interval's highest snapshot; keep the loop's highest."""
        snapshot = self.tracker.snapshot
        if snapshot is not None:
            classes = classify(snapshot, {}, self.weights, set(), set(), other, outputs=outputs, names=EVAL_CLASSES)
            total = sum(classes.values())
            if total > self.best["bytes"]:
                self.best.update(bytes=total, phase=phase, classes=classes)
        self.tracker.reset_peak()

    def held(self) -> dict[int, Any]:
        """Refs of what the containers hold."""
        return refs(self.tracker, [t for c in self.containers.values() for t in c.leaves()])

    def make_batch(self, index: int) -> dict[str, torch.Tensor]:
        request = self.request
        return make_batch(self.inputs.config, request.task, self.sizes[index], request.eval_len,
                          request.eval_target_len, self.device)

    def replay_loop(self) -> None:
        """The replayed batches (the containers fast-forwarded between them), then ``get_arrays``."""
        batch_size, accumulation_steps = self.request.eval_batch_size, self.request.eval_accumulation_steps
        lookahead = self.make_batch(0)
        previous = -1
        for index in replayed_batches(self.batches, accumulation_steps):
            if index != previous + 1:
                lookahead = self.make_batch(index)
                _fast_forward(self.containers, self.template, index, batch_size, accumulation_steps)
                flushed = bool(accumulation_steps) and index % (accumulation_steps or 1) == 0
                self.last_outputs = [] if flushed else _leaves(
                    [_resized(self.template.get(name), batch_size) for name in ("losses", "preds", "labels")])
            previous = index
            inputs = lookahead
            lookahead = self.make_batch(index + 1) if index + 1 < self.batches else None
            self.one_batch(index, inputs, lookahead)
            del inputs
        last_refs = refs(self.tracker, self.last_outputs)
        outputs_before = self.held()
        for container in self.containers.values():  # get_arrays: the last batch's locals still live
            container.flush()
        self.close("eval_gather", _by_ref(outputs_before, self.held(), last_refs), {})

    def one_batch(self, index: int, inputs: dict[str, Any], lookahead: dict[str, Any] | None) -> None:
        """One prediction step and its accumulation (a flush where due)."""
        tracker, containers, request = self.tracker, self.containers, self.request
        other = refs(tracker, list(inputs.values()) + list((lookahead or {}).values()))
        last_refs = refs(tracker, self.last_outputs)
        tracker.reset_peak()
        if self.replay is not None:
            loss, logits, labels = self.replay.step(self.model, inputs, tracker)
        else:
            loss, logits, labels = _prediction_step(
                self.model, inputs, self.takes_loss_kwargs, self.shifts, self.ignore, request.prediction_loss_only,
                self.inputs.preprocess_argmax)
        self.last_outputs = []  # replaced by this step's results
        other.update(refs(tracker, _leaves(loss) + _leaves(logits)))
        self.close("eval_forward", _by_ref(last_refs, self.held()), other)
        outputs_before = self.held()
        losses = None if loss is None else loss.repeat(self.sizes[index])  # no labels: no loss
        if losses is not None:
            containers["losses"].add(losses)
        if logits is not None:
            containers["preds"].add(logits)
        if labels is not None:
            containers["labels"].add(labels)
        if not self.template:
            self.template.update(losses=_spec(losses), preds=_spec(logits), labels=_spec(labels))
        self.last_outputs = _leaves([losses, logits, labels])
        del losses, loss, logits, labels
        self.close("eval_accumulate", _by_ref(outputs_before, self.held(), refs(tracker, self.last_outputs)), other)
        steps = request.eval_accumulation_steps
        if steps and (index + 1) % steps == 0:
            for container in containers.values():
                container.flush()
            self.last_outputs = []  # the loop's ``del losses, logits, labels, inputs``
            self.close("eval_accumulate", _by_ref(self.held()), other)

    def simulation(self) -> EvalSimulation:
        """The loop's peak, split (the optimizer state beside it added), with its notes."""
        classes = dict(self.best["classes"])
        classes["optimizer_states"] = self.inputs.optimizer_state_bytes
        host = sum(c.host_bytes for c in self.containers.values())
        notes = []
        if self.replay is not None:
            notes.append("eval: predict_with_generate modelled as the worst case: every sequence generated to "
                         "generation_max_length (no early EOS), the KV cache of max_length x beams")
        if host:
            notes.append(f"eval: {host} bytes of outputs copied into numpy memory on the host "
                         "(not torch allocations)")
        return EvalSimulation(sum(classes.values()), self.best["phase"], classes, host, notes)


def _fast_forward(containers: dict[str, _Container], template: dict[str, Any], index: int, batch_size: int,
                  accumulation_steps: int | None) -> None:
    """Set the containers to what they hold before batch ``index`` (full batches before it)."""
    flushes = index // accumulation_steps if accumulation_steps else 0
    on_device = index - flushes * (accumulation_steps or 0)
    for name, container in containers.items():
        spec = template.get(name)
        if spec is None:
            continue
        container.tensors = _resized(spec, on_device * batch_size) if on_device else None
        container.torch_arrays = None
        container.flushes = flushes
        container.host_bytes = 0
        if not flushes:
            continue
        chunk = sum(s.row_bytes * (2 if s.dtype == torch.bfloat16 else 1) for s in _specs(spec))
        chunk *= (accumulation_steps or 0) * batch_size
        if container.cpu_target and flushes == 1:
            container.torch_arrays = _resized(spec, (accumulation_steps or 0) * batch_size, fp32_for_bf16=True)
        elif container.cpu_target:
            container.host_bytes = flushes * chunk
        else:
            container.host_bytes = flushes * chunk


def _prediction_step(model: torch.nn.Module, inputs: dict[str, torch.Tensor], takes_loss_kwargs: bool,
                     shifts: bool, ignore: list[str], loss_only: bool, argmax: bool) -> tuple[Any, Any, Any]:
    """``Trainer.prediction_step`` with labels: (loss, logits or None, labels or None)."""
    labels = inputs["labels"].detach()
    kwargs = dict(inputs)
    with torch.no_grad():
        if takes_loss_kwargs:
            counted = inputs["labels"][..., 1:] if shifts else inputs["labels"]
            kwargs["num_items_in_batch"] = counted.ne(-100).sum()
        outputs = model(**kwargs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        loss = loss.detach().mean()
        if isinstance(outputs, dict):
            logits: Any = tuple(v for k, v in outputs.items() if k not in ignore)
        else:
            logits = outputs[1:]
    if loss_only:
        return loss, None, None
    logits = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in logits)
    logits = logits[0] if len(logits) == 1 else logits
    del outputs, kwargs
    if argmax:  # preprocess_logits_for_metrics = lambda logits, labels: logits.argmax(-1)
        logits = _map(logits, lambda t: t.argmax(-1))
    return loss, logits, labels
