"""hf_memwatch.core.choices: the names an estimate takes, checked before torch is imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hf_memwatch.core.choices import DEVICES, PRECISIONS, SHARDS, TASKS, check_path
from hf_memwatch.core.errors import MemWatchConfigError


def test_a_missing_local_path_is_one_line_and_a_hub_id_is_left_to_the_loader(tmp_path) -> None:
    with pytest.raises(MemWatchConfigError, match=r"^.*nope/model: no such file or directory$"):
        check_path(str(tmp_path / "nope" / "model"))
    with pytest.raises(MemWatchConfigError, match="config.json: no such file"):
        check_path("config.json")
    check_path("gpt2")  # a hub id: the loader's to answer
    check_path(str(tmp_path))  # exists
    check_path(None)


def test_the_names_are_the_closed_sets_the_estimate_and_the_engines_take() -> None:
    assert "cuda" in DEVICES and "bf16" in PRECISIONS and "causal-lm" in TASKS
    assert "none" in SHARDS and "zero3" in SHARDS


def test_choices_import_neither_torch_nor_transformers() -> None:
    """The CLI checks its flags against these before any heavy import (a bad flag answers in ~0.2 s)."""
    code = "import sys, hf_memwatch.core.choices; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
