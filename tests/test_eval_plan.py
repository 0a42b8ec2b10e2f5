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
from hf_memwatch.estimation.request import EvalRequest
from hf_memwatch.planning.eval_plan import eval_candidates, plan_eval
from hf_memwatch.planning.plan import EvalSetting

SAMPLES, SEQ, VOCAB, GIVEN = 128, 32, 1000, 64


def _model():
    return gpt2_model(n_layer=1, n_embd=32, vocab=VOCAB)


def _predictor(model):
    def predict(setting: EvalSetting) -> int:
        return int(estimate_eval(model, EvalRequest(
            eval_batch_size=setting.eval_batch_size, eval_samples=SAMPLES, seq_len=SEQ,
            eval_accumulation_steps=setting.eval_accumulation_steps,
            preprocess_argmax=setting.preprocess_argmax)).peak_bytes)

    return predict


def _loop(batch: int, *, reduces: bool) -> EvalSetting:
    return EvalSetting(batch, None, preprocess_argmax=reduces)


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
    predict = _predictor(model)
    run = RunConfig(4, eval_batch_size=GIVEN, seq_len=SEQ, device="cpu")
    given, half = predict(_loop(GIVEN, reduces=True)), predict(_loop(GIVEN // 2, reduces=True))
    assert half < given  # each batch's logits weigh: a smaller eval batch needs less
    budget = (given + half) // 2
    plan = plan_eval(run, predict, budget, _loop(GIVEN, reduces=True))
    assert (plan.eval_batch_size, plan.eval_accumulation_steps) == (GIVEN // 2, None)  # the largest that fits
    assert plan.eval_predicted_peak == half <= budget and "-> 32" in plan.reason
    assert [s.eval_batch_size for s in eval_candidates(run)] == [64, 32, 16, 8, 4, 2, 1]  # on the CPU: the batch only
    # The truth: the loop as given goes over the budget, the planned one stays within it.
    assert _measured_eval_peak(tmp_path, model, GIVEN) > budget
    assert _measured_eval_peak(tmp_path, model, plan.eval_batch_size) <= budget


def test_an_eval_that_fits_as_given_is_left_as_given() -> None:
    model = _model()
    predict = _predictor(model)
    run = RunConfig(4, eval_batch_size=GIVEN, seq_len=SEQ, device="cpu")
    plan = plan_eval(run, predict, predict(_loop(GIVEN, reduces=True)), _loop(GIVEN, reduces=True))
    assert (plan.eval_batch_size, plan.eval_accumulation_steps) == (GIVEN, None) and "as given fits" in plan.reason
    assert plan.record_fields()["eval_batch_size"] == GIVEN


def test_outputs_no_eval_batch_can_hold_name_the_metrics_change_and_its_saving() -> None:
    model = _model()
    predict = _predictor(model)  # the loop keeps every batch's logits
    run = RunConfig(4, eval_batch_size=GIVEN, seq_len=SEQ, device="cpu")
    smallest = predict(_loop(1, reduces=False))
    with pytest.raises(PlanError, match="preprocess_logits_for_metrics") as raised:
        plan_eval(run, predict, smallest - 1)
    saved = predict(_loop(GIVEN, reduces=False)) - predict(_loop(GIVEN, reduces=True))
    assert saved > 0
    assert f"{format_bytes(saved)} saved" in str(raised.value)


def test_an_eval_remedy_added_to_the_catalogue_reaches_the_planner_and_the_post_mortem(monkeypatch) -> None:
    """One place: an entry of ``catalogue.EVAL_REMEDIES`` is a candidate of the eval planner (applied)
    and a row of the eval post-mortem (applied alone, one step from the loop)."""
    from hf_memwatch.planning import catalogue, eval_plan, remedies

    run = RunConfig(4, eval_batch_size=4, seq_len=SEQ, device="cuda", eval_accumulation_steps=2)
    wider = catalogue.Remedy("eval accumulation, every 4", "eval_accumulation_steps", lambda run: None,
                             lambda run: [run.eval_accumulation_steps, 4], lambda run, v, options: 4,
                             lambda run, s: "eval_accumulation_steps=4")
    before = [(s.eval_batch_size, s.eval_accumulation_steps) for s in eval_candidates(run)]
    assert before == [(4, 2), (2, 2), (1, 2)]
    monkeypatch.setattr(eval_plan, "EVAL_REMEDIES", (*catalogue.EVAL_REMEDIES, wider))
    monkeypatch.setattr(remedies, "EVAL_REMEDIES", (*catalogue.EVAL_REMEDIES, wider))
    after = [(s.eval_batch_size, s.eval_accumulation_steps) for s in eval_candidates(run)]
    assert after == [(4, 2), (4, 4), (2, 2), (2, 4), (1, 2), (1, 4)]  # its options crossed with the others'
    rows = remedies.eval_single_steps(run, EvalSetting.of(run))
    assert [text for text, _, _ in rows][-1] == "eval_accumulation_steps=4"
    assert [text.split(" ")[0] for text, _, _ in rows][:2] == ["per_device_eval_batch_size", "eval_accumulation_steps=1"]
