"""Pure planning: which micro-batch / accumulation / checkpointing / optimizer fits a memory budget.

No Trainer here: :func:`candidate_plans` enumerates configurations that keep the per-device
effective batch (``micro_batch_size * gradient_accumulation_steps``) *exactly* — micro-batches are
divisors of it — crossed with activation checkpointing on/off and the optimizer as given or
bitsandbytes' 8-bit AdamW (paged on CUDA). Each gets a predicted peak from
:func:`hf_memwatch.estimation.estimate.estimate` and a relative throughput from a simple cost model;
:func:`choose_plan` returns the configuration as given when it fits, else the fitting plan with
the best predicted throughput (its peak verified by a direct estimate), else ``None``.

Peaks are linear in the micro-batch (activations are), so each (checkpointing, optimizer) pair
costs two estimates; other micro-batches are interpolated, and a plan is only chosen after a
direct estimate confirms it (``verified``).

Cost model (relative throughput, samples per second, 1.0 = the configuration as given):

- hardware efficiency of a micro-step with ``t = micro * seq_len`` tokens is ``t / (t + T_HALF)``
  (small micro-batches use the hardware worse; ``T_HALF`` = 2048 tokens reaches half
  efficiency) — so more accumulation steps of smaller micro-batches are slower;
- activation checkpointing recomputes the forward during backward: x 1 / 1.33;
- 8-bit Adam: free (x 1.0).

Usage:
    >>> request = PlanRequest(cfg, micro_batch_size=16, gradient_accumulation_steps=1, seq_len=512,
    ...                       budget="8GiB")                                       # doctest: +SKIP
    >>> plan = choose_plan(request); plan.explain() if plan else "nothing fits"  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.errors import MemWatchConfigError
from ..core.units import format_bytes, parse_bytes

T_HALF = 2048  # tokens per micro-batch at which the hardware runs at half its best efficiency
CHECKPOINTING_COST = 1.33  # one extra forward ~ a third of forward + backward
EIGHT_BIT_OPTIMS = frozenset({"adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit"})


@dataclass
class PlanRequest:
    """What to plan for: the configuration as given, the budget, and which remedies may be used.

    ``allow_8bit_adam=None`` means: when bitsandbytes is installed.
    ``allow_larger_micro_batch`` adds plans with a larger micro-batch and fewer accumulation
    steps (for ample headroom). ``estimator`` replaces :func:`~hf_memwatch.estimation.estimate.estimate`
    (same keyword signature), e.g. a memoised one.
    """

    model_or_config: Any
    micro_batch_size: int
    seq_len: int
    budget: int | str
    gradient_accumulation_steps: int = 1
    precision: str = "fp32"
    optim: str = "adamw_torch"
    checkpointing: bool = False
    world_size: int = 1
    shard: str = "none"
    device: str = "cpu"
    task: str | None = None
    max_grad_norm: float = 1.0
    seq2seq_target_len: int | None = None
    allow_accumulation: bool = True
    allow_checkpointing: bool = True
    allow_8bit_adam: bool | None = None
    allow_larger_micro_batch: bool = True
    estimator: Callable[..., Any] | None = field(default=None, repr=False)

    @property
    def effective_batch(self) -> int:
        """Per-device samples per optimizer step."""
        return self.micro_batch_size * self.gradient_accumulation_steps

    def budget_bytes(self) -> int:
        return parse_bytes(self.budget)


@dataclass
class Plan:
    """One candidate configuration with its predicted peak and relative throughput."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    activation_checkpointing: bool
    optim: str
    predicted_peak: int
    relative_throughput: float
    reason: str = ""
    fits: bool = False
    verified: bool = False
    is_given: bool = False
    estimate: Any = field(default=None, repr=False)

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps

    def key(self) -> tuple[int, bool, str]:
        return (self.micro_batch_size, self.activation_checkpointing, self.optim)

    def explain(self) -> str:
        """One line: the configuration, its predicted peak and throughput, and why."""
        parts = [f"micro-batch {self.micro_batch_size} x accumulation {self.gradient_accumulation_steps}"]
        if self.activation_checkpointing:
            parts.append("activation checkpointing")
        parts.append(f"optim {self.optim}")
        return (
            f"{', '.join(parts)}: predicted peak {format_bytes(self.predicted_peak)}"
            f"{'' if self.verified else ' (interpolated)'}, "
            f"throughput x{self.relative_throughput:.2f} — {self.reason}"
        )


# -- enumeration -----------------------------------------------------------------------------
def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order.

    Example:
        >>> divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def eight_bit_optim(device: str) -> str:
    """The 8-bit AdamW to try: paged on CUDA (its states can spill to host memory)."""
    return "paged_adamw_8bit" if device == "cuda" else "adamw_bnb_8bit"


def bnb_available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def relative_throughput(micro: int, checkpointing: bool, seq_len: int, given_micro: int,
                        given_checkpointing: bool) -> float:
    """Samples per second relative to the configuration as given (the documented cost model)."""

    def speed(m: int, ckpt: bool) -> float:
        tokens = m * seq_len
        efficiency = tokens / (tokens + T_HALF)
        return efficiency / (CHECKPOINTING_COST if ckpt else 1.0)

    return speed(micro, checkpointing) / speed(given_micro, given_checkpointing)


def _validate(request: PlanRequest) -> None:
    for name in ("micro_batch_size", "gradient_accumulation_steps", "seq_len", "world_size"):
        value = getattr(request, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MemWatchConfigError(f"{name} must be a positive integer; got {value!r}")
    request.budget_bytes()


def _combos(request: PlanRequest) -> list[tuple[bool, str]]:
    checkpointing = [request.checkpointing]
    if request.allow_checkpointing and not request.checkpointing:
        checkpointing.append(True)
    optims = [request.optim]
    allow_8bit = bnb_available() if request.allow_8bit_adam is None else request.allow_8bit_adam
    if allow_8bit and request.optim not in EIGHT_BIT_OPTIMS:
        optims.append(eight_bit_optim(request.device))
    return [(c, o) for c in checkpointing for o in optims]


def _micro_batches(request: PlanRequest) -> list[int]:
    options = []
    for micro in divisors(request.effective_batch):
        if micro < request.micro_batch_size and not request.allow_accumulation:
            continue
        if micro > request.micro_batch_size and not request.allow_larger_micro_batch:
            continue
        options.append(micro)
    return options


class _Predictor:
    """Estimates, cached, and a line per (checkpointing, optim) through two of them."""

    def __init__(self, request: PlanRequest) -> None:
        self.request = request
        self.cache: dict[tuple[int, bool, str], Any] = {}
        self.calls = 0

    def estimate(self, micro: int, checkpointing: bool, optim: str) -> Any:
        key = (micro, checkpointing, optim)
        if key not in self.cache:
            from ..estimation.estimate import estimate

            r = self.request
            self.calls += 1
            self.cache[key] = (r.estimator or estimate)(
                r.model_or_config, batch_size=micro, seq_len=r.seq_len, task=r.task, precision=r.precision,
                optim=optim, checkpointing=checkpointing, accum=r.effective_batch // micro, device=r.device,
                max_grad_norm=r.max_grad_norm, world_size=r.world_size, shard=r.shard,
                seq2seq_target_len=r.seq2seq_target_len,
            )
        return self.cache[key]

    def line(self, micros: list[int], checkpointing: bool, optim: str) -> tuple[float, float]:
        """(intercept, slope) of peak against micro-batch, from the smallest and largest micro."""
        low, high = micros[0], micros[-1]
        peak_low = self.estimate(low, checkpointing, optim).peak_bytes
        if high == low:
            return float(peak_low), 0.0
        peak_high = self.estimate(high, checkpointing, optim).peak_bytes
        slope = (peak_high - peak_low) / (high - low)
        return peak_low - slope * low, slope


def _given_plan(request: PlanRequest, est: Any) -> Plan:
    plan = Plan(
        micro_batch_size=request.micro_batch_size, gradient_accumulation_steps=request.gradient_accumulation_steps,
        activation_checkpointing=request.checkpointing, optim=request.optim, predicted_peak=est.peak_bytes,
        relative_throughput=1.0, fits=est.peak_bytes <= request.budget_bytes(), verified=True, is_given=True,
        estimate=est,
    )
    plan.reason = _reason(plan, request)
    return plan


def _reason(plan: Plan, request: PlanRequest) -> str:
    changes = []
    if plan.micro_batch_size < request.micro_batch_size:
        changes.append("smaller micro-batch with more accumulation")
    elif plan.micro_batch_size > request.micro_batch_size:
        changes.append("larger micro-batch with fewer accumulation steps")
    if plan.activation_checkpointing and not request.checkpointing:
        changes.append("activation checkpointing")
    if plan.optim != request.optim:
        changes.append("8-bit AdamW")
    budget = format_bytes(request.budget_bytes())
    verdict = "fits" if plan.fits else "does not fit"
    what = "as given" if not changes else " + ".join(changes)
    return f"{what}; {verdict} {budget}"


def candidate_plans(request: PlanRequest, _predictor: _Predictor | None = None) -> list[Plan]:
    """Every candidate plan, best predicted throughput first (fitting plans before the others).

    Effective batch preserved exactly; peaks interpolated per (checkpointing, optim) line, the
    endpoints of each line estimated directly (``verified``).
    """
    _validate(request)
    predictor = _predictor or _Predictor(request)
    budget = request.budget_bytes()
    micros = _micro_batches(request)
    plans: list[Plan] = []
    for checkpointing, optim in _combos(request):
        intercept, slope = predictor.line(micros, checkpointing, optim)
        for micro in micros:
            known = predictor.cache.get((micro, checkpointing, optim))
            peak = known.peak_bytes if known is not None else int(round(intercept + slope * micro))
            plan = Plan(
                micro_batch_size=micro,
                gradient_accumulation_steps=request.effective_batch // micro,
                activation_checkpointing=checkpointing,
                optim=optim,
                predicted_peak=peak,
                relative_throughput=relative_throughput(
                    micro, checkpointing, request.seq_len, request.micro_batch_size, request.checkpointing
                ),
                fits=peak <= budget,
                verified=known is not None,
                is_given=(micro, checkpointing, optim)
                == (request.micro_batch_size, request.checkpointing, request.optim),
                estimate=known,
            )
            plan.reason = _reason(plan, request)
            plans.append(plan)
    plans.sort(key=lambda p: (not p.fits, -p.relative_throughput, p.predicted_peak))
    return plans


def choose_plan(request: PlanRequest) -> Plan | None:
    """The configuration as given when it fits; else the fitting plan with the best throughput; else None.

    The returned plan's ``predicted_peak`` comes from a direct estimate of that very configuration
    (``verified``) and is within the budget.
    """
    return plan_all(request, candidates_when_given_fits=False).chosen


@dataclass
class PlanResult:
    """The chosen plan (or None) and every candidate considered."""

    chosen: Plan | None
    candidates: list[Plan]
    estimates: int


def plan_all(request: PlanRequest, candidates_when_given_fits: bool = True) -> PlanResult:
    """:func:`choose_plan` with the full candidate list and the number of estimates it cost.

    With ``candidates_when_given_fits=False`` a fitting configuration costs one estimate and the
    candidate list holds only it.
    """
    _validate(request)
    budget = request.budget_bytes()
    predictor = _Predictor(request)
    given = predictor.estimate(request.micro_batch_size, request.checkpointing, request.optim)
    if given.peak_bytes <= budget and not candidates_when_given_fits:
        chosen = _given_plan(request, given)
        return PlanResult(chosen, [chosen], predictor.calls)
    candidates = candidate_plans(request, predictor)
    if given.peak_bytes <= budget:
        chosen = next(p for p in candidates if p.is_given)
        return PlanResult(chosen, candidates, predictor.calls)
    for index, plan in enumerate(candidates):
        if not plan.fits:
            continue
        if not plan.verified:
            est = predictor.estimate(plan.micro_batch_size, plan.activation_checkpointing, plan.optim)
            plan = replace(plan, predicted_peak=est.peak_bytes, verified=True, estimate=est,
                           fits=est.peak_bytes <= budget)
            plan.reason = _reason(plan, request)
            candidates[index] = plan
        if plan.fits:
            return PlanResult(plan, candidates, predictor.calls)
    return PlanResult(None, candidates, predictor.calls)
