"""The largest micro-batch that fits a budget: one search, the estimator's and the planner's.

:func:`largest_fitting_index` is the search itself: along a line of candidates whose peak grows with
the micro-batch (the same setting, sorted), a bisection between the largest known to fit and the
smallest known to be over, each next candidate guessed by the caller — only the order of the
predictions depends on the guess, never the answer. Two callers:

* :func:`largest_fitting_batch` (the estimator-only API): micro-batches 1..``max_batch``, the first
  guess the line through the peaks at 1 and 2 (activations grow linearly with the batch), then the
  one above it, then halves;
* the planner (:meth:`hf_memwatch.planning.chooser.PlanRequest.largest_fitting`): one setting's plans,
  the largest tried first, each next guess the line through the figures in hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.units import parse_bytes

__all__ = ["largest_fitting_batch", "largest_fitting_index"]


def largest_fitting_index(over: Callable[[int], bool], low: int, high: int,
                          guess: Callable[[int, int], int] | None = None) -> int:
    """The largest index whose ``over(index)`` is False, between ``low`` (known to fit; -1: none known)
    and ``high`` (known to be over, or one past the last candidate); ``over`` is non-decreasing.

    ``guess(low, high)``: the index strictly between them to try next (the middle by default).

    Example:
        >>> peaks = [10, 20, 30, 40, 50]
        >>> largest_fitting_index(lambda i: peaks[i] > 35, -1, len(peaks))
        2
        >>> largest_fitting_index(lambda i: peaks[i] > 5, -1, len(peaks))
        -1
    """
    guess = guess or (lambda lo, hi: (lo + hi) // 2)
    while high - low > 1:
        middle = guess(low, high)
        if over(middle):
            high = middle
        else:
            low = middle
    return low


def largest_fitting_batch(
    model_or_config: Any, *, budget: int | str, seq_len: int, max_batch: int = 4096, **kwargs: Any
) -> int:
    """The largest micro-batch whose predicted peak fits ``budget`` (0 when even 1 does not).

    Activations grow linearly with the batch, so two estimates give a line; the answer is checked
    (and corrected) with one or two more (:func:`largest_fitting_index`).

    Example:
        >>> largest_fitting_batch(cfg, budget="2GiB", seq_len=512)   # doctest: +SKIP
        23
    """
    from .estimate import estimate  # the search itself needs no torch (the planner's import)

    budget_bytes = parse_bytes(budget)
    kwargs.pop("micro_batch_size", None), kwargs.pop("batch_size", None)
    kwargs.pop("budget", None)
    peaks: dict[int, int] = {}

    def peak(batch: int) -> int:
        if batch not in peaks:
            peaks[batch] = estimate(model_or_config, micro_batch_size=batch, seq_len=seq_len, **kwargs).peak_bytes
        return peaks[batch]

    if peak(1) > budget_bytes:
        return 0
    if max_batch == 1:
        return 1
    first = max(1, min(max_batch, 1 + (budget_bytes - peak(1)) // max(peak(2) - peak(1), 1)))

    def guess(low: int, high: int) -> int:  # indices are micro-batches - 1
        if low < first - 1 < high:
            return first - 1  # the line's answer
        if low == first - 1 and low + 1 < high:
            return low + 1  # then the one above it: the line's answer is confirmed in one more
        return (low + high) // 2

    return 1 + largest_fitting_index(lambda index: peak(index + 1) > budget_bytes, 0, max_batch, guess)
