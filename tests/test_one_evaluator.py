"""One remedy evaluator: the CLI's remedy table and plan, and the OOM post-mortem's savings, are the
chooser's candidates and predictions (``planning.chooser.PlanRequest``), not searches of their own.

Each path is compared with a fresh run of the planning core on the same input (the auto mode's
chooser, ``plan_run``, with the estimator as its predictor): a candidate missing from one path, a
figure from another search (e.g. a largest micro-batch beyond the effective batch) or another choice
fails the test.
"""

from __future__ import annotations

import json

import pytest
from conftest import gpt2_model
from transformers import GPT2Config

from hf_memwatch.cli.main import main
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.estimation.estimate import estimate
from hf_memwatch.planning.catalogue import REMEDIES, with_state_share
from hf_memwatch.planning.chooser import candidates, plan_run, setting_of
from hf_memwatch.planning.plan import Plan
from hf_memwatch.planning.predict import EstimatorPredictor
from hf_memwatch.reporting.oom import estimate_remedies

MICRO, SEQ_LEN = 2, 16


@pytest.fixture(scope="module")
def config_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0,
               architectures=["GPT2LMHeadModel"]).save_pretrained(path)
    return str(path / "config.json")


def test_cli_table_and_plan_are_the_choosers(config_json, capsys):
    configured = RunConfig(micro_batch_size=MICRO, seq_len=SEQ_LEN)
    given = estimate(config_json, **configured.estimate_kwargs())
    budget = given.peak_bytes - 1  # the run as given does not fit: the chooser must change it
    assert main(["estimate", config_json, "--micro-batch-size", str(MICRO), "--seq-len", str(SEQ_LEN),
                 "--budget", str(budget), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)

    # The auto mode's chooser on the same input, with a fresh predictor.
    run = with_state_share(configured, given)
    predictor = EstimatorPredictor(config_json, run)
    result = plan_run(run, predictor, budget)
    assert result.chosen is not None
    assert data["plan"] == dict(result.chosen.as_dict(), explain=result.chosen.reason)

    # The table: every setting of the chooser's candidates, no other, the run's own first.
    plans = candidates(run)
    settings = list(dict.fromkeys(setting_of(p) for p in plans))
    assert [(row["activation_checkpointing"], row["optim"]) for row in data["remedies"]] == settings
    assert len(settings) > 1 and data["remedies"][0]["remedy"] == "as given"
    for row in data["remedies"]:
        line = [p for p in plans if setting_of(p) == (row["activation_checkpointing"], row["optim"])]
        (at_micro,) = [p for p in line if p.micro_batch_size == MICRO]
        # the chooser's figures of these very candidates
        assert row["predicted_peak"] == predictor.peak(at_micro)
        assert row["peak_bytes"] == predictor.estimate(at_micro).peak_bytes
        assert row["fits"] == (predictor.peak(at_micro) <= budget)
        fitting = [p.micro_batch_size for p in line if predictor.peak(p) <= budget]
        assert row["largest_fitting_batch"] == max(fitting, default=0)
    assert data["largest_fitting_batch"] == data["remedies"][0]["largest_fitting_batch"]
    assert any(row["fits"] for row in data["remedies"]) and not data["remedies"][0]["fits"]


def test_post_mortem_savings_are_the_choosers_predictions():
    model = gpt2_model(n_layer=1, n_embd=32, vocab=100)
    config = RunConfig(micro_batch_size=MICRO, seq_len=SEQ_LEN)
    baseline, rows, note = estimate_remedies(model, config)
    assert note == ""

    predictor = EstimatorPredictor(model.config, config)
    given = Plan.of(config)
    assert baseline == predictor.estimate(given).peak_bytes
    run = with_state_share(config, predictor.estimate(given))
    # Each remedy alone, one step from the run, as the candidate it is (independently of the code under test).
    expected = {}
    for plan in candidates(run):
        changed = [r for r in REMEDIES if getattr(plan, r.field) != getattr(given, r.field)]
        if len(changed) != 1:
            continue
        (remedy,) = changed
        if remedy.field == "micro_batch_size" and plan.micro_batch_size != MICRO // 2:
            continue  # accumulation's one step: the next smaller micro-batch
        expected[remedy.describe(run, plan)] = predictor.estimate(plan).peak_bytes
    assert len(expected) == len(REMEDIES)  # accumulation, checkpointing, 8-bit AdamW all apply here
    savings = {text: baseline - peak for text, peak, _ in rows if peak is not None and not text.startswith("bf16")}
    assert savings == {text: baseline - peak for text, peak in expected.items()}
