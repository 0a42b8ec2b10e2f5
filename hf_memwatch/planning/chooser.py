"""The one chooser: which plan of a run fits the limit, fastest, with the fewest changes.

:func:`plan_run` is the planning core every caller uses — the auto mode, ``hf-memwatch estimate
--budget``, the planner API and the OOM post-mortem:

1. :func:`candidates` crosses the options of every remedy of the catalogue
   (:data:`~hf_memwatch.planning.catalogue.REMEDIES`) that applies to the run; micro-batches are
   divisors of the per-device effective batch, so it is kept *exactly*;
2. a :class:`Predictor` gives the peak of the plans the choice needs — for each line of plans
   (one checkpointing setting and optimizer), fastest first, the largest micro-batch under the
   limit, by bisection (the peak grows with the micro-batch); plans that could not beat the plan
   in hand, or that figures in hand already put over the limit, are never predicted;
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

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Protocol

from ..core.run_config import RunConfig
from ..core.units import format_bytes
from ..estimation.fitting import largest_fitting_index
from .catalogue import REMEDIES, state_bytes_floor, unavailable_remedies
from .plan import Plan

T_HALF = 2048  # tokens per micro-batch at which the hardware runs at half its best efficiency
CHECKPOINTING_COST = 1.33  # one extra forward ~ a third of forward + backward
# A plan that changes a configuration which already fits must fit with this much to spare.
UPGRADE_HEADROOM = 0.85
# Plans whose predicted throughputs differ by less than this tie; the fewest changes win.
THROUGHPUT_TIE = 0.02


class Predictor(Protocol):
    """Predicts the step peak (bytes, per device) of one plan exactly; ``calls`` counts predictions.

    A predictor may also offer ``parts(plan) -> PeakParts`` (the parts of the prediction already
    made of ``plan``) and ``floor_parts(plan) -> PeakParts`` (a cheaper replay of the forward and
    backward alone): the chooser then rules out, without a full prediction, plans that those
    figures already put over the limit.
    """

    calls: int

    def peak(self, plan: Plan) -> int: ...


@dataclass(frozen=True)
class PeakParts:
    """What bounds a step's peak from below, whatever its optimizer (bytes, per device).

    ``forward_backward``: the highest live bytes of the forward and backward *without* optimizer
    states (a floor when the states are only known at the step's peak); ``trainable_params``:
    elements the optimizer keeps state for; ``state_share``: the part of those states each device
    holds (1/world size when sharded); ``margin``: the predictor's margin on every figure;
    ``named_optimizer``: False where the Trainer steps an optimizer it was handed (``optimizers=``), not
    the one the plan's ``optim`` names — its states have no floor (plain SGD keeps none).
    """

    forward_backward: int
    trainable_params: int
    state_share: float = 1.0
    margin: float = 0.0
    named_optimizer: bool = True

    def floor(self, optim: str) -> int:
        """The least peak (margin included) of the same forward and backward with ``optim``'s states."""
        states = state_bytes_floor(optim, self.trainable_params) * self.state_share if self.named_optimizer else 0
        return math.ceil((self.forward_backward + states) * (1.0 + self.margin))


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

    return speed(plan.micro_batch_size, plan.activation_checkpointing) / speed(run.micro_batch_size, run.activation_checkpointing)


def candidates(run: RunConfig, *, larger_micro_batches: bool = True) -> list[Plan]:
    """Every plan the catalogue allows for ``run`` (the run as configured first).

    The product of every remedy's options (:data:`~hf_memwatch.planning.catalogue.REMEDIES`, in
    their order), the accumulation following the micro-batch so that the effective batch is kept.
    """
    given = Plan.of(run)
    plans = [given]
    fields = [remedy.field for remedy in REMEDIES]
    for values in itertools.product(*(remedy.options(run) for remedy in REMEDIES)):
        setting = dict(zip(fields, values, strict=True))
        micro = setting.get("micro_batch_size", run.micro_batch_size)
        if micro > run.micro_batch_size and not larger_micro_batches:
            continue
        plan = dataclasses.replace(given, **setting, gradient_accumulation_steps=run.effective_batch // micro)
        if plan.key() != given.key():
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
    """The predictor's figures, one call per plan, and the floors they put under plans not predicted."""

    def __init__(self, predictor: Predictor) -> None:
        self.predictor = predictor
        self.peaks: dict[tuple, int] = {}
        self.parts: dict[tuple, PeakParts] = {}  # per plan key: exact or cheap, the floor of its micro-step
        self.floors = 0

    def __call__(self, plan: Plan) -> int:
        if plan.key() not in self.peaks:
            self.peaks[plan.key()] = int(self.predictor.peak(plan))
            parts = getattr(self.predictor, "parts", None)
            if parts is not None and (found := parts(plan)) is not None:
                self.parts[plan.key()] = found
        plan.predicted_peak, plan.verified = self.peaks[plan.key()], True
        return plan.predicted_peak

    def over(self, plan: Plan, limit: float, *, cheap: bool = False) -> bool:
        """Whether ``plan`` peaks over ``limit``: exactly, or — ``cheap`` — by a floor when one settles it.

        A floor over the limit settles it (the plan is ruled out, its peak unknown); any other
        answer rests on the exact prediction.
        """
        if plan.key() not in self.peaks:
            if self.lower_bound(plan) > limit:
                return True
            floor_parts = getattr(self.predictor, "floor_parts", None)
            if cheap and floor_parts is not None and plan.key() not in self.parts and not self.replayed(plan) \
                    and not self.skips_floor(plan):
                self.floors += 1
                self.parts[plan.key()] = floor_parts(plan)
                if self.lower_bound(plan) > limit:
                    return True
        return self(plan) > limit

    def replayed(self, plan: Plan) -> bool:
        """Whether the forward and backward of ``plan``'s micro-step are in hand already (a plan of the
        same micro-batch, accumulation and checkpointing with another optimizer was predicted): a floor
        replay of ``plan`` would replay them again for the same figure (:meth:`lower_bound` has it).

        Measured on the Llama-shaped plans of ``benchmarks/planning_cost.py``: such floors never ruled a
        plan out. Off with :data:`~hf_memwatch.estimation.memo.SHORTCUTS` (the old path)."""
        from ..estimation import memo

        return memo.SHORTCUTS and any(key[:3] == plan.key()[:3] for key in self.parts)

    @staticmethod
    def skips_floor(plan: Plan) -> bool:
        """Whether a forward/backward floor replay of ``plan`` is not worth its cost: under checkpointing a
        floor left under the limit is paid twice (Llama-3.1-70B-shaped, 8 x 2048 tokens: 6.4 s against 9.6 s
        when every layer was replayed). Measured again since checkpointed runs are extrapolated in depth
        (``benchmarks/planning_cost.py``'s plans, one process): with these floors each plan made one floor
        replay more and no full estimate fewer (1B full 4.37 -> 5.40 s, 8B full 4.70 -> 5.86 s, the same
        plans). Off with :data:`~hf_memwatch.estimation.memo.SHORTCUTS`."""
        from ..estimation import memo

        return memo.SHORTCUTS and plan.activation_checkpointing

    def optimizer_floor(self, plan: Plan) -> int:
        """What ``plan`` holds at its optimizer step by the figures in hand (the predictor's ``step_floor``:
        weights + gradients + optimizer states; 0 where it has none, or the shortcuts are off)."""
        from ..estimation import memo

        step_floor = getattr(self.predictor, "step_floor", None)
        return int(step_floor(plan)) if memo.SHORTCUTS and step_floor is not None else 0

    def lower_bound(self, plan: Plan) -> int:
        """A floor under the peak of ``plan`` from the figures already in hand (0: none).

        Plans of the same micro-step (micro-batch, accumulation, checkpointing) run the same forward
        and backward, whatever their optimizer: each figure of one of them, plus the least optimizer
        state ``plan``'s optimizer keeps (:func:`~hf_memwatch.planning.catalogue.state_bytes_floor`),
        is a floor. The optimizer step itself is not compared (8-bit AdamW's CPU kernels can peak
        above fused AdamW's), but what every plan holds at it is (:meth:`optimizer_floor`).
        """
        floor = self.optimizer_floor(plan)
        for key, parts in self.parts.items():
            if key[:3] == plan.key()[:3]:
                floor = max(floor, parts.floor(plan.optim))
        return floor


def _next_to_predict(line: list[Plan], low: int, high: int, peak: _Exact, limit: float) -> int:
    """Index strictly between ``low`` (fits; -1: none known) and ``high`` (over the limit) to predict next.

    A guess from the straight line through the two figures (exact or floors) of this line's setting
    (checkpointing, optimizer) nearest to ``line[high]`` — the peak is close to affine in the micro-batch: the
    largest micro-batch it puts under ``limit``. Only the order of predictions depends on the
    guess, never the answer of the bisection. Without two figures: the middle.
    """
    setting = setting_of(line[0])
    figures = {key[0]: parts.floor(key[3]) for key, parts in peak.parts.items() if key[2:] == setting}
    figures.update((key[0], figure) for key, figure in peak.peaks.items() if key[2:] == setting)
    known = sorted(figures.items(), key=lambda point: abs(point[0] - line[high].micro_batch_size))[:2]
    if len(known) < 2 or known[0][0] == known[1][0]:
        return (low + high) // 2
    (m1, f1), (m2, f2) = sorted(known)
    slope = (f2 - f1) / (m2 - m1)
    if slope <= 0:
        return (low + high) // 2
    target = m2 + (limit - f2) / slope
    fitting = [i for i in range(low + 1, high) if line[i].micro_batch_size <= target]
    return fitting[-1] if fitting else low + 1


def _largest_fitting(line: list[Plan], peak: _Exact, limit: float) -> Plan | None:
    """The plan with the largest micro-batch of ``line`` (sorted by micro-batch) under ``limit``.

    Along a line (same checkpointing and optimizer) the peak grows with the micro-batch, so a
    bisection (:func:`~hf_memwatch.estimation.fitting.largest_fitting_index`, the estimator's search
    too) finds it with at most about log2(len(line)) predictions, the largest tried first and the next guessed from the figures already in hand (:func:`_next_to_predict`). The answer's
    figure is always exact.
    """
    # The largest is tried first and, being the likeliest to be over, by a floor when one rules it out.
    if not peak.over(line[-1], limit, cheap=True):
        return line[-1]
    low = largest_fitting_index(lambda index: peak.over(line[index], limit), -1, len(line) - 1,
                                lambda low, high: _next_to_predict(line, low, high, peak, limit))
    return line[low] if low >= 0 else None


def _could_win(plan: Plan, given: Plan, in_hand: list[Plan], budget: int) -> bool:
    """Whether :func:`pick` would choose ``plan`` over the plans in hand, were it to fit."""
    hopeful = Plan(*plan.key(), predicted_peak=0, relative_throughput=plan.relative_throughput)
    return pick(given, [*in_hand, hopeful], budget) is hopeful


class PlanRequest:
    """One question to the planning core: the plans of ``run`` under ``budget``, one predictor, one cache.

    Every answer about the run's remedies reads the same candidates (:func:`candidates`) and the same
    predictions (one :class:`_Exact` cache): the choice (:meth:`choose`, what the auto mode applies),
    the CLI's remedy table and the OOM post-mortem's savings (:mod:`hf_memwatch.planning.remedies`).
    So they cannot disagree, and a plan predicted for one is not predicted again for another.
    ``budget`` may be None where only figures are asked for (the post-mortem).
    """

    def __init__(self, run: RunConfig, predictor: Predictor, budget: int | None = None, *,
                 larger_micro_batches: bool = True) -> None:
        self.run = run
        self.predictor = predictor
        self.budget = budget
        self.peak = _Exact(predictor)
        self.given = Plan.of(run)
        self.given.relative_throughput = 1.0
        self.candidates = candidates(run, larger_micro_batches=larger_micro_batches)
        self.candidates[0] = self.given
        self._result: PlanResult | None = None

    def predicted(self, plan: Plan) -> int:
        """The exact predicted peak of ``plan`` (margin included), from the request's one cache."""
        return self.peak(plan)

    def lines(self) -> dict[tuple, list[Plan]]:
        """The candidates by setting (every plan field but the micro-batch and accumulation: checkpointing,
        optimizer, ...), each line sorted by micro-batch; the run's own setting first."""
        lines: dict[tuple, list[Plan]] = {setting_of(self.given): []}
        for plan in self.candidates:
            lines.setdefault(setting_of(plan), []).append(plan)
        return {setting: sorted(line, key=lambda p: p.micro_batch_size) for setting, line in lines.items()}

    def largest_fitting(self, line: list[Plan], limit: float) -> Plan | None:
        """The plan of ``line`` (one setting, sorted by micro-batch) with the largest micro-batch whose
        prediction is under ``limit``: the chooser's bisection on the request's cache."""
        return _largest_fitting(line, self.peak, limit)

    def choose(self) -> PlanResult:
        """The plan for the budget — see :func:`plan_run` (computed once per request)."""
        if self._result is None:
            if self.budget is None:
                raise ValueError("PlanRequest.choose needs a budget")
            self._result = _choose(self)
        return self._result


def setting_of(plan: Plan) -> tuple:
    """What a plan sets besides the micro-batch and its accumulation (a line of plans)."""
    return plan.key()[2:]


def plan_run(run: RunConfig, predictor: Predictor, budget: int, *, larger_micro_batches: bool = True) -> PlanResult:
    """Choose the plan of ``run`` for ``budget`` (bytes per device) — see the module docstring.

    Lines of plans (one checkpointing setting and optimizer, every micro-batch) are visited from
    the fastest; each contributes its largest micro-batch that fits, found by bisection on exact
    predictions. A plan is predicted only if it could beat the plan in hand (:func:`_could_win`)
    and no figure already in hand puts it over the limit (:meth:`_Exact.lower_bound`). The chosen
    plan's figure is exact (``verified``); plans ruled out may rest on floors.
    """
    return PlanRequest(run, predictor, budget, larger_micro_batches=larger_micro_batches).choose()


def _choose(request: PlanRequest) -> PlanResult:
    run, peak, given, budget = request.run, request.peak, request.given, request.budget
    assert budget is not None
    given_fits = peak(given) <= budget
    limit = budget * UPGRADE_HEADROOM if given_fits else budget
    in_hand = [given] if given_fits else []
    lines = [[p for p in request.candidates if setting_of(p) == setting] for setting in request.lines()]
    # Fastest lines first; between equally fast lines the run's own optimizer first, so that the
    # other optimizer's plans meet the figures that bound them.
    order = sorted(lines, key=lambda line: (-max(p.relative_throughput for p in line), line[0].optim != run.optim))
    for line in order:
        worth = sorted((p for p in line if p.key() != given.key()
                        and _could_win(p, given, in_hand, budget) and peak.lower_bound(p) <= limit),
                       key=lambda p: p.micro_batch_size)
        if worth and (best := _largest_fitting(worth, peak, limit)) is not None:
            in_hand.append(best)
    return _result(pick(given, in_hand, budget), given, request.candidates, budget, run, request.predictor)


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
        # the changes once (describe() would name them again beside the settings left alone)
        text = (f"configuration as given is predicted to peak at {format_bytes(given.predicted_peak)}, over the budget "
                f"{format_bytes(budget)}; fastest plan that fits: {changes}, predicted peak "
                f"{format_bytes(chosen.predicted_peak)} (throughput x{chosen.relative_throughput:.2f})")
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
        text += " Unavailable: " + "; ".join(f"{k} ({v})" for k, v in result.unavailable.items()) + "."
    return text
