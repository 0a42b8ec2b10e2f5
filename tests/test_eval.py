"""Evaluation and prediction loops: watched (profiler truth), predicted (estimator), post-mortem (a real
CPU OOM in an eval loop: tests/test_oom.py, beside the training one, in the same subprocess)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import Trainer

from hf_memwatch import MemWatch, PlanError
from hf_memwatch.core.categories import EVAL_LIVE_CLASSES
from hf_memwatch.measure.attribution import optimizer_state_storages, weight_storages
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak


def accuracy(prediction) -> dict[str, float]:
    """A user's compute_metrics: next-token accuracy from the full logits (numpy, as the Trainer hands them)."""
    predicted = prediction.predictions.argmax(-1)[:, :-1]
    labels = prediction.label_ids[:, 1:]
    return {"accuracy": float((predicted == labels).mean())}


def _scenario_trainer(out_dir, **overrides):
    """The issue's scenario, scaled: tiny causal LM (vocab 1000), eval batch large, compute_metrics set."""
    model = gpt2_model(n_layer=2, n_embd=32, vocab=1000)
    values = dict(max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=64)
    values.update(overrides)
    args = training_args(out_dir, **values)
    return Trainer(model=model, args=args, train_dataset=token_dataset(16, 32, 1000),
                   eval_dataset=token_dataset(256, 32, 1000, seed=1), compute_metrics=accuracy,
                   callbacks=[MemWatch(detail="full", report=False, summary=False)])


def _live_before(trainer) -> int:
    """Bytes PyTorch holds before a profiled window: weights and optimizer state (grads are None)."""
    model = trainer.model
    storages = weight_storages(model, None)
    storages.update(optimizer_state_storages(trainer.optimizer, None))
    return sum(storages.values())


def test_evaluate_is_watched_and_its_peak_matches_the_profiler(out_dir):
    trainer = _scenario_trainer(out_dir)
    trainer.train()
    baseline = _live_before(trainer)
    with cpu_memory_profile() as prof:
        metrics = trainer.evaluate()
    truth = window_peak(prof, baseline)
    records = read_records(out_dir)
    (loop,) = [r for r in records if r["event"] == "eval"]
    train_peak = max(r["peak"] for r in records if r["event"] == "step")

    assert loop["stage"] == "eval" and loop["step"] == 2 and loop["batches"] == 4
    assert abs(loop["peak"] - truth) / truth <= 0.02, (loop["peak"], truth)
    assert loop["peak"] > 3 * train_peak  # the eval loop, not training, is the run's highest moment
    # The accumulated logits (256 x 32 x 1000 fp32) and labels are the outputs class at the end.
    logits, labels = 256 * 32 * 1000 * 4, 256 * 32 * 8
    assert loop["outputs"] >= logits + labels
    assert loop["live"]["outputs"] >= logits * 3 // 4  # at the peak: the last concatenation
    snaps = [r for r in records if r["event"] == "snapshot" and r.get("stage") == "eval"]
    assert {s["phase"] for s in snaps} == {"eval_begin", "eval_forward", "eval_accumulated", "eval_end"}
    assert [s["batch"] for s in snaps if s["phase"] == "eval_forward"] == [0, 1, 2]  # the first batches
    for snap in snaps:
        assert set(snap["live"]) == set(EVAL_LIVE_CLASSES)
        assert sum(snap["live"].values()) == snap["allocated"]
    growing = [s["outputs"] for s in snaps if s["phase"] == "eval_accumulated"]
    assert growing == sorted(growing) and growing[0] > 0
    assert metrics["eval_accuracy"] >= 0 and "memory/eval_peak" not in metrics


def test_predict_is_recorded_as_its_own_stage(out_dir):
    trainer = _scenario_trainer(out_dir, per_device_eval_batch_size=32)
    output = trainer.predict(token_dataset(64, 32, 1000, seed=2))
    (loop,) = [r for r in read_records(out_dir) if r["event"] == "eval"]
    assert loop["stage"] == "predict" and loop["step"] == 0 and loop["batches"] == 2
    # Trainer.predict hands the predictions back: on the CPU they are views of torch storage.
    assert loop["outputs"] >= output.predictions.nbytes
    assert isinstance(output.predictions, np.ndarray)
    # A train() after it continues the timeline the prediction opened instead of wiping it.
    trainer.train()
    records = read_records(out_dir)
    assert [r["stage"] for r in records if r["event"] == "eval"] == ["predict"]
    assert [r["step"] for r in records if r["event"] == "step"] == [1, 2]


def test_eval_during_training_keeps_training_figures_apart(out_dir):
    trainer = _scenario_trainer(out_dir, max_steps=4, eval_strategy="steps", eval_steps=2,
                                per_device_eval_batch_size=128)
    trainer.train()
    records = read_records(out_dir)
    loops = [r for r in records if r["event"] == "eval"]
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in loops] == [2, 4]
    assert len(steps) == 4
    # The eval loop's peak (≈ 2 × 16 MiB of logits) never shows in a training step's figures.
    assert max(s["peak"] for s in steps) * 3 < min(r["peak"] for r in loops)
    train_snaps = [r for r in records if r["event"] == "snapshot" and "stage" not in r]
    assert max(s["peak"] for s in train_snaps) * 3 < min(r["peak"] for r in loops)
    eval_logs = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["memory/eval_peak"] for e in eval_logs] == [r["peak"] for r in loops]
    for entry, loop in zip(eval_logs, loops, strict=True):
        classes = sum(entry[f"memory/eval_{name}"] for name in EVAL_LIVE_CLASSES)
        assert classes + entry["memory/eval_spike"] == loop["peak"]

    # The picture marks each loop at its peak; the summary names the eval loop as the run's highest moment.
    from hf_memwatch.reporting.report import draw, load_run
    from hf_memwatch.reporting.summary import highest_moment, load_eval_records, load_summary_inputs

    (run,) = load_run(out_dir)
    assert [e.to_dict() for e in run.evals] == loops and all(s.stage is None for s in run.snapshots)
    figure = draw([run])
    labels = figure.axes[0].get_legend_handles_labels()[1]
    assert "eval / predict loop (its peak)" in labels
    assert max(figure.axes[0].get_ylim()) * 2**20 >= max(r["peak"] for r in loops)
    step_records = load_summary_inputs(out_dir)[0]
    top = max(loops, key=lambda r: r["peak"])
    line = highest_moment(step_records, load_eval_records(out_dir))
    assert line.startswith(f"highest moment of the run: the eval loop after step {top['step']}, batch "
                           f"{top['peak_batch']} — {top['peak'] / 2**20:.2f} MiB"), line


def test_monitoring_changes_neither_eval_metrics_nor_eval_memory(tmp_path):
    def run(callbacks):
        torch.manual_seed(0)
        trainer = _scenario_trainer(tmp_path / str(len(callbacks)), max_steps=2)
        trainer.remove_callback(MemWatch)
        for cb in callbacks:
            trainer.add_callback(cb)
        trainer.train()
        baseline = _live_before(trainer)
        with cpu_memory_profile() as prof:
            metrics = trainer.evaluate()
        return metrics, window_peak(prof, baseline)

    (with_watch, peak_with), (without, peak_without) = run([MemWatch(report=False, summary=False)]), run([])
    for key in ("eval_loss", "eval_accuracy"):
        assert with_watch[key] == without[key]
    # Not a byte more: nothing of ours keeps a batch's logits alive (frame.f_locals would, on 3.11).
    assert peak_with == peak_without


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(min(2, torch.get_num_threads()))


# -- predicted: the estimator's eval loop against real Trainer.evaluate() runs ------------------------


@pytest.mark.parametrize(
    ("builder", "task", "batch", "samples", "seq_len", "steps", "loss_only"),
    [
        ("gpt2", "causal-lm", 32, 96, 32, None, False),
        ("gpt2", "causal-lm", 8, 200, 16, 4, False),  # 25 batches: fast-forwarded between the replayed ones
        ("bert", "seq-cls", 16, 48, 32, None, False),
        ("gpt2", "causal-lm", 16, 48, 32, None, True),
    ],
)
def test_eval_estimate_within_1_percent_of_a_real_evaluate(builder, task, batch, samples, seq_len, steps, loss_only):
    from conftest import bert_model

    from hf_memwatch.estimation import estimate_eval
    from hf_memwatch.testing.estimate_truth import evaluate_peak

    model = gpt2_model(n_layer=2, n_embd=32) if builder == "gpt2" else bert_model(hidden=32)
    predicted = estimate_eval(model, eval_batch_size=batch, eval_samples=samples, seq_len=seq_len,
                              eval_accumulation_steps=steps, prediction_loss_only=loss_only)
    truth = evaluate_peak(model, task=task, batch_size=batch, samples=samples, seq_len=seq_len,
                          accumulation_steps=steps, prediction_loss_only=loss_only)
    assert abs(predicted.peak_bytes - truth) / truth <= 0.01, (predicted, truth)
    assert sum(predicted.classes.values()) == predicted.peak_bytes
    if not loss_only and task == "causal-lm":
        assert predicted.classes["outputs"] > predicted.classes["weights"]


def test_estimate_gains_eval_fields_and_the_cli_flags(tmp_path, capsys):
    """The CLI's eval flags through its ``main`` in this process (a subprocess costs an import of torch and
    transformers, ~10 CPU s each; the console script's exit statuses: tests/test_cli_estimate.py)."""
    import json

    from transformers import GPT2Config

    from hf_memwatch.cli.main import main
    from hf_memwatch.estimation import estimate

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=1000, n_positions=256,
                        architectures=["GPT2LMHeadModel"], bos_token_id=0, eos_token_id=0)
    plain = estimate(config, micro_batch_size=4, seq_len=32)
    assert plain.eval_peak_bytes is None and plain.eval_classes is None and plain.eval_peak_phase is None
    both = estimate(config, micro_batch_size=4, seq_len=32, eval_batch_size=64, eval_samples=256)
    assert both.peak_bytes == plain.peak_bytes
    assert both.eval_peak_bytes > 10 * both.peak_bytes and both.eval_peak_phase == "eval_accumulate"
    assert sum(both.eval_classes.values()) == both.eval_peak_bytes
    # Inside train() the optimizer state is live beside the loop.
    assert both.eval_classes["optimizer_states"] == plain.classes["optimizer_states"] > 0
    standalone = estimate(config, micro_batch_size=4, seq_len=32, eval_batch_size=64, eval_samples=256,
                          eval_in_training=False)
    assert standalone.eval_peak_bytes == both.eval_peak_bytes - plain.classes["optimizer_states"]

    config.save_pretrained(tmp_path)
    capsys.readouterr()
    status = main(["estimate", str(tmp_path), "--micro-batch-size", "4", "--seq-len", "32", "--eval-batch-size", "64",
                   "--eval-samples", "256", "--eval-accumulation-steps", "2", "--json"])
    out = capsys.readouterr()
    assert status == 0, out.err[-2000:]
    payload = json.loads(out.out)
    with_steps = estimate(config, micro_batch_size=4, seq_len=32, eval_batch_size=64, eval_samples=256,
                          eval_accumulation_steps=2)
    assert payload["eval_peak_bytes"] == with_steps.eval_peak_bytes
    assert payload["eval_classes"] == with_steps.eval_classes and payload["eval_peak_phase"]
    assert main(["estimate", str(tmp_path), "--eval-batch-size", "8"]) == 2
    assert "eval_samples" in capsys.readouterr().err


def _argmax(logits, labels):
    return logits.argmax(-1)


def _token_accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((prediction.predictions[:, :-1] == prediction.label_ids[:, 1:]).mean())}


def _planned_trainer(out_dir, callbacks, *, reduce=True, **overrides):
    """Eval with the logits reduced to tokens (small outputs): the eval batch's own logits dominate."""
    model = gpt2_model(n_layer=2, n_embd=32, vocab=1000)
    values = dict(max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=64, eval_strategy="steps",
                  eval_steps=2)
    values.update(overrides)
    return Trainer(model=model, args=training_args(out_dir, **values), train_dataset=token_dataset(16, 32, 1000),
                   eval_dataset=token_dataset(256, 32, 1000, seed=1),
                   compute_metrics=_token_accuracy if reduce else accuracy,
                   preprocess_logits_for_metrics=_argmax if reduce else None, callbacks=callbacks)


def test_auto_mode_plans_evaluation_too(tmp_path):
    """A budget between the training peak and the eval peak: the eval batch is planned before training, the
    eval loop fits, the metrics are those of the hand-configured run."""
    given = _planned_trainer(tmp_path / "given", [MemWatch(detail="full", report=False, summary=False)])
    given.train()
    records = read_records(tmp_path / "given")
    train_peak = max(r["peak"] for r in records if r["event"] == "step")
    eval_peak = max(r["peak"] for r in records if r["event"] == "eval")
    budget = (train_peak + eval_peak) // 2
    assert train_peak < budget < eval_peak

    auto = _planned_trainer(tmp_path / "auto", [MemWatch(auto=True, budget=budget, detail="full", report=False,
                                                         summary=False)])
    auto.train()
    records = read_records(tmp_path / "auto")
    [plan] = [r for r in records if r["event"] == "plan"]
    [loop] = [r for r in records if r["event"] == "eval"]
    assert plan["eval_batch_size"] < 64 and plan["eval_predicted_peak"] <= budget
    assert loop["peak"] <= budget and loop["peak"] <= plan["eval_predicted_peak"]
    assert auto.args.per_device_eval_batch_size == plan["eval_batch_size"]

    hand = _planned_trainer(tmp_path / "hand", [], per_device_eval_batch_size=plan["eval_batch_size"])
    hand.train()
    metrics = [{k: v for k, v in e.items() if not k.startswith("memory/") and not k.endswith(("runtime", "per_second"))}
               for t in (auto, hand) for e in t.state.log_history if "eval_loss" in e]
    assert metrics[0] == metrics[1]


def test_only_a_metrics_change_would_fit_stops_before_training(tmp_path):
    # Logits of 256 x 32 tokens x 1000 words (32 MiB) kept by the loop: no eval batch fits 24 MiB.
    trainer = _planned_trainer(tmp_path, [MemWatch(auto=True, budget="24MiB", report=False, summary=False)],
                               reduce=False)
    with pytest.raises(PlanError, match=r"preprocess_logits_for_metrics .* saved"):
        trainer.train()
    assert trainer.state.global_step == 0 and trainer.args.per_device_eval_batch_size == 64  # nothing changed


def test_the_eval_split_is_the_same_on_a_cold_and_a_warm_fake_tensor_cache():
    """The second batch's concatenation may take the address the first batch's predictions freed: held
    outputs are matched by the tracker's reference, not by key (a key read before the concatenation
    was overwritten by the new storage's, and 512,000 B of predictions became temporaries, on a warm
    ``FakeTensorMode`` dispatch cache only: every estimate after a process's first)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import LlamaConfig

    from hf_memwatch import estimate

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)
    FakeTensorMode.cache.clear()  # class-wide: what the process's earlier fake tensors left
    cold, warm = (estimate(config, micro_batch_size=2, seq_len=64, device="cpu", eval_batch_size=2, eval_samples=4)
                  for _ in range(2))
    assert warm.eval_classes == cold.eval_classes
    assert cold.eval_classes["outputs"] >= 2 * 2 * 64 * 1000 * 4  # both batches' fp32 logits held
