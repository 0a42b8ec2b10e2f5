"""The one chooser: which plan of a run fits the limit, fastest, with the fewest changes.

:func:`plan_run` is the planning core every caller uses — the auto mode, ``hf-memwatch estimate
--budget``, the planner API and the OOM post-mortem:

1. :func:`candidates` crosses the options of every remedy of the catalogue
   (:data:`~hf_memwatch.planning.catalogue.REMEDIES`) that applies to the run; micro-batches are
   divisors of the per-device effective batch, so it is kept *exactly*;
2. a :class:`Predictor` gives the peak of the plans the choice needs — for each line of plans
   (one checkpointing setting and optimizer) the largest micro-batch under the limit, by
   bisection (the peak grows with the micro-batch), lines that cannot beat the plan in hand
   skipped;
3. :func:`pick` keeps the plans under the limit and takes the fastest by the cost model of
   :func:`relative_throughput`, ties going to the fewest changes.

Cost model (samples per second relative to the run as configured):

- a micro-step of ``t = micro * seq_len`` tokens runs at efficiency ``t / (t + T_HALF)`` (small
  micro-batches use the hardware worse);
- activation checkpointing recomputes the forward during backward: x 1 / 1.33;
- 8-bit AdamW: free.

Example (a made-up predictor: 100 bytes of weights + 10 a sample, checkpointing halves the rest):
    >>> from hf_memwatch.core.run_config import RunConfig
    >>> class Toy:
    ...     calls = 0
    ...     def peak(self, plan):
    ...         return 100 + plan.micro_batch_size * (5 if plan.activation_checkpointing else 10)
    >>> result = plan_run(RunConfig(micro_batch_size=8, seq_len=4096), Toy(), budget=150)
    >>> result.chosen.describe()
    'micro-batch 4 x accumulation 2, no checkpointing, optim adamw_torch, predicted peak 140 B'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..core.run_config import RunConfig
from ..core.units import format_bytes
from .catalogue import REMEDIES, unavailable_remedies
from .plan import Plan

T_HALF = 2048  # tokens per micro-batch at which the hardware runs at half its best efficiency
CHECKPOINTING_COST = 1.33  # one extra forward ~ a third of forward + backward
# A plan that changes a configuration which already fits must fit with this much to spare.
UPGRADE_HEADROOM = 0.85
# Plans whose predicted throughputs differ by less than this tie; the fewest changes win.
THROUGHPUT_TIE = 0.02


class Predictor(Protocol):
    """Predicts the step peak (bytes, per device) of one plan exactly; ``calls`` counts predictions."""

    calls: int

    def peak(self, plan: Plan) -> int: ...


def relative_throughput(plan: Plan, run: RunConfig) -> float:
    """Predicted samples per second of ``plan`` relative to ``run`` as configured.

    Example:
        >>> run = RunConfig(micro_batch_size=8, seq_len=256)
        >>> round(relative_throughput(Plan(4, 2, False, "adamw_torch"), run), 3)
        0.667
    """
    seq_len = run.seq_len or 512

    def speed(micro: int, checkpointing: bool) -> float:
        tokens = micro * seq_len
        return tokens / (tokens + T_HALF) / (CHECKPOINTING_COST if checkpointing else 1.0)

    return speed(plan.micro_batch_size, plan.activation_checkpointing) / speed(run.micro_batch_size, run.checkpointing)


def candidates(run: RunConfig, *, larger_micro_batches: bool = True) -> list[Plan]:
    """Every plan the catalogue allows for ``run`` (the run as configured first)."""
    options = {remedy.field: remedy.options(run) for remedy in REMEDIES}
    plans = [Plan.of(run)]
    for micro in options["micro_batch_size"]:
        if micro > run.micro_batch_size and not larger_micro_batches:
            continue
        for checkpointing in options["activation_checkpointing"]:
            for optim in options["optim"]:
                plan = Plan(micro, run.effective_batch // micro, checkpointing, optim)
                if plan.key() != plans[0].key():
                    plans.append(plan)
    for plan in plans:
        plan.relative_throughput = relative_throughput(plan, run)
    return plans


def pick(given: Plan, plans: list[Plan], budget: int) -> Plan | None:
    """The fastest plan under ``budget``; ``given`` when it fits and nothing clearly faster does.

    A plan faster than an already fitting ``given`` must fit with :data:`UPGRADE_HEADROOM` to spare.
    """
    given_fits = given.predicted_peak is not None and given.predicted_peak <= budget
    fitting = [p for p in plans if p.predicted_peak is not None and p.predicted_peak <= budget]
    if given_fits:
        fitting = [p for p in fitting if p.key() == given.key() or p.predicted_peak <= budget * UPGRADE_HEADROOM]
    if not fitting:
        return None

    def changes(plan: Plan) -> int:
        return sum(a != b for a, b in zip(plan.key(), given.key(), strict=True))

    best = max(p.relative_throughput for p in fitting)
    close = [p for p in fitting if p.relative_throughput >= best - THROUGHPUT_TIE]
    return max(close, key=lambda p: (-changes(p), p.relative_throughput))


@dataclass
class PlanResult:
    """The chosen plan (None when nothing fits), the run as configured, and every candidate."""

    chosen: Plan | None
    given: Plan
    candidates: list[Plan]
    budget: int
    unavailable: dict[str, str] = field(default_factory=dict)
    predictions: int = 0

    def best_effort(self) -> Plan:
        """The candidate with the lowest predicted peak (what comes closest when nothing fits)."""
        return min(self.candidates, key=lambda p: p.predicted_peak if p.predicted_peak is not None else 1 << 62)


class _Exact:
    """The predictor's figures, one call per plan."""

    def __init__(self, predictor: Predictor) -> None:
        self.predictor = predictor
        self.peaks: dict[tuple, int] = {}

    def __call__(self, plan: Plan) -> int:
        if plan.key() not in self.peaks:
            self.peaks[plan.key()] = int(self.predictor.peak(plan))
        plan.predicted_peak, plan.verified = self.peaks[plan.key()], True
        return plan.predicted_peak


def _largest_fitting(line: list[Plan], peak: _Exact, limit: float) -> Plan | None:
    """The plan with the largest micro-batch of ``line`` (sorted by micro-batch) under ``limit``.

    Along a line (same checkpointing and optimizer) the peak grows with the micro-batch, so a
    bisection finds it with about log2(len(line)) predictions, the largest tried first.
    """
    if peak(line[-1]) <= limit:
        return line[-1]
    low, high = -1, len(line) - 1  # line[high] is over the limit; line[low] fits (-1: none known)
    while high - low > 1:
        middle = (low + high) // 2
        if peak(line[middle]) <= limit:
            low = middle
        else:
            high = middle
    return line[low] if low >= 0 else None


def plan_run(run: RunConfig, predictor: Predictor, budget: int, *, larger_micro_batches: bool = True) -> PlanResult:
    """Choose the plan of ``run`` for ``budget`` (bytes per device) — see the module docstring.

    Each line of plans (one checkpointing setting and optimizer, every micro-batch) contributes
    its largest micro-batch that fits, found by bisection on exact predictions; lines that cannot
    beat the plan already in hand are not predicted at all. Every figure the choice rests on is
    exact (``verified``).
    """
    peak = _Exact(predictor)
    given = Plan.of(run)
    given.relative_throughput = 1.0
    given_fits = peak(given) <= budget
    limit = budget * UPGRADE_HEADROOM if given_fits else budget
    plans = candidates(run, larger_micro_batches=larger_micro_batches)
    plans[0] = given
    lines: dict[tuple[bool, str], list[Plan]] = {}
    for plan in plans:
        lines.setdefault((plan.activation_checkpointing, plan.optim), []).append(plan)
    in_hand = [given] if given_fits else []
    largest_micro = max(p.micro_batch_size for p in plans)
    if not given_fits:
        # The line with every remedy needs the least memory at each micro-batch: its largest fitting
        # micro-batch bounds every other line's (a plan with fewer remedies needs at least as much).
        saving = max(lines.values(), key=lambda line: (line[0].activation_checkpointing, line[0].optim != given.optim))
        best_saving = _largest_fitting(sorted(saving, key=lambda p: p.micro_batch_size), peak, limit)
        if best_saving is None:
            return _result(None, given, plans, budget, run, predictor)
        in_hand.append(best_saving)
        largest_micro = best_saving.micro_batch_size
    for line in sorted(lines.values(), key=lambda line: -max(p.relative_throughput for p in line)):
        current = pick(given, in_hand, budget)
        # Only plans that could beat (or tie) the plan in hand, and could fit, are worth a prediction.
        floor = -1.0 if current is None else current.relative_throughput - THROUGHPUT_TIE
        others = sorted((p for p in line if p.key() != given.key() and p.relative_throughput >= floor
                         and p.micro_batch_size <= largest_micro and p.key() not in peak.peaks),
                        key=lambda p: p.micro_batch_size)
        if others and (best := _largest_fitting(others, peak, limit)) is not None:
            in_hand.append(best)
    return _result(pick(given, in_hand, budget), given, plans, budget, run, predictor)


def _result(chosen: Plan | None, given: Plan, plans: list[Plan], budget: int, run: RunConfig,
            predictor: Predictor) -> PlanResult:
    result = PlanResult(chosen, given, plans, budget, unavailable_remedies(run), predictor.calls)
    if chosen is not None:
        chosen.reason = explain(result, run)
    return result


def explain(result: PlanResult, run: RunConfig) -> str:
    """The one-line reason recorded with a chosen plan."""
    chosen, given, budget = result.chosen, result.given, result.budget
    assert chosen is not None
    if chosen.key() == given.key():
        return (f"configuration as given fits: predicted peak {format_bytes(chosen.predicted_peak)} <= budget "
                f"{format_bytes(budget)}")
    changes = "; ".join(chosen.changes_from(run))
    if (given.predicted_peak or 0) > budget:
        text = (f"configuration as given is predicted to peak at {format_bytes(given.predicted_peak)}, over the budget "
                f"{format_bytes(budget)}; fastest plan that fits: {chosen.describe()} ({changes}; throughput "
                f"x{chosen.relative_throughput:.2f})")
    else:
        text = (f"ample headroom (given configuration predicted at {format_bytes(given.predicted_peak)} of "
                f"{format_bytes(budget)}): raised to {chosen.describe()} (throughput x{chosen.relative_throughput:.2f})")
    if result.unavailable:
        text += "; unavailable: " + "; ".join(f"{name} ({why})" for name, why in result.unavailable.items())
    return text


def no_fit_message(result: PlanResult, budget_text: str) -> str:
    """Why nothing fits, in one message (for :class:`~hf_memwatch.core.errors.PlanError`)."""
    best = result.best_effort()
    text = (f"hf-memwatch: no plan fits the budget {budget_text}. The configuration as given is predicted at "
            f"{format_bytes(result.given.predicted_peak)}; the best plan ({best.describe()}) still needs "
            f"{format_bytes(best.predicted_peak)}.")
    if result.unavailable:
        text += " Unavailable: " + "; ".join(f"{k} ({v})" for k, v in result.unavailable.items())
    return text
