"""Does watching change the bytes? The same run with and without ``MemWatch``, measured by PyTorch.

For each case (TRL's ORPO and CPO, Mamba's slow path, ViT image classification, Whisper speech to
text, and every family of :mod:`hf_memwatch.testing.families` at 2 x 64 fp32), 2 real Trainer steps
are profiled (PyTorch's CPU memory events, :mod:`hf_memwatch.testing.truth`): unwatched; watched
(``MemWatch(detail="full")``); and watched with the tracker's unperturbed kernels switched off
(:mod:`hf_memwatch.measure.unperturbed`), which is how the tracker ran before. Columns: the profiler's
window peak of each, MemWatch's worst step-peak gap to the profiler's step peaks, and
``estimate(trainer)`` against the unwatched peak. All in one process, in this order.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/perturbation.py`` (about 5 minutes on 2 cores); markdown
to stdout and to ``benchmarks/results/perturbation.md``. ``--cases orpo mamba`` runs a subset.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

import hf_memwatch.measure.tracker as tracker  # noqa: E402
from hf_memwatch.testing.families import FAMILIES  # noqa: E402
from hf_memwatch.testing.perturbation import CASES, compare, family_case  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "perturbation.md"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:+.2f}%"


def measure(name: str) -> str:
    build = CASES[name] if name in CASES else family_case(name)
    start = time.perf_counter()
    result = compare(build, name, with_estimate=True)
    fixed = tracker._UNPERTURBED
    tracker._UNPERTURBED = frozenset()  # the tracker as it ran before: every kernel under the mode as called
    try:
        before = compare(build, name, unwatched=False)
    finally:
        tracker._UNPERTURBED = fixed
    same_losses = result.losses[0] == result.losses[1]
    return (f"| {name} | {result.without:,} | {before.watched:,} ({_pct((before.watched - result.without) / result.without)}) "
            f"| {result.watched:,} ({_pct(result.perturbation)}) | {100 * result.live_error:.2f}% "
            f"| {_pct(result.estimate_error)} | {'yes' if same_losses else 'NO'} | {time.perf_counter() - start:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=[*CASES, *FAMILIES])
    parser.add_argument("--out", type=Path, default=RESULTS)
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    lines = [
        "# Watching changes nothing: profiler peaks with and without MemWatch",
        "",
        f"torch {torch.__version__}, 2 optimizer steps per run, CPU. Peaks in bytes (PyTorch's CPU memory "
        "events); percentages against the unwatched run. *before*: watched with the unperturbed kernels "
        "off (how the tracker ran before). *live gap*: MemWatch's worst step peak against the profiler's.",
        "",
        "| case | unwatched | watched, before | watched | live gap | estimate | same losses | time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for name in options.cases:
        try:
            line = measure(name)
        except Exception as error:  # noqa: BLE001 - a case that cannot run is reported, not hidden
            line = f"| {name} | failed: {type(error).__name__}: {str(error)[:80]} | | | | | | |"
        print(line, flush=True)
        lines.append(line)
    options.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
