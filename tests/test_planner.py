"""hf_memwatch.planning.planner: properties of the chosen plan, with real (memoised) estimates of a tiny GPT-2."""

from __future__ import annotations

import functools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GPT2Config

from hf_memwatch.core.errors import MemWatchConfigError
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.estimation.estimate import estimate
from hf_memwatch.planning.catalogue import divisors
from hf_memwatch.planning.chooser import relative_throughput
from hf_memwatch.planning.plan import Plan
from hf_memwatch.planning.planner import plan_for
from hf_memwatch.planning.predict import ESTIMATE_MARGIN

CONFIG = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)
SEQ_LEN = 32


@functools.cache
def _estimate(batch_size: int, optim: str, checkpointing: bool, accum: int):
    return estimate(CONFIG, micro_batch_size=batch_size, seq_len=SEQ_LEN, optim=optim,
                    activation_checkpointing=checkpointing, gradient_accumulation_steps=accum)


def memoised_estimate(_model, *, micro_batch_size, optim, activation_checkpointing, gradient_accumulation_steps,
                      **_ignored):
    return _estimate(micro_batch_size, optim, activation_checkpointing, gradient_accumulation_steps)


def plan(micro: int, accum: int, budget, optim: str = "adamw_torch"):
    return plan_for(CONFIG, RunConfig(micro, accum, seq_len=SEQ_LEN, optim=optim), budget, estimator=memoised_estimate)


def peak(micro: int, accum: int, checkpointing: bool = False, optim: str = "adamw_torch") -> int:
    """The planner's prediction: the estimate with the margin."""
    return math.ceil(_estimate(micro, optim, checkpointing, accum).peak_bytes * (1 + ESTIMATE_MARGIN))


PROPERTY_SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(
    micro=st.sampled_from([1, 2, 4]),
    accum=st.sampled_from([1, 2]),
    budget_share=st.floats(min_value=0.05, max_value=1.5),
    adamw=st.booleans(),
)
def test_chosen_plan_fits_preserves_the_effective_batch_or_is_none(micro, accum, budget_share, adamw):
    budget = max(1, int(budget_share * peak(micro, accum)))
    optim = "adamw_torch" if adamw else "sgd"
    result = plan(micro, accum, budget, optim)
    chosen = result.chosen
    for candidate in result.candidates:
        assert candidate.effective_batch == micro * accum  # exactly, never rounded
    if chosen is None:
        # nothing fits: every exactly predicted candidate is over budget, and the smallest plan is too
        assert all(p.predicted_peak > budget for p in result.candidates if p.verified)
        assert peak(1, micro * accum, checkpointing=True, optim=optim) > budget
    else:
        assert chosen.verified and chosen.predicted_peak <= budget
        assert chosen.predicted_peak == peak(
            chosen.micro_batch_size, chosen.gradient_accumulation_steps, chosen.activation_checkpointing, chosen.optim
        )
        assert chosen.effective_batch == micro * accum
        if not adamw:
            assert chosen.optim == "sgd"  # never replaced: it would change the algorithm


def test_configuration_as_given_is_kept_when_it_fits():
    budget = peak(4, 2) + 1
    chosen = plan(4, 2, budget).chosen
    assert chosen is not None and chosen.key() == (4, 2, False, "adamw_torch")
    assert chosen.relative_throughput == 1.0
    assert "as given" in chosen.reason


def test_tight_budget_picks_the_fastest_fitting_plan():
    budget = (peak(8, 1) + peak(1, 8)) // 2  # the given micro-batch of 8 does not fit, 1 x 8 does
    result = plan(8, 1, budget, optim="sgd")
    chosen = result.chosen
    assert chosen is not None and chosen.key() != result.given.key()
    fitting_verified = [p for p in result.candidates if p.verified and p.predicted_peak <= budget]
    assert chosen.relative_throughput == max(p.relative_throughput for p in fitting_verified)
    assert "fastest plan that fits: micro-batch" in chosen.reason
    assert chosen.reason.count("micro-batch") == 1  # the change named once


def test_ample_headroom_raises_the_micro_batch():
    result = plan(2, 4, 10 * peak(8, 1))
    assert result.chosen.micro_batch_size == 8 and result.chosen.gradient_accumulation_steps == 1
    assert result.chosen.relative_throughput > 1.0 and "ample headroom" in result.chosen.reason


def test_cost_model_orders_plans_as_documented():
    run = RunConfig(8, seq_len=128)
    assert relative_throughput(Plan(8, 1, False, "adamw_torch"), run) == 1.0
    assert relative_throughput(Plan(4, 2, False, "adamw_torch"), run) < 1.0  # smaller micro-batches
    assert relative_throughput(Plan(8, 1, True, "adamw_torch"), run) == pytest.approx(1 / 1.33)


def test_divisors():
    assert divisors(1) == [1]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def test_bad_request_fails_fast():
    with pytest.raises(MemWatchConfigError):
        plan(0, 1, 10**9)
    with pytest.raises(MemWatchConfigError):
        plan(1, 1, "plenty")
