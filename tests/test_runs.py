"""One MemWatch, many runs (issue #21 point 4): a second Trainer is served fully, and
``hyperparameter_search`` keeps every trial's timeline and says which trial peaked highest."""

from __future__ import annotations

import json

import optuna
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import Trainer

from hf_memwatch import MemWatch
from hf_memwatch.integration.patches import ENTRY_POINTS, patched_names

QUIET = dict(report=False, summary=False)


def test_a_second_trainer_gets_its_own_timeline_guard_scalars_and_plan(tmp_path):
    watch = MemWatch(auto=True, budget="1GiB", **QUIET)
    trainers = []
    for name, batch in (("first", 2), ("second", 4)):
        args = training_args(tmp_path / name, per_device_train_batch_size=batch, max_steps=2)
        trainers.append(Trainer(model=gpt2_model(n_layer=1, n_embd=32, vocab=100), args=args,
                                train_dataset=token_dataset(8, 8, 100), callbacks=[watch]))
    for trainer in trainers:
        assert sorted(patched_names(trainer)) == sorted(ENTRY_POINTS)  # each has the guard's entry points
    for trainer in trainers:
        trainer.train()
    for name, trainer in zip(("first", "second"), trainers, strict=True):
        records = read_records(tmp_path / name)
        plans = [r for r in records if r["event"] == "plan"]
        assert len(plans) == 1 and plans[0].get("status") != "failed" and plans[0]["predicted_peak"] > 0, plans
        assert [r["step"] for r in records if r["event"] == "step"] == [1, 2]
        assert [e["memory/peak"] > 0 for e in trainer.state.log_history if "loss" in e] == [True, True]
    # The second run's plan is for its own configuration (micro-batch 4), not the first one's.
    second_plan = next(r for r in read_records(tmp_path / "second") if r["event"] == "plan")
    assert second_plan["configured"]["micro_batch_size"] == 4


def test_hyperparameter_search_keeps_every_trial_and_names_the_highest(tmp_path, capsys):
    watch = MemWatch(report=False, summary=True)
    args = training_args(tmp_path, max_steps=1)
    trainer = Trainer(model_init=lambda trial=None: gpt2_model(n_layer=1, n_embd=32, vocab=100), args=args,
                      train_dataset=token_dataset(8, 8, 100), eval_dataset=token_dataset(2, 8, 100),
                      callbacks=[watch])
    def space(trial):  # one trial at micro-batch 2, one at 8 (a grid)
        return {"per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [2, 8])}

    trainer.hyperparameter_search(hp_space=space, backend="optuna", n_trials=2, direction="minimize",
                                  compute_objective=lambda metrics: metrics["eval_loss"],
                                  sampler=optuna.samplers.GridSampler({"per_device_train_batch_size": [2, 8]}, seed=0))
    peaks, batches = {}, {}
    for trial in ("run-0", "run-1"):
        records = [json.loads(line) for line in (tmp_path / "memwatch" / trial / "timeline.jsonl").read_text().splitlines()]
        (step,) = [r for r in records if r["event"] == "step"]
        peaks[trial] = step["peak"]
        batches[next(r for r in records if r["event"] == "meta")["micro_batch_size"]] = trial
    assert sorted(batches) == [2, 8]  # each trial's own timeline, its own configuration
    summary = json.loads((tmp_path / "memwatch" / "trials.json").read_text())
    assert summary["trials"] == peaks
    big, small = batches[8], batches[2]
    assert peaks[big] > peaks[small] and summary["highest"] == big and summary["peak"] == peaks[big]
    assert f"trial {big} peaked highest of 2" in capsys.readouterr().out
