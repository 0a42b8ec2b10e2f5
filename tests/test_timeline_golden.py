"""The timeline of a fixed small run, byte for byte (issue #34 point 5: records typed in flight must write
exactly what the dict-built records wrote).

A tiny GPT-2 (seed 0) trained 5 steps under ``MemWatch(auto=True, budget=3_000_000)`` with an eval loop every
2 steps and ``logging_steps=4``: a ``plan`` with remedies (checkpointing, 8-bit Adam), ``meta``, full steps
(1, 2, 4) with ``peak_tensors``, light steps (3, 5), the auto mode's ``footprint`` records and two ``eval``
loops with their snapshots. Every line is compared as written (key order and separators included), after the
fields that depend on the machine or the clock are replaced by ``"<varies>"``: ``time``, the plan's ``planning_seconds``, the host's sizes
(``host_rss``, ``host_vms``), the device's free and total bytes, and the footprint record's figures measured
from the host's resident size. The plan the callback saves in the Trainer's state is compared too.

Regenerate (only for a change of figures made on purpose, said in the commit):
``HF_MEMWATCH_REGENERATE_GOLDEN=1 pytest tests/test_timeline_golden.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import gpt2_model, token_dataset, training_args
from transformers import Trainer

from hf_memwatch import MemWatch

GOLDEN = Path(__file__).parent / "data" / "timeline_golden.jsonl"
VARIES = {"time", "host_rss", "host_vms", "device_free", "device_total", "planning_seconds"}
FOOTPRINT_VARIES = {"footprint_gap", "margin", "planned_need", "next_step_need", "fits"}  # from the host's RSS


def normalised(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the machine's and the clock's figures replaced, its key order kept."""
    varies = VARIES | (FOOTPRINT_VARIES if record.get("event") == "footprint" else set())
    return {key: "<varies>" if key in varies else value for key, value in record.items()}


def line(record: dict[str, Any]) -> str:
    return json.dumps(normalised(record), separators=(",", ":"))


def fixed_run(out: Path) -> tuple[list[str], str]:
    """The normalised timeline lines of the fixed run, and its saved plan as one line."""
    pytest.importorskip("bitsandbytes")  # the plan's 8-bit Adam
    watch = MemWatch(auto=True, budget=3_000_000, full_steps=2, report=False, summary=False, top_tensors=3)
    trainer = Trainer(
        model=gpt2_model(n_layer=1, n_embd=64, vocab=500), train_dataset=token_dataset(16, 32, 500),
        eval_dataset=token_dataset(4, 32, 500, seed=1), callbacks=[watch],
        args=training_args(out, per_device_train_batch_size=4, max_steps=5, eval_strategy="steps", eval_steps=2,
                           per_device_eval_batch_size=2, logging_steps=4))
    trainer.train()
    written = (out / "memwatch" / "timeline.jsonl").read_text().splitlines()
    saved = trainer.state.stateful_callbacks["MemWatch"]["attributes"]["auto_plan"]
    return [line(json.loads(text)) for text in written if text.strip()], line(saved)


def test_the_timeline_of_a_fixed_run_is_unchanged(tmp_path: Path) -> None:
    lines, saved = fixed_run(tmp_path)
    if os.environ.get("HF_MEMWATCH_REGENERATE_GOLDEN"):
        GOLDEN.write_text("\n".join([*lines, saved]) + "\n")
    *golden, golden_saved = GOLDEN.read_text().splitlines()
    assert len(lines) == len(golden)
    for number, (got, want) in enumerate(zip(lines, golden), start=1):
        assert got == want, f"timeline line {number} differs"
    assert saved == golden_saved  # the plan in the Trainer's state, as the callback saves it


def test_the_normalisation_keeps_what_the_golden_file_checks() -> None:
    """Only the machine's and the clock's figures are masked: a changed byte count or key order still fails."""
    record = {"event": "snapshot", "time": 1.5, "allocated": 10, "host_rss": 7}
    assert line(record) == '{"event":"snapshot","time":"<varies>","allocated":10,"host_rss":"<varies>"}'
    assert line({**record, "allocated": 11}) != line(record)
    assert line(dict(reversed(list(record.items())))) != line(record)
    assert line({"event": "footprint", "margin": 0.1}) != line({"event": "plan", "margin": 0.1})
