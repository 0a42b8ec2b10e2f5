"""The demo's transcript: its console (``make demo`` keeps it in ``demo-output/console.txt``) without the
libraries' loading noise, written where the README's "make demo" block is read from.

    python examples/transcript.py demo-output/console.txt docs/demo-transcript.txt

Left out, each named: transformers' weight-loading progress and its LOAD REPORT table (the classifier head a
pretrained encoder lacks), bitsandbytes' and DeepSpeed's import-time notices, W&B's offline notice, and the
terminal's colour codes; the Trainer's logging lines but the last (the loss every few steps: a count
says how many). Everything else — the example's lines, the Trainer's metrics, every hf-memwatch
line and table — stays as printed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
NOISE = (
    re.compile(r"^\[INFO\] Running in WANDB offline mode"),  # W&B
    re.compile(r"^Failed to load CPU gemm_4bit_forward"),  # bitsandbytes' optional CPU kernels
    re.compile(r"^Loading weights"),  # transformers' progress bar
    re.compile(r"^\[\d{4}-\d\d-\d\d [^]]*\] \[WARNING\] \[real_accelerator\.py"),  # DeepSpeed on a CPU machine
)
REPORT_START = "LOAD REPORT"
LOGGED = "\0logged\0"
REPORT_LINE = re.compile(r"^(Key\s|[-+]+$|\S.*\|.*\|\s*$|Notes:|- |\s*$)")  # its table, notes and blank lines


def transcript(console: str) -> str:
    """``console`` without the loading noise (see the module docstring)."""
    kept, in_report, logged = [], False, []
    for raw in ANSI.sub("", console).replace("\r", "\n").splitlines():
        if REPORT_START in raw:
            in_report = True
            continue
        if in_report and REPORT_LINE.match(raw):
            continue
        in_report = False
        if raw.startswith("{'loss': "):  # the Trainer's logging steps: counted, not shown
            logged.append(raw)
            if len(logged) == 1:
                kept.append(LOGGED)
            continue
        if not any(pattern.match(raw) for pattern in NOISE):
            kept.append(raw.rstrip())
    text = "\n".join(kept).strip("\n") + "\n"
    return text.replace(LOGGED, f"(the Trainer logged the loss {len(logged)} times: left out here)")


def memwatch_lines(console: str) -> str:
    """MemWatch's part of a run's console: from its summary table to the line saying where the files are."""
    lines = transcript(console).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("hf-memwatch: peak step"))
    end = next(i for i, line in enumerate(lines) if line.startswith("hf-memwatch: files in "))
    return "\n".join(lines[start:end + 1]) + "\n"


def paste(readme: str, marker: str, text: str) -> str:
    """``readme`` with the block between ``<!-- marker... -->`` and ``<!-- /marker -->`` set to ``text``
    (as a ```text block)."""
    head, rest = readme.split(f"<!-- {marker}", 1)
    opening, rest = rest.split("-->", 1)
    _, tail = rest.split(f"<!-- /{marker} -->", 1)
    return f"{head}<!-- {marker}{opening}-->\n```text\n{text}```\n<!-- /{marker} -->{tail}"


def block(readme: str, marker: str) -> str:
    """The text of the block :func:`paste` wrote."""
    inner = readme.split(f"<!-- {marker}", 1)[1].split("-->", 1)[1].split(f"<!-- /{marker} -->", 1)[0]
    return inner.strip("\n").removeprefix("```text\n").removesuffix("```")


def main(argv: list[str]) -> None:
    """``console.txt docs/demo-transcript.txt``: write the transcript, and paste it into README.md's block."""
    source, target = argv
    text = transcript(Path(source).read_text(encoding="utf-8"))
    Path(target).write_text(text, encoding="utf-8")
    readme = Path(__file__).resolve().parents[1] / "README.md"
    readme.write_text(paste(readme.read_text(encoding="utf-8"), "demo-transcript", text), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
