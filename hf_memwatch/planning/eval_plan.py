"""Planning the evaluation loop: ``per_device_eval_batch_size`` and ``eval_accumulation_steps``.

An evaluation loop keeps every batch's outputs (logits, labels) until ``eval_accumulation_steps``
moves them off the device; users raise the eval batch because "there is no backward". The loop's
peak is predicted by :func:`hf_memwatch.estimation.estimate.estimate_eval` (passed in as
``predict``, of an :class:`~hf_memwatch.planning.plan.EvalSetting`; :func:`eval_request` is the
request a setting makes) and the choice follows the training chooser's rules: the configuration as
given when it fits, else the fastest that fits — a larger eval batch is faster (same efficiency
model as training, :data:`~hf_memwatch.planning.chooser.T_HALF`), moving outputs off the device
costs a little. The candidates are those the catalogue's applied eval remedies allow
(:data:`~hf_memwatch.planning.catalogue.EVAL_REMEDIES`): on the CPU the device is the host, moving
outputs "off" it saves nothing, so only the eval batch is planned there.

Where even an eval batch of 1 does not fit because the accumulated outputs alone exceed the limit,
no setting of the Trainer helps: :func:`plan_eval` raises :class:`PlanError` naming
``preprocess_logits_for_metrics`` (e.g. ``logits.argmax(-1)``) and the bytes it would save.

Example (a made-up loop: 100 bytes + 10 a sample in the batch + 1000 of outputs kept):
    >>> from hf_memwatch.core.run_config import RunConfig
    >>> run = RunConfig(8, eval_batch_size=64, seq_len=128)
    >>> plan = plan_eval(run, lambda setting: 100 + 10 * setting.eval_batch_size + 1000, budget=1500)
    >>> plan.eval_batch_size, plan.eval_predicted_peak
    (32, 1420)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.errors import PlanError
from ..core.run_config import RunConfig
from ..core.units import format_bytes
from .catalogue import EVAL_ARGMAX, EVAL_REMEDIES
from .chooser import T_HALF
from .plan import EvalSetting

# Moving outputs to the host every few batches costs a device-to-host copy: a little throughput.
EVAL_ACCUMULATION_COST = 1.05


@dataclass
class EvalPlan:
    """The evaluation configuration planned, with its predicted peak and a reason."""

    eval_batch_size: int
    eval_accumulation_steps: int | None
    eval_predicted_peak: int
    reason: str

    def record_fields(self) -> dict[str, object]:
        """The fields the ``plan`` record gains."""
        return {"eval_batch_size": self.eval_batch_size, "eval_accumulation_steps": self.eval_accumulation_steps,
                "eval_predicted_peak": int(self.eval_predicted_peak), "eval_reason": self.reason}


def eval_throughput(batch: int, accumulation: int | None, run: RunConfig) -> float:
    """Relative samples per second of an eval configuration (larger batches use the hardware better)."""
    tokens = batch * (run.seq_len or 512)
    speed = tokens / (tokens + T_HALF)
    return speed / (EVAL_ACCUMULATION_COST if accumulation else 1.0)


def eval_candidates(run: RunConfig, given: EvalSetting | None = None) -> list[EvalSetting]:
    """The settings the catalogue's applied eval remedies allow (the product of their options, the
    eval batch outermost); advice (the metrics code's reduction, loss only) stays ``given``'s.

    Example:
        >>> [(s.eval_batch_size, s.eval_accumulation_steps) for s in eval_candidates(RunConfig(4, eval_batch_size=2, device="cuda"))]
        [(2, None), (2, 1), (1, None), (1, 1)]
    """
    given = given or EvalSetting.of(run)
    applied = [remedy for remedy in EVAL_REMEDIES if remedy.applied]
    fields = [remedy.field for remedy in applied]
    return [given.replace(**dict(zip(fields, values, strict=True)))
            for values in itertools.product(*(remedy.options(run) for remedy in applied))]


def eval_request(run: RunConfig, setting: EvalSetting, *, eval_samples: int, **loop: Any) -> Any:
    """The :class:`~hf_memwatch.estimation.request.EvalRequest` of ``run``'s loop in ``setting``
    (``loop``: the request's other fields, e.g. ``optimizer_state_bytes``)."""
    from ..estimation.request import EvalRequest

    return EvalRequest.of(run, eval_samples=eval_samples, eval_batch_size=setting.eval_batch_size,
                          eval_accumulation_steps=setting.eval_accumulation_steps,
                          preprocess_argmax=setting.preprocess_argmax,
                          prediction_loss_only=setting.prediction_loss_only, **loop)


def plan_eval(run: RunConfig, predict: Callable[[EvalSetting], int], budget: int,
              given: EvalSetting | None = None) -> EvalPlan:
    """The eval configuration of ``run`` under ``budget``; ``predict(setting)`` gives a loop's peak;
    ``given``: the loop as configured (default :meth:`EvalSetting.of`). Raises :class:`PlanError`
    when only a change of the metrics code would fit."""
    given = given or EvalSetting.of(run)
    given_batch, given_steps = given.eval_batch_size, given.eval_accumulation_steps
    given_peak = predict(given)
    if given_peak <= budget:
        return EvalPlan(given_batch, given_steps, given_peak,
                        f"eval as given fits: predicted peak {format_bytes(given_peak)} <= {format_bytes(budget)}")
    fitting = []
    options = eval_candidates(run, given)
    for setting in sorted(options, key=lambda c: -eval_throughput(c.eval_batch_size, c.eval_accumulation_steps, run)):
        if setting == given:
            continue
        peak = predict(setting)
        if peak <= budget:
            fitting.append((setting.eval_batch_size, setting.eval_accumulation_steps, peak))
            break  # candidates come fastest first
    if fitting:
        batch, steps, peak = fitting[0]
        return EvalPlan(batch, steps, peak, (
            f"eval as given is predicted to peak at {format_bytes(given_peak)}, over the budget {format_bytes(budget)}; "
            f"eval batch {given_batch} -> {batch}" + (f", eval_accumulation_steps {steps}" if steps != given_steps else "")
            + f": predicted peak {format_bytes(peak)}"))
    smallest = min(options, key=lambda s: (s.eval_batch_size, s.eval_accumulation_steps or 0))
    argmax_peak = predict(given.replace(**{EVAL_ARGMAX.field: True}))
    raise PlanError(
        f"hf-memwatch: evaluation cannot fit the budget {format_bytes(budget)} with any eval batch: even at eval batch "
        f"{smallest.eval_batch_size} the loop keeps every batch's logits (predicted {format_bytes(predict(smallest))}). "
        "Reduce "
        "them in preprocess_logits_for_metrics (e.g. return logits.argmax(-1)): predicted peak "
        f"{format_bytes(argmax_peak)} at eval batch {given_batch}, {format_bytes(given_peak - argmax_peak)} saved; "
        "or set prediction_loss_only=True if no metric needs them. Nothing was changed."
    )
