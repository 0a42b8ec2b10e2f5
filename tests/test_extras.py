"""Every optional package missing: one line naming what is off and the ``pip install hf-memwatch[extra]``
that turns it on, and the documented fallback written (hf_memwatch/core/extras.py).

"Not installed" is simulated in a subprocess whose ``sys.meta_path`` finders find nothing for the
package (tests/without.py): ``import`` raises ``ModuleNotFoundError`` and ``find_spec`` is None, as for
an absent package; transformers' own availability checks read it as absent too. The run trains a real
tiny GPT-2 with ``MemWatch()`` in such a process. ``make test-minimal`` (in ``.ci/run``) runs this file
again in a venv with only the required dependencies installed, where nothing needs simulating.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_memwatch.core.extras import EXTRAS, install_hint, installed, off_line

TESTS = Path(__file__).parent
ROOT = TESTS.parent

RUN_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from conftest import gpt2_model, token_dataset, training_args
from transformers import Trainer
from hf_memwatch import MemWatch

watch = MemWatch()
trainer = Trainer(model=gpt2_model(n_embd=32), args=training_args({out!r}, max_steps=2),
                  train_dataset=token_dataset(8, 16, 1000), callbacks=[watch])
trainer.train()
print("waited for:", watch.wait_for_reports(timeout=60))
"""


def without(packages: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python tests/without.py PACKAGES ARGV`` (this tree's hf_memwatch first)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, str(TESTS / "without.py"), packages, *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def report(packages: str, run_dir: Path, out: Path) -> subprocess.CompletedProcess:
    return without(packages, "-m", "hf_memwatch.cli", "report", str(run_dir), "-o", str(out), cwd=out.parent)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A real run with MemWatch() where matplotlib and plotly are not installed."""
    base = tmp_path_factory.mktemp("extras")
    script = base / "train.py"
    script.write_text(textwrap.dedent(RUN_SCRIPT).format(tests=str(TESTS), out=str(base / "run")))
    result = without("matplotlib,plotly", str(script), cwd=base)
    return {"base": base, "out": base / "run" / "memwatch", "result": result}


def test_a_run_without_matplotlib_says_so_once_and_writes_the_steps_table(run):
    result, out = run["result"], run["out"]
    assert result.returncode == 0, result.stderr[-2000:]
    console = result.stdout + result.stderr
    assert "Traceback" not in console
    off = [line for line in console.splitlines() if "matplotlib is not installed" in line and "is off" in line]
    assert len(off) == 1 and install_hint("matplotlib") in off[0]
    assert not (out / "memory.png").exists() and not (out / "memory.png.log").exists()
    page = (out / "memory.html").read_text()
    assert "<table>" in page and "<img" not in page and "plotly" not in page.lower()  # the table, nothing drawn
    (files,) = [line for line in result.stdout.splitlines() if line.startswith("hf-memwatch: files in ")]
    assert "memory.html" in files and "hf-memwatch report" in files
    assert f"waited for: {out / 'memory.html'}" in result.stdout


@pytest.mark.parametrize("packages, name, hints, expect", [
    ("matplotlib", "memory.png", ["matplotlib"], "memory.html"),  # the picture: the steps table instead
    ("plotly", "memory.html", ["plotly"], "static"),  # the page: the picture and the table
    ("matplotlib,plotly", "memory.html", ["plotly"], "table"),  # the page: the table
])
def test_report_without_an_extra_writes_its_fallback(run, tmp_path, packages, name, hints, expect):
    result = report(packages, run["out"], tmp_path / name)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert len(lines) == len(hints)
    for line, package in zip(lines, hints, strict=True):
        assert off_line(package) in line
    page = (tmp_path / "memory.html").read_text()
    assert not (tmp_path / "memory.png").exists()
    assert "<table>" in page and "Plotly" not in page
    # without matplotlib installed at all (make test-minimal's venv), the static page has no picture either
    assert ("<img" in page) == (expect == "static" and installed("matplotlib"))
    assert result.stdout.startswith(f"wrote {tmp_path / 'memory.html'}")


def test_lora_without_peft_is_one_line(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 100}')
    result = without("peft", "-m", "hf_memwatch.cli", "estimate", str(config), "--lora-r", "8", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"hf-memwatch estimate: error: {off_line('peft', '--lora-r/--adapter (LoRA estimates)')}"]


def test_every_extra_is_one_of_setup_cfg():
    import configparser

    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    extras = parser["options.extras_require"]
    for package, (extra, _) in EXTRAS.items():
        assert package in extras[extra], (package, extra)
    assert installed("json") and not installed("surely_not_a_package_name")
