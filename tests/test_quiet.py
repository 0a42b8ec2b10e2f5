"""No stray output: a normal run prints nothing from MemWatch but its summary table and, once, where its files are.

The console (file descriptors 1 and 2, so C-level prints count too), the Python warnings and the
``hf_memwatch`` log records of a real Trainer run with ``MemWatch()`` are compared with the same run
without it. Transformers' own output is kept small (``disable_tqdm=True``, ``report_to=[]``, logging
only at the end) and is the same in both runs apart from timings.
"""

from __future__ import annotations

import io
import logging
import warnings

from conftest import gpt2_model, token_dataset, training_args
from rich.console import Console
from transformers import Trainer

from hf_memwatch import MemWatch
from hf_memwatch.reporting.summary import print_summary

FILES = "hf-memwatch: files in "


def captured_run(out_dir, callbacks, capfd) -> tuple[list[str], set[tuple[str, str]]]:
    """(console lines other than the Trainer's metric dicts, warnings as (category, message))."""
    capfd.readouterr()  # drop what came before
    trainer = Trainer(model=gpt2_model(n_embd=32), args=training_args(out_dir, logging_steps=100),
                      train_dataset=token_dataset(16, 16, 1000), callbacks=callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    out, err = capfd.readouterr()
    lines = [line for line in (out + err).splitlines() if not line.startswith("{'")]  # metrics: timings differ
    return lines, {(w.category.__name__, str(w.message)) for w in caught}


def summary_lines(out_dir) -> list[str]:
    """The summary table as MemWatch prints it (same console width: both write to a non-terminal)."""
    buffer = io.StringIO()
    print_summary(out_dir / "memwatch", console=Console(file=buffer))
    return buffer.getvalue().splitlines()


def extra_output(tmp_path, watch: MemWatch, capfd, caplog):
    plain_lines, plain_warnings = captured_run(tmp_path / "plain", [], capfd)
    with caplog.at_level(logging.DEBUG, logger="hf_memwatch"):
        lines, caught = captured_run(tmp_path / "watched", [watch], capfd)
    extra = [line for line in lines if line not in plain_lines]
    summary = summary_lines(tmp_path / "watched")
    unexplained = [line for line in extra if line not in summary and not line.startswith(("hf-memwatch plan:", FILES))]
    assert len([line for line in extra if line.startswith(FILES)]) == 1  # where the files are: once, at the end
    assert extra[-1].startswith(FILES)
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("hf_memwatch") and r.levelno >= logging.WARNING]
    return unexplained, caught - plain_warnings, ours, extra


def test_default_run_prints_only_its_summary(tmp_path, capfd, caplog):
    unexplained, new_warnings, ours, extra = extra_output(tmp_path, MemWatch(), capfd, caplog)
    assert unexplained == []
    assert new_warnings == set()
    assert ours == []
    assert any("hf-memwatch: peak step" in line for line in extra)  # the summary itself is there


def test_auto_run_prints_only_its_plan_line_and_summary(tmp_path, capfd, caplog):
    unexplained, new_warnings, ours, _ = extra_output(tmp_path, MemWatch(auto=True), capfd, caplog)
    assert (unexplained, new_warnings) == ([], set())
    assert len(ours) == 1 and ours[0].startswith("hf-memwatch plan: ")  # the plan line, nothing else


def test_added_with_add_callback_the_console_gets_no_raw_byte_counts(tmp_path, capfd):
    """``trainer.add_callback(MemWatch())`` puts it after the console printer: it is moved before it, so the
    printed logs carry no ``memory/*`` keys (the integrations, before the printer, still get them)."""
    capfd.readouterr()
    trainer = Trainer(model=gpt2_model(n_embd=32), args=training_args(tmp_path / "late", logging_steps=1, max_steps=2),
                      train_dataset=token_dataset(16, 16, 1000))
    trainer.add_callback(MemWatch(report=False))
    trainer.train()
    out, err = capfd.readouterr()
    logged = [line for line in (out + err).splitlines() if line.startswith("{'loss'")]
    assert len(logged) == 2 and not any("memory/" in line for line in logged)
