"""hf_memwatch.planning.planner: properties of the chosen plan, with real (memoised) estimates of a tiny GPT-2."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GPT2Config

from hf_memwatch.core.errors import MemWatchConfigError
from hf_memwatch.estimation.estimate import estimate
from hf_memwatch.planning.planner import PlanRequest, choose_plan, divisors, plan_all, relative_throughput

CONFIG = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)
SEQ_LEN = 32


@functools.cache
def _estimate(batch_size: int, optim: str, checkpointing: bool, accum: int):
    return estimate(CONFIG, batch_size=batch_size, seq_len=SEQ_LEN, optim=optim, checkpointing=checkpointing,
                    accum=accum)


def memoised_estimate(_model, *, batch_size, optim, checkpointing, accum, **_ignored):
    return _estimate(batch_size, optim, checkpointing, accum)


def request(micro: int, accum: int, budget: int, **extra) -> PlanRequest:
    return PlanRequest(CONFIG, micro_batch_size=micro, gradient_accumulation_steps=accum, seq_len=SEQ_LEN,
                       budget=budget, estimator=memoised_estimate, **extra)


def peak(micro: int, accum: int, checkpointing: bool = False, optim: str = "adamw_torch") -> int:
    return _estimate(micro, optim, checkpointing, accum).peak_bytes


PROPERTY_SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(
    micro=st.sampled_from([1, 2, 4]),
    accum=st.sampled_from([1, 2]),
    budget_share=st.floats(min_value=0.05, max_value=1.5),
    allow_8bit=st.booleans(),
)
def test_chosen_plan_fits_preserves_the_effective_batch_or_is_none(micro, accum, budget_share, allow_8bit):
    budget = max(1, int(budget_share * peak(micro, accum)))
    result = plan_all(request(micro, accum, budget, allow_8bit_adam=allow_8bit))
    chosen = result.chosen
    for plan in result.candidates:
        assert plan.effective_batch == micro * accum  # exactly, never rounded
    if chosen is None:
        # nothing fits: every directly estimated candidate is over budget, and the smallest plan is too
        assert all(not p.fits for p in result.candidates if p.verified)
        assert peak(1, micro * accum, checkpointing=True) > budget
    else:
        assert chosen.verified and chosen.fits
        assert chosen.predicted_peak <= budget
        assert chosen.predicted_peak == peak(
            chosen.micro_batch_size, chosen.gradient_accumulation_steps, chosen.activation_checkpointing, chosen.optim
        )
        assert chosen.effective_batch == micro * accum
        if not allow_8bit:
            assert chosen.optim == "adamw_torch"


def test_configuration_as_given_is_kept_when_it_fits():
    budget = peak(4, 2) + 1
    chosen = choose_plan(request(4, 2, budget))
    assert chosen is not None and chosen.is_given
    assert (chosen.micro_batch_size, chosen.gradient_accumulation_steps, chosen.activation_checkpointing) == (4, 2, False)
    assert chosen.relative_throughput == 1.0
    assert "as given" in chosen.explain()


def test_tight_budget_picks_the_fastest_fitting_plan():
    budget = (peak(8, 1) + peak(1, 8)) // 2  # the given micro-batch of 8 does not fit, 1 x 8 does
    result = plan_all(request(8, 1, budget, allow_8bit_adam=False))
    chosen = result.chosen
    assert chosen is not None and not chosen.is_given
    fitting_verified = [p for p in result.candidates if p.fits and p.verified]
    assert chosen.relative_throughput == max(p.relative_throughput for p in fitting_verified)
    assert chosen.explain().startswith(f"micro-batch {chosen.micro_batch_size} x accumulation")


def test_ample_headroom_offers_larger_micro_batches():
    result = plan_all(request(2, 4, 10 * peak(8, 1)))
    larger = [p for p in result.candidates if p.micro_batch_size > 2 and p.fits]
    assert {p.micro_batch_size for p in larger} == {4, 8}
    assert all(p.relative_throughput > 1.0 for p in larger)
    assert result.chosen.is_given  # the given configuration fits: it is what choose_plan returns


def test_cost_model_orders_plans_as_documented():
    assert relative_throughput(8, False, 128, 8, False) == 1.0
    assert relative_throughput(4, False, 128, 8, False) < 1.0  # more accumulation, smaller micro-batches
    assert relative_throughput(8, True, 128, 8, False) == pytest.approx(1 / 1.33)


def test_divisors():
    assert divisors(1) == [1]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def test_bad_request_fails_fast():
    with pytest.raises(MemWatchConfigError):
        choose_plan(request(0, 1, 10**9))
    with pytest.raises(MemWatchConfigError):
        choose_plan(request(1, 1, "plenty"))
