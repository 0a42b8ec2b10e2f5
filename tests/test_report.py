"""The picture, the CLI and the console summary, from the timeline of a real Trainer run."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import matplotlib.image
import pytest
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import Trainer

from hf_memwatch import LIVE_CLASSES, MemWatch, MemWatchConfigError
from hf_memwatch.cli import main as cli  # the dispatcher module
from hf_memwatch.reporting.report import choose_unit, draw, load_run
from hf_memwatch.reporting.sinks import composition_at_peak
from hf_memwatch.reporting.summary import load_summary_inputs, summary_rows

BUDGET = 40 * 2**20


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One real run with the auto mode (a plan and a budget), 2 micro-batches per step."""
    out = tmp_path_factory.mktemp("report") / "run"
    model = gpt2_model()
    args = training_args(out, max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    watch = MemWatch(auto=True, budget=BUDGET)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(16, 32, 1000), callbacks=[watch])
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        trainer.train()
    assert watch.wait_for_reports() is not None  # drawn by a background process
    return {"out": out, "console": console.getvalue(), "model": model, "records": read_records(out)}


def test_train_end_writes_a_readable_picture(run):
    png = run["out"] / "memwatch" / "memory.png"
    image = matplotlib.image.imread(png)
    assert image.shape[0] >= 500 and image.shape[1] >= 1200  # a figure, not an empty canvas


def test_picture_shows_the_timeline_figures(run):
    records = run["records"]
    steps = [r for r in records if r["event"] == "step"]
    (plan,) = [r for r in records if r["event"] == "plan"]
    runs = load_run(run["out"])
    fig = draw(runs)
    (ax,) = fig.axes
    unit, scale = choose_unit(max(plan["budget"], *(s["peak"] for s in steps)))
    assert ax.get_ylabel() == f"memory ({unit})"
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["step peak"].get_ydata()) == pytest.approx([s["peak"] / scale for s in steps])
    budget_line = next(v for k, v in lines.items() if k.startswith("budget"))
    assert budget_line.get_ydata()[0] == pytest.approx(plan["budget"] / scale)
    predicted = next(v for k, v in lines.items() if k.startswith("predicted peak"))
    assert predicted.get_ydata()[0] == pytest.approx(plan["predicted_peak"] / scale)
    assert any(text.get_text().startswith("plan: micro-batch") for text in ax.texts)
    title = fig._suptitle.get_text()
    assert "GPT2LMHeadModel" in title and f"batch {plan['micro_batch_size']} × accum" in title
    # The stacked layers: what stays (weights, optimizer states) below what each step makes, the spike on top.
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[: len(LIVE_CLASSES)] == ["weights", "optimizer states", "gradients",
                                          "activations (saved for backward)", "other (inputs, logits, buffers)"]
    assert any(label.startswith("spike") for label in legend)


def test_console_summary_adds_up_to_the_peak_and_shows_bytes_per_param(run):
    console, model = run["console"], run["model"]
    steps, meta, plan, snapshots = load_summary_inputs(run["out"])
    top = max(steps, key=lambda s: s.peak)
    step_snaps = [s for s in snapshots if s.step == top.step]
    rows = {row["class"]: row for row in summary_rows(top, meta, step_snaps)}
    live, allocated = composition_at_peak(top, step_snaps)
    assert sum(row["bytes"] for row in rows.values()) == allocated + top.spike_at_peak == top.peak
    assert sum(row["share"] for row in rows.values()) == pytest.approx(1.0)
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert rows["weights"]["bytes_per_param"] == pytest.approx(weight_bytes / params)  # 4.00 in fp32
    assert rows["optimizer_states"]["rule"] == 8 and rows["gradients"]["rule"] == 4
    assert f"hf-memwatch: peak step {top.step}" in console
    assert f"{weight_bytes / params:.2f}" in console
    assert f"plan in force: micro-batch {plan.micro_batch_size}" in console


def cli_main(argv: list[str]) -> int:
    return cli.main(argv)


@pytest.fixture(autouse=True)
def only_the_report_subcommand(monkeypatch):
    """The dispatcher imports every subcommand; test ``report`` alone (``estimate`` has its own tests)."""
    monkeypatch.setattr(cli, "SUBCOMMANDS", {"report": cli.SUBCOMMANDS["report"]})


def test_cli_draws_png_and_html_with_one_panel_per_rank(run, tmp_path, capsys):
    # A second rank's timeline: rank 0's records relabelled, the layout a 2-process run leaves.
    folder = tmp_path / "memwatch"
    shutil.copytree(run["out"] / "memwatch", folder)
    lines = [json.loads(line) for line in (folder / "timeline.jsonl").read_text().splitlines()]
    for record in lines:
        record["rank"] = 1
        if record["event"] == "snapshot":
            record["allocated"] += 2**20  # rank 1 holds 1 MiB more
    (folder / "timeline.rank1.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")

    assert cli_main(["report", str(tmp_path), "-o", str(tmp_path / "m.png")]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "m.png").stat().st_size > 10_000
    fig = draw(load_run(tmp_path))
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["rank 0", "rank 1"]

    assert cli_main(["report", str(folder / "timeline.jsonl"), "-o", str(tmp_path / "m.html")]) == 0
    page = (tmp_path / "m.html").read_text()
    assert "<img" not in page and "id='plotly-gzip'" in page  # the interactive page: the chart, no picture drawn
    steps = [r for r in run["records"] if r["event"] == "step"]
    assert page.count("<tr><td>") == len(steps)


def test_cli_errors_are_one_line_and_status_2(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path), "-o", str(tmp_path / "m.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-memwatch report: error:") and "timeline" in err and "\n" not in err
    (tmp_path / "timeline.jsonl").write_text('{"event": "snapshot", "allocated": null}\n')
    assert cli_main(["report", str(tmp_path), "-o", str(tmp_path / "m.svg")]) == 2
    assert "-o must end in .png (the picture) or .html (the page)" in capsys.readouterr().err


def test_report_sync_draws_before_train_returns_and_bad_values_fail(tmp_path):
    out = tmp_path / "sync"
    trainer = Trainer(model=gpt2_model(n_layer=1, n_embd=32), args=training_args(out, max_steps=1),
                      train_dataset=token_dataset(4, 16, 1000), callbacks=[MemWatch(report="sync", summary=False)])
    trainer.train()
    assert matplotlib.image.imread(out / "memwatch" / "memory.png").shape[0] > 100  # no waiting
    with pytest.raises(MemWatchConfigError, match="report"):
        MemWatch(report="later")


def test_background_picture_never_writes_into_a_removed_run_folder(run, tmp_path):
    """The run's folder removed after ``train()`` returned (a TemporaryDirectory left, a sweep cleaning
    up) while the detached child still draws: it must not create the folder again nor write into it
    (transformers' test_resume_training_with_frozen_params failed in TemporaryDirectory cleanup with
    "Directory not empty: 'memwatch'", the child having written its picture during the removal)."""
    from hf_memwatch.reporting.background import main as draw_in_background

    gone = tmp_path / "removed-run" / "memwatch"
    assert draw_in_background([str(run["out"] / "memwatch"), str(gone / "memory.png")]) == 0
    assert not (tmp_path / "removed-run").exists()
    assert draw_in_background([str(tmp_path / "no-timeline"), str(gone / "memory.png")]) == 1
    assert not (tmp_path / "removed-run").exists()  # no failure log either: it would recreate the folder
    kept = tmp_path / "kept"
    kept.mkdir()
    assert draw_in_background([str(run["out"] / "memwatch"), str(kept / "memory.png")]) == 0
    assert sorted(p.name for p in kept.iterdir()) == ["memory.png"]  # no partial file left beside it


def test_events_are_words_and_the_plan_label_names_its_remedies(run):
    """The page's event list says the plan in words (not the record's raw dict), and the plan's label
    names checkpointing when the plan holds it."""
    from hf_memwatch.reporting.page import render_html
    from hf_memwatch.reporting.run_view import event_label, event_text

    (rank,) = load_run(run["out"])
    (plan,) = [e for e in rank.events if e.EVENT == "plan"]
    assert event_label(plan).endswith(", checkpointing") == bool(plan.activation_checkpointing)
    assert event_text(plan).startswith(event_label(plan)) and plan.reason in event_text(plan)
    page = render_html([rank], None, interactive=False)
    assert "{&#x27;" not in page and "{'" not in page  # no raw record dict
    assert f"<li>{event_label(plan)}" in page
    assert event_label(plan.replace(activation_checkpointing=True)).endswith(", checkpointing")
    assert event_label(plan.replace(activation_checkpointing=False, optim="adamw_bnb_8bit")).endswith(
        "× accum " + str(plan.gradient_accumulation_steps or 1) + ", adamw_bnb_8bit")


def test_two_runs_side_by_side(run, tmp_path, capsys):
    """``hf-memwatch report RUN_A RUN_B``: a panel per run, named by its path, on shared axes; the page of a
    comparison is the static one (picture and each run's steps table)."""
    from hf_memwatch.reporting.report import load_runs

    other = tmp_path / "other"
    shutil.copytree(run["out"] / "memwatch", other / "memwatch")
    paths = [str(run["out"]), str(other)]
    assert cli_main(["report", *paths, "-o", str(tmp_path / "compare.png")]) == 0
    assert "(2 ranks of 2 runs" in capsys.readouterr().out
    assert matplotlib.image.imread(tmp_path / "compare.png").shape[0] > 500
    fig = draw(load_runs(paths))
    assert [ax.get_title(loc="left") for ax in fig.axes] == [f"{p} rank 0" for p in paths]
    assert cli_main(["report", *paths, "-o", str(tmp_path / "compare.html")]) == 0
    page = (tmp_path / "compare.html").read_text()
    assert all(f"<h2>{p} rank 0: steps</h2>" in page for p in paths) and "plotly" not in page.lower()


def test_the_picture_on_wall_clock_seconds(run, tmp_path, capsys):
    """``--x seconds``: the picture's x-axis in seconds since the first snapshot, each step's peak
    marker at the middle of its phase in time, as the page's seconds button puts it."""
    from hf_memwatch.reporting.report import peak_index
    from hf_memwatch.reporting.timeaxis import time_positions

    (rank,) = load_run(run["out"])
    seconds = [round(s.time - rank.snapshots[0].time, 3) for s in rank.snapshots]
    fig = draw([rank], x_axis="seconds")
    (ax,) = fig.axes
    assert ax.get_xlabel().startswith("seconds since the first snapshot")
    markers = next(line for line in ax.get_lines() if line.get_label() == "step peak")
    expected = [time_positions([i - 0.5 if i else 0], seconds)[0] for i, _ in peak_index(rank)]
    assert list(markers.get_xdata()) == pytest.approx(expected)
    assert 0 < max(expected) <= seconds[-1] == pytest.approx(ax.get_xlim()[1])
    assert cli_main(["report", str(run["out"]), "-o", str(tmp_path / "s.png"), "--x", "seconds"]) == 0
    assert matplotlib.image.imread(tmp_path / "s.png").shape[1] >= 1200
    with pytest.raises(MemWatchConfigError, match="x-axis is one of steps, seconds"):
        draw([rank], x_axis="time")
