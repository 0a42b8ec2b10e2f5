"""What to try when no plan fits (issue #37, point 5): the one message of a "no plan fits" stop.

A stop names, line by line:

* the configuration as given and the **smallest plan** — every remedy the catalogue allows turned to
  its least-memory value (the smallest micro-batch, checkpointing on, each optimizer option), each
  predicted exactly (the chooser may have ruled it out by a floor alone, so its figure was not in hand);
* what that plan holds at its peak (the estimator's split);
* the **remedies unavailable and why** (the catalogue's rules, e.g. KTO's micro-batch fixed at
  ``__init__``; a fused/chunked loss already on; the engine's);
* the **advice** that changes what is trained or computed, each with its figure. Where the estimator
  can replay the change, the figure is the re-estimated peak of the smallest plan with it applied
  (margin included, what the plan compares with the budget): a shorter ``max_length`` — the longest
  length at which the smallest plan fits, found by bisection on estimates
  (:func:`length_advice`) —, LoRA (:func:`lora_advice`) and a higher ZeRO stage or optimizer offload
  (:func:`engine_advice`, the changes :func:`~hf_memwatch.engines.registry.engine_changes` lists). Where it cannot (Liger's
  Triton kernels on a CPU machine, a dropped reference model, an engine change the replay cannot make for
  this run), the saving is read from the predicted split at the peak and says "up to".

The sequence length of a Trainer's run is its collated worst batch: a shorter ``max_length`` is
replayed by cutting that batch's ``[batch, sequence]`` tensors to the length (:class:`Truncating`),
the shapes TRL's and the tokenizer's truncation give (which tokens are kept does not change a shape).
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.units import format_bytes
from .chooser import PlanResult
from .plan import Plan

#: Estimates the length search may make (a bisection over the tokens, guided by the two nearest figures).
LENGTH_TRIES = 8
#: Lines of the message are wrapped at this width (the error is read in a terminal).
WIDTH = 100


@dataclass(frozen=True)
class Tried:
    """One piece of advice for a run no plan fits: ``peak``, the predicted peak with it applied (margin
    included; None where the estimator cannot replay it, ``saving`` then read from the split at the peak)."""

    name: str
    saving: int
    how: str
    peak: int | None = None

    def line(self, limit: int) -> str:
        if self.peak is None:
            return f"{self.name}: saves up to {format_bytes(self.saving)} ({self.how})"
        verdict = "fits" if self.peak <= limit else f"still {format_bytes(self.peak - limit)} over"
        return (f"{self.name}: predicted {format_bytes(self.peak)}, {verdict} "
                f"(saves {format_bytes(self.saving)}; {self.how})")


class Truncating:
    """A collator that cuts every ``[batch, sequence]`` tensor of its batches to ``length`` tokens: a
    Trainer's batches under a shorter ``max_length``. Other values (scalars, images, lists) pass unchanged."""

    def __init__(self, collator: Callable[[list[Any]], Any], length: int) -> None:
        self.collator, self.length = collator, length

    def __call__(self, items: list[Any]) -> Any:
        batch = self.collator(items)
        if not isinstance(batch, Mapping):
            return batch
        return {key: value[:, :self.length] if getattr(value, "ndim", 0) == 2 else value for key, value in batch.items()}

    def __getattr__(self, name: str) -> Any:  # padding_free, tokenizer, ...: the wrapped collator's
        return getattr(self.__dict__["collator"], name)


def _estimate(predictor: Any, plan: Plan, *, length: int | None = None, **options: Any) -> Any:
    """The estimate of ``plan`` by ``predictor``'s estimator, at ``length`` tokens where given (a Trainer:
    its batches cut by :class:`Truncating`; a model or config: ``seq_len``)."""
    from ..estimation.trainer_replay import is_trainer

    subject = predictor.subject
    if length is None:
        return predictor._estimate(plan, **options)
    if not is_trainer(subject):
        return predictor._estimate(plan, seq_len=length, **options)
    collator = subject.data_collator
    subject.data_collator = Truncating(collator, length)
    try:
        return predictor._estimate(plan, **options)
    finally:
        subject.data_collator = collator


def smallest_plan(result: PlanResult, predictor: Any) -> Plan:
    """The candidate that needs the least memory, predicted exactly: the smallest micro-batch the
    catalogue allows, checkpointing on where it may be, and each optimizer option of that line."""
    plans = result.candidates
    micro = min(p.micro_batch_size for p in plans)
    checkpointing = any(p.activation_checkpointing for p in plans if p.micro_batch_size == micro)
    line = [p for p in plans if p.micro_batch_size == micro and p.activation_checkpointing == checkpointing]
    for plan in line:
        plan.predicted_peak = predictor.peak(plan)
    # checkpointing a short sequence can cost more than it saves: the least of every figure in hand
    return min((p for p in plans if p.predicted_peak is not None), key=lambda p: int(p.predicted_peak or 0))


def length_advice(predictor: Any, plan: Plan, length: int, limit: int) -> Tried | None:
    """The longest sequence (below ``length``, the run's) at which ``plan`` fits ``limit``, found by
    bisection on estimates (at most :data:`LENGTH_TRIES`; the answer's figure is an estimate, never a
    guess). None when even one token does not fit or the length does not change the peak."""
    if length <= 1:
        return None
    figures: dict[int, int] = {length: int(plan.predicted_peak or predictor.peak(plan))}
    low, high = 0, length  # high: over the limit; low: fits (0: none known)
    for _ in range(LENGTH_TRIES):
        if high - low <= 1:
            break
        guess = _guess(figures, low, high, limit)
        figures[guess] = predictor._with_margin(_estimate(predictor, plan, length=guess).peak_bytes)
        low, high = (guess, high) if figures[guess] <= limit else (low, guess)
    if low == 0:
        return None
    saving = figures[length] - figures[low]
    return Tried(f"max_length={low} (the longest batch is {length} tokens now)", saving,
                 "re-estimated at that length", figures[low])


def _guess(figures: dict[int, int], low: int, high: int, limit: int) -> int:
    """The next length to estimate, strictly between ``low`` and ``high``: where the line through the two
    figures nearest to ``high`` meets ``limit`` (the peak grows about linearly with the tokens), else the middle."""
    near = sorted(figures, key=lambda n: abs(n - high))[:2]
    if len(near) == 2 and (slope := (figures[near[0]] - figures[near[1]]) / (near[0] - near[1])) > 0:
        target = near[0] + (limit - figures[near[0]]) / slope
        guess = int(math.floor(target))
        if low < guess < high:
            return guess
    return (low + high) // 2


def lora_advice(predictor: Any, plan: Plan, estimate: Any) -> Tried | None:
    """LoRA (PEFT's default targets for the architecture, r=8) on ``plan``, re-estimated. Where the
    estimator cannot replay it (an optimizer instance handed to the Trainer holds the base's parameters),
    the full model's gradients and optimizer states at ``estimate``'s peak, "up to". None where the run
    trains a PEFT model already or peft is missing."""
    from ..core.extras import installed

    if predictor.run.peft_model or not installed("peft"):
        return None
    from ..estimation.peft import LoraSpec

    try:
        peak = predictor._with_margin(_estimate(predictor, plan, lora=LoraSpec()).peak_bytes)
    except Exception:  # noqa: BLE001 - the split's figure instead
        held = int(estimate.classes.get("gradients", 0) + estimate.classes.get("optimizer_states", 0))
        return Tried("LoRA (peft_config=LoraConfig(r=8))", held, "the full model's gradients and optimizer "
                     "states at the peak; not replayed: a new optimizer is needed") if held > 0 else None
    saving = int(plan.predicted_peak or 0) - peak
    if saving <= 0:
        return None
    return Tried("LoRA (peft_config=LoraConfig(r=8))", saving, "re-estimated with the adapters",
                 peak)


def engine_advice(predictor: Any, plan: Plan) -> tuple[list[Tried], tuple[str, ...]]:
    """A higher ZeRO stage, optimizer offload (:func:`~hf_memwatch.engines.alternatives.engine_changes`) on
    ``plan``, each re-estimated with the engine it gives; only those that save something (a change the
    estimator cannot replay for this run is left to the split's "up to" line), and the engine's "not
    predicted" reasons they answer."""
    from ..engines.registry import engine_changes

    found, answered = [], []
    for change in engine_changes(predictor.run):
        try:
            peak = predictor._with_margin(_estimate(predictor, plan, **change.options).peak_bytes)
        except Exception:  # noqa: BLE001 - not replayed: the catalogue's figure read from the split stays
            continue
        answered += [change.answers] if change.answers else []
        saving = int(plan.predicted_peak or 0) - peak
        if saving > 0:
            found.append(Tried(change.name, saving, change.how, peak))
    return found, tuple(answered)


def fused_head_of(subject: Any) -> str | None:
    """The trainer whose model computes its loss's log-probs in chunks already (TRL's ``add_fused_lm_head``,
    trl/trainer/utils.py: the model's ``forward`` replaced by one taking ``fused_lm_head``), or None."""
    model = getattr(subject, "model", None)
    code = getattr(getattr(getattr(model, "forward", None), "__func__", None), "__code__", None)
    if code is None or "fused_lm_head" not in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
        return None
    return type(subject).__name__


#: Peak tensors listed to find those shaped like the logits (their gradients at a backward peak).
LOGIT_TENSORS_LISTED = 64


def logit_shaped_bytes(predictor: Any, plan: Plan) -> int:
    """Bytes of the tensors alive at ``plan``'s predicted peak whose last dimension is the vocabulary (the
    logits, their upcast and, at a backward peak, their gradients — what a fused or chunked loss never
    holds whole), from the estimator's peak tensors. 0 where the vocabulary is not known."""
    model = getattr(predictor.subject, "model", predictor.subject)
    config = getattr(model, "config", model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 1:
        return 0
    tensors = _estimate(predictor, plan, top_tensors=LOGIT_TENSORS_LISTED).peak_tensors
    return sum(t.bytes for t in (tensors.tensors if tensors is not None else ())
               if t.shape and t.shape[-1] == vocab and t.cls in ("temporaries", "activations"))


def split_advice(predictor: Any, plan: Plan, estimate: Any, fused: str | None) -> list[Tried]:
    """Advice whose saving is read from ``estimate`` (of ``plan``) at its peak, the estimator not replaying
    the change here: a fused/chunked loss (the logit-shaped tensors at the peak; Liger only on a CUDA
    target), a preference trainer's reference model (its resident bytes), the engine's stage or offload."""
    from ..estimation.estimate import logits_bytes
    from .catalogue import advice

    logits = 0 if fused else max(logits_bytes(estimate), logit_shaped_bytes(predictor, plan))
    found = advice(predictor.run, estimate.frozen_models, logits, int(estimate.peak_bytes),
                   classes=estimate.classes, peak_phase=estimate.peak_phase)
    return [Tried(item.name, int(item.saving), "read from the estimate at the peak") for item in found]


def unavailable(result: PlanResult, run: Any, estimate: Any, fused: str | None,
                answered: tuple[str, ...] = ()) -> dict[str, str]:
    """Remedy -> why it is not available: the catalogue's, a loss computed in chunks already, the engine's
    (less those a re-estimate answered: ``answered``, their starts)."""
    from ..engines.registry import engine_advice, no_fit_reasons

    found = dict(result.unavailable)
    if fused:
        found["fused/chunked loss"] = (f"{fused} computes the loss's log-probs in chunks already (TRL's fused "
                                       "LM head); its tile grows with the tokens of a micro-batch")
    reasons = None if engine_advice(run, estimate.classes, int(estimate.peak_bytes), estimate.peak_phase) \
        else no_fit_reasons(run, estimate.peak_phase)
    reasons = [why for why in reasons or () if not any(why.startswith(answer) for answer in answered)]
    if reasons:
        found["engine"] = "; ".join(reasons)
    return found


def no_fit_report(result: PlanResult, predictor: Any, limit: int, budget_text: str) -> tuple[str, int]:
    """(the message of a run no plan fits, the least predicted peak): see the module docstring."""
    run = predictor.run
    best = smallest_plan(result, predictor)
    estimate = predictor.estimate(best)
    fused = fused_head_of(predictor.subject)
    tried = [item for item in (length_advice(predictor, best, int(estimate.config.get("seq_len") or 0), limit),
                               lora_advice(predictor, best, estimate)) if item is not None]
    engines, answered = engine_advice(predictor, best)
    tried += engines
    tried += [item for item in split_advice(predictor, best, estimate, fused)
              if item.name not in {done.name for done in tried}]  # re-estimated above: not "up to" again
    held = ", ".join(f"{name.replace('_', ' ')} {format_bytes(value)}"
                     for name, value in estimate.classes.items() if value > 0)
    phase = {"after_forward": "the forward", "after_backward": "the backward",
             "after_optimizer": "the optimizer step"}.get(estimate.peak_phase, estimate.peak_phase)
    lines = [f"hf-memwatch: no plan fits the budget {budget_text}.",
             f"as given: predicted {format_bytes(result.given.predicted_peak)}",
             f"smallest plan ({best.describe()})",
             f"at its peak ({phase}): {held}"]
    gone = unavailable(result, run, estimate, fused, answered)
    if gone:
        lines.append("unavailable:")
        lines += [f"- {name}: {why}" for name, why in gone.items()]
    if tried:
        lines.append("advice (changes what is trained or computed; not applied):")
        lines += [f"- {item.line(limit)}" for item in tried]
    else:
        lines.append("no advice applies: raise the budget, or use a smaller model or shorter sequences")
    text = "\n".join(_wrap(line) for line in lines)
    return text, int(best.predicted_peak or 0)


def _wrap(line: str) -> str:
    """``line`` wrapped at :data:`WIDTH`, a figure never split from its unit (``12.5 MiB``)."""
    kept = re.sub(r"(\d) ([KMGT]?i?B\b)", "\\1\0\\2", line)
    return textwrap.fill(kept, WIDTH, subsequent_indent="    ", break_on_hyphens=False).replace("\0", " ")
