"""Planning the evaluation loop: ``per_device_eval_batch_size`` and ``eval_accumulation_steps``.

An evaluation loop keeps every batch's outputs (logits, labels) until ``eval_accumulation_steps``
moves them off the device; users raise the eval batch because "there is no backward". The loop's
peak is predicted by :func:`hf_memwatch.estimation.estimate.estimate_eval` (passed in as
``predict``) and the choice follows the training chooser's rules: the configuration as given when
it fits, else the fastest that fits — a larger eval batch is faster (same efficiency model as
training, :data:`~hf_memwatch.planning.chooser.T_HALF`), moving outputs off the device costs a
little. On the CPU the device is the host: moving outputs "off" it saves nothing, so only the eval
batch is planned there.

Where even an eval batch of 1 does not fit because the accumulated outputs alone exceed the limit,
no setting of the Trainer helps: :func:`plan_eval` raises :class:`PlanError` naming
``preprocess_logits_for_metrics`` (e.g. ``logits.argmax(-1)``) and the bytes it would save.

Example (a made-up loop: 100 bytes + 10 a sample in the batch + 1000 of outputs kept):
    >>> from hf_memwatch.core.run_config import RunConfig
    >>> run = RunConfig(8, eval_batch_size=64, seq_len=128)
    >>> plan = plan_eval(run, lambda batch, steps, argmax=False: 100 + 10 * batch + 1000, budget=1500)
    >>> plan.eval_batch_size, plan.eval_predicted_peak
    (32, 1420)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..core.errors import PlanError
from ..core.run_config import RunConfig
from ..core.units import format_bytes
from .chooser import T_HALF

# Moving outputs to the host every few batches costs a device-to-host copy: a little throughput.
EVAL_ACCUMULATION_COST = 1.05
EVAL_ACCUMULATION_OPTIONS = (1,)  # eval_accumulation_steps tried when outputs must leave the device


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


def eval_candidates(run: RunConfig) -> list[tuple[int, int | None]]:
    """(eval batch, eval accumulation) options: the configured batch halved down to 1; on an
    accelerator also with outputs moved off the device every batch."""
    given = int(run.eval_batch_size or 8)
    batches = sorted({max(1, given >> shift) for shift in range(given.bit_length())}, reverse=True)
    steps: list[int | None] = [run.eval_accumulation_steps]
    if run.device != "cpu" and run.eval_accumulation_steps is None:
        steps.extend(EVAL_ACCUMULATION_OPTIONS)
    return [(batch, step) for batch in batches for step in steps]


def plan_eval(run: RunConfig, predict: Callable[..., int], budget: int) -> EvalPlan:
    """The eval configuration of ``run`` under ``budget``; ``predict(batch, accumulation, argmax=False)``
    gives a loop's peak. Raises :class:`PlanError` when only a change of the metrics code would fit."""
    given_batch, given_steps = int(run.eval_batch_size or 8), run.eval_accumulation_steps
    given_peak = predict(given_batch, given_steps)
    if given_peak <= budget:
        return EvalPlan(given_batch, given_steps, given_peak,
                        f"eval as given fits: predicted peak {format_bytes(given_peak)} <= {format_bytes(budget)}")
    fitting = []
    for batch, steps in sorted(eval_candidates(run), key=lambda c: -eval_throughput(c[0], c[1], run)):
        if (batch, steps) == (given_batch, given_steps):
            continue
        peak = predict(batch, steps)
        if peak <= budget:
            fitting.append((batch, steps, peak))
            break  # candidates come fastest first
    if fitting:
        batch, steps, peak = fitting[0]
        return EvalPlan(batch, steps, peak, (
            f"eval as given is predicted to peak at {format_bytes(given_peak)}, over the budget {format_bytes(budget)}; "
            f"eval batch {given_batch} -> {batch}" + (f", eval_accumulation_steps {steps}" if steps != given_steps else "")
            + f": predicted peak {format_bytes(peak)}"))
    smallest = min(eval_candidates(run))
    argmax_peak = predict(given_batch, given_steps, argmax=True)
    raise PlanError(
        f"hf-memwatch: evaluation cannot fit the budget {format_bytes(budget)} with any eval batch: even at eval batch "
        f"{smallest[0]} the loop keeps every batch's logits (predicted {format_bytes(predict(*smallest))}). Reduce "
        "them in preprocess_logits_for_metrics (e.g. return logits.argmax(-1)): predicted peak "
        f"{format_bytes(argmax_peak)} at eval batch {given_batch}, {format_bytes(given_peak - argmax_peak)} saved; "
        "or set prediction_loss_only=True if no metric needs them. Nothing was changed."
    )
