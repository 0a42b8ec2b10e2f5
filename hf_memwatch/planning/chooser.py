"""The one chooser: which plan of a run fits the limit, fastest, with the fewest changes.

:func:`plan_run` is the planning core every caller uses — the auto mode, ``hf-memwatch estimate
--budget``, the planner API and the OOM post-mortem:

1. :func:`candidates` crosses the options of every remedy of the catalogue
   (:data:`~hf_memwatch.planning.catalogue.REMEDIES`) that applies to the run; micro-batches are
   divisors of the per-device effective batch, so it is kept *exactly*;
2. a :class:`Predictor` gives each plan's peak — exactly for the plans it is asked about, and by
   a line through two exact predictions for the others (activations grow linearly with the
   micro-batch; the line between the smallest and largest micro-batch lies above the convex peak
   curve, so an interpolated figure errs on the safe side);
3. :func:`pick` keeps the plans under the limit and takes the fastest by the cost model of
   :func:`relative_throughput`, ties going to the fewest changes; a pick whose figure was
   interpolated is predicted exactly and the choice made again, until the pick is exact.

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


class _Lines:
    """Plan peaks: exact where predicted, else on the line through two exact predictions of the
    same (checkpointing, optimizer) at the smallest and largest micro-batch."""

    def __init__(self, predictor: Predictor) -> None:
        self.predictor = predictor
        self.exact: dict[tuple, int] = {}

    def exact_peak(self, plan: Plan) -> int:
        if plan.key() not in self.exact:
            self.exact[plan.key()] = int(self.predictor.peak(plan))
        return self.exact[plan.key()]

    def fill(self, plans: list[Plan]) -> None:
        by_line: dict[tuple[bool, str], list[Plan]] = {}
        for plan in plans:
            by_line.setdefault((plan.activation_checkpointing, plan.optim), []).append(plan)
        for line in by_line.values():
            missing = [p for p in line if p.key() not in self.exact]
            if len(missing) == 1 and len(line) == 1:
                self.exact_peak(line[0])
            elif missing:
                low = min(line, key=lambda p: p.micro_batch_size)
                high = max(line, key=lambda p: p.micro_batch_size)
                p_low, p_high = self.exact_peak(low), self.exact_peak(high)
                slope = (p_high - p_low) / (high.micro_batch_size - low.micro_batch_size)
            for plan in line:
                plan.verified = plan.key() in self.exact
                if plan.verified:
                    plan.predicted_peak = self.exact[plan.key()]
                else:
                    plan.predicted_peak = int(round(p_low + slope * (plan.micro_batch_size - low.micro_batch_size)))

    def lines_needed(self, plans: list[Plan], given: Plan, budget: int) -> list[Plan]:
        """The plans whose lines may hold the pick: cheaper lines are predicted only when needed.

        Lines are taken in order of their best throughput; once a line holds a fitting plan, lines
        that cannot beat it are not predicted.
        """
        by_line: dict[tuple[bool, str], list[Plan]] = {}
        for plan in plans:
            by_line.setdefault((plan.activation_checkpointing, plan.optim), []).append(plan)
        order = sorted(by_line.values(), key=lambda line: -max(p.relative_throughput for p in line))
        taken: list[Plan] = []
        for line in order:
            best_here = max(p.relative_throughput for p in line)
            current = pick(given, taken, budget) if taken else None
            if current is not None and best_here < current.relative_throughput - THROUGHPUT_TIE:
                break
            self.fill(line)
            taken.extend(line)
        return taken


def plan_run(run: RunConfig, predictor: Predictor, budget: int, *, larger_micro_batches: bool = True) -> PlanResult:
    """Choose the plan of ``run`` for ``budget`` (bytes per device) — see the module docstring."""
    lines = _Lines(predictor)
    given = Plan.of(run)
    given.predicted_peak = lines.exact_peak(given)
    given.verified = True
    plans = candidates(run, larger_micro_batches=larger_micro_batches)
    plans[0] = given
    while True:
        considered = lines.lines_needed(plans, given, budget)
        chosen = pick(given, considered, budget)
        if chosen is None or chosen.key() in lines.exact:
            break
        lines.exact_peak(chosen)  # confirm the pick exactly, then choose again
        lines.fill([chosen])
    for plan in plans:
        if plan.key() in lines.exact:
            plan.predicted_peak, plan.verified = lines.exact[plan.key()], True
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
