"""``planning/eval_plan.py``: the eval batch planned against a budget, predicted by the real estimator
(``estimate_eval``) and checked on a real ``Trainer.evaluate()`` (tiny GPT-2, logits reduced by
``preprocess_logits_for_metrics`` so each batch's own logits make the loop's peak)."""

from __future__ import annotations

import pytest
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import Trainer

from hf_memwatch import MemWatch, PlanError
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.core.units import format_bytes
from hf_memwatch.estimation.estimate import estimate_eval
from hf_memwatch.planning.eval_plan import eval_candidates, plan_eval

SAMPLES, SEQ, VOCAB, GIVEN = 128, 32, 1000, 64


def _model():
    return gpt2_model(n_layer=1, n_embd=32, vocab=VOCAB)


def _predictor(model, *, reduces: bool):
    def predict(batch: int, steps: int | None, argmax: bool = reduces) -> int:
        return int(estimate_eval(model, eval_batch_size=batch, eval_samples=SAMPLES, seq_len=SEQ,
                                 eval_accumulation_steps=steps, preprocess_argmax=argmax).peak_bytes)

    return predict


def _measured_eval_peak(tmp_path, model, batch: int) -> int:
    args = training_args(tmp_path / f"eval{batch}", per_device_eval_batch_size=batch)
    trainer = Trainer(model=model, args=args, eval_dataset=token_dataset(SAMPLES, SEQ, VOCAB, seed=1),
                      preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
                      callbacks=[MemWatch(report=False, summary=False)])
    trainer.evaluate()
    [loop] = [r for r in read_records(tmp_path / f"eval{batch}") if r["event"] == "eval"]
    return int(loop["peak"])


def test_the_fastest_eval_batch_that_fits_is_chosen_and_fits_a_real_evaluate(tmp_path) -> None:
    model = _model()
    predict = _predictor(model, reduces=True)
    run = RunConfig(4, eval_batch_size=GIVEN, seq_len=SEQ, device="cpu")
    given, half = predict(GIVEN, None), predict(GIVEN // 2, None)
    assert half < given  # each batch's logits weigh: a smaller eval batch needs less
    budget = (given + half) // 2
    plan = plan_eval(run, predict, budget)
    assert (plan.eval_batch_size, plan.eval_accumulation_steps) == (GIVEN // 2, None)  # the largest that fits
    assert plan.eval_predicted_peak == half <= budget and "-> 32" in plan.reason
    assert [batch for batch, _ in eval_candidates(run)] == [64, 32, 16, 8, 4, 2, 1]  # on the CPU: the batch only
    # The truth: the loop as given goes over the budget, the planned one stays within it.
    assert _measured_eval_peak(tmp_path, model, GIVEN) > budget
    assert _measured_eval_peak(tmp_path, model, plan.eval_batch_size) <= budget


def test_an_eval_that_fits_as_given_is_left_as_given() -> None:
    model = _model()
    predict = _predictor(model, reduces=True)
    run = RunConfig(4, eval_batch_size=GIVEN, seq_len=SEQ, device="cpu")
    plan = plan_eval(run, predict, predict(GIVEN, None))
    assert (plan.eval_batch_size, plan.eval_accumulation_steps) == (GIVEN, None) and "as given fits" in plan.reason
    assert plan.record_fields()["eval_batch_size"] == GIVEN


def test_outputs_no_eval_batch_can_hold_name_the_metrics_change_and_its_saving() -> None:
    model = _model()
    predict = _predictor(model, reduces=False)  # the loop keeps every batch's logits
    run = RunConfig(4, eval_batch_size=GIVEN, seq_len=SEQ, device="cpu")
    smallest = predict(1, None)
    with pytest.raises(PlanError, match="preprocess_logits_for_metrics") as raised:
        plan_eval(run, predict, smallest - 1)
    saved = predict(GIVEN, None) - predict(GIVEN, None, argmax=True)
    assert saved > 0
    assert f"{format_bytes(saved)} saved" in str(raised.value)
