"""The largest micro-batch that fits a budget, by the estimator (``largest_fitting_batch``).

Activations grow linearly with the batch, so two estimates give a line; the answer is checked (and
corrected) with one or two more. The planner's own search over plans is
:meth:`hf_memwatch.planning.chooser.PlanRequest.largest_fitting`; this is the estimator-only API.
"""

from __future__ import annotations

from typing import Any

from ..core.units import parse_bytes
from .estimate import estimate

__all__ = ["largest_fitting", "largest_fitting_batch"]


def largest_fitting_batch(
    model_or_config: Any, *, budget: int | str, seq_len: int, max_batch: int = 4096, **kwargs: Any
) -> int:
    """The largest micro-batch whose predicted peak fits ``budget`` (0 when even 1 does not).

    Activations grow linearly with the batch, so two estimates give a line; the answer is checked
    (and corrected) with one or two more.

    Example:
        >>> largest_fitting_batch(cfg, budget="2GiB", seq_len=512)   # doctest: +SKIP
        23
    """
    budget_bytes = parse_bytes(budget)
    kwargs.pop("micro_batch_size", None), kwargs.pop("batch_size", None)
    kwargs.pop("budget", None)

    def peak(batch: int) -> int:
        return estimate(model_or_config, micro_batch_size=batch, seq_len=seq_len, **kwargs).peak_bytes

    return largest_fitting(peak, budget_bytes, max_batch)


def largest_fitting(peak_of: Any, budget: int, max_batch: int) -> int:
    """Largest ``b`` in [1, max_batch] with ``peak_of(b) <= budget``; 0 when none.

    Extrapolates the line through ``peak_of(1)`` and ``peak_of(2)`` then verifies, falling back to
    bisection over the verified bracket (``peak_of`` is assumed non-decreasing).
    """
    cache: dict[int, int] = {}

    def fits(batch: int) -> bool:
        if batch not in cache:
            cache[batch] = peak_of(batch)
        return cache[batch] <= budget

    if not fits(1):
        return 0
    if max_batch == 1:
        return 1
    slope = max(peak_of_cached(cache, peak_of, 2) - cache[1], 1)
    guess = max(1, min(max_batch, 1 + (budget - cache[1]) // slope))
    low, high = 1, max_batch + 1  # fits(low), not fits(high) (high virtual)
    if fits(guess):
        low = guess
        if guess < max_batch and not fits(guess + 1):
            return guess
    else:
        high = guess
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


def peak_of_cached(cache: dict[int, int], peak_of: Any, batch: int) -> int:
    """``peak_of(batch)`` through ``cache``."""
    if batch not in cache:
        cache[batch] = peak_of(batch)
    return cache[batch]
