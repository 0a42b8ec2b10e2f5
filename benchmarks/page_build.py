"""The page's size and build time, before and after, in one run: ``hf-memwatch report RUN -o memory.html``.

Each version of the package runs the CLI in ``--rounds`` fresh processes on the same run (by default
the demo's, ``make demo``: 36 steps, 180 snapshots): the ``--before`` revision's ``hf_memwatch/``
taken with ``git archive`` into a temporary folder, the working tree's as it is. Printed for each:
the page's bytes and, of them, Plotly's library (inlined as ``plotly.min.js``, or gzip + base64 in
``#plotly-gzip``); the median wall and CPU seconds (user + system of the child: less sensitive to a
machine shared with other work); the heavy modules the command imported, with their cumulative import
seconds (``python -X importtime``): where the time goes. With Playwright and a Chromium, the time
until each page has drawn its chart (``#memchart .main-svg``) in headless Chromium.

Usage: ``python benchmarks/page_build.py [--run demo-output] [--before c391640] [--rounds 3]
[--out benchmarks/results/page_build.md]``.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "matplotlib", "plotly")
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def package_of(revision: str, into: Path) -> Path:
    """``hf_memwatch/`` at ``revision`` under ``into`` (the folder to put first on PYTHONPATH)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", revision, "hf_memwatch"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def build(package_root: Path, run: str, out: Path) -> tuple[float, float, dict[str, float]]:
    """One fresh ``hf-memwatch report``: wall s, CPU s, cumulative import s of the heavy modules."""
    env = dict(os.environ, PYTHONPATH=str(package_root))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "hf_memwatch.cli", "report", run, "-o",
                           str(out)], env=env, capture_output=True, text=True, check=True,
                          cwd=out.parent)  # not the repository: ``-m`` puts the working folder first on sys.path
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    imports: dict[str, float] = {}
    for line in done.stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \|(\s*)(\S+)$", line)
        if not match:
            continue
        name, seconds = match.group(3), int(match.group(1)) / 1e6
        if name in ("torch", "matplotlib") and name not in imports:
            imports[name] = seconds
        elif match.group(2) == " " and name.split(".")[0] in ("plotly", "_plotly_utils"):  # imported lazily, in parts
            imports["plotly"] = imports.get("plotly", 0.0) + seconds
    return wall, cpu, imports


def plotly_bytes(page: str) -> int:
    """The bytes of Plotly's library in the page (inlined, or packed in ``#plotly-gzip``)."""
    packed = re.search(r"id='plotly-gzip'>([^<]*)</script>", page)
    if packed:
        return len(packed.group(1))
    start = page.find("/**\n* plotly.js v")
    end = page.find("</script>", start)
    return end - start if start >= 0 else 0


INFLATE = """async () => { var packed = document.getElementById('plotly-gzip');
  if (!packed) { return null; }
  var t0 = performance.now(), text = atob(packed.textContent.trim()), bytes = new Uint8Array(text.length);
  for (var i = 0; i < text.length; i++) { bytes[i] = text.charCodeAt(i); }
  await new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'))).text();
  return (performance.now() - t0) / 1000; }"""


def chromium_draw(page: Path) -> tuple[float, float | None] | None:
    """Seconds until ``page`` has drawn its chart in headless Chromium, and of them the seconds the
    loader spends decoding and inflating the packed bundle (the median of 3, measured again in the
    page; None: not packed); None without Playwright/Chromium."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if not Path(CHROMIUM).exists():
        return None
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            tab = browser.new_page()
            start = time.perf_counter()
            tab.goto(page.as_uri())
            tab.wait_for_selector("#memchart .main-svg", timeout=60_000)
            drawn = time.perf_counter() - start
            inflate = [tab.evaluate(INFLATE) for _ in range(3)]
            return drawn, None if inflate[0] is None else statistics.median(inflate)
        finally:
            browser.close()


def measure(name: str, package_root: Path, run: str, rounds: int, scratch: Path) -> dict:
    out = scratch / f"{name}.html"
    results = [build(package_root, run, out) for _ in range(rounds)]
    page = out.read_text(encoding="utf-8")
    return {"name": name, "bytes": out.stat().st_size, "plotly": plotly_bytes(page),
            "wall": statistics.median(r[0] for r in results), "cpu": statistics.median(r[1] for r in results),
            "imports": {k: statistics.median(r[2].get(k, 0.0) for r in results) for k in HEAVY},
            "draw": chromium_draw(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=str(ROOT / "demo-output"), help="a Trainer output dir with MemWatch's timeline")
    parser.add_argument("--before", default="c391640", help="the revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the Markdown table here")
    args = parser.parse_args()
    if not Path(args.run).exists():
        sys.exit(f"{args.run}: no such run (make demo writes demo-output/)")
    load = os.getloadavg()[0]
    run = str(Path(args.run).resolve())
    with tempfile.TemporaryDirectory(prefix="page-build-") as tmp:
        scratch = Path(tmp)
        rows = [measure(f"before ({args.before})", package_of(args.before, scratch / "before"), run, args.rounds,
                        scratch),
                measure("after (this tree)", ROOT, run, args.rounds, scratch)]
    lines = [
        "# The page: size and build time (`hf-memwatch report RUN -o memory.html`)", "",
        f"The demo's run (`make demo`: 36 steps of a 22.7M-parameter BERT on SST-2, 180 snapshots); median of {args.rounds} fresh processes each "
        f"(`python benchmarks/page_build.py --rounds {args.rounds}`), 2 CPUs shared with other work, load average "
        f"{load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end. Import seconds are cumulative "
        "(`python -X importtime`; Plotly's: the sum of its top-level imports, made lazily in parts), 0 where the module was not imported.", "",
        "| version | page bytes | of which Plotly | wall s | CPU s | import torch s | import matplotlib s "
        "| import plotly s | drawn in Chromium s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        draw = "n/a" if row["draw"] is None else f"{row['draw'][0]:.2f}" + (
            f" (inflating {row['draw'][1]:.2f})" if row["draw"][1] is not None else "")
        lines.append(f"| {row['name']} | {row['bytes']:,} | {row['plotly']:,} | {row['wall']:.2f} | {row['cpu']:.2f} "
                     f"| {row['imports']['torch']:.2f} | {row['imports']['matplotlib']:.2f} "
                     f"| {row['imports']['plotly']:.2f} | {draw} |")
    before, after = rows
    lines += ["", f"Page size ×{after['bytes'] / before['bytes']:.2f}, build wall time ×{after['wall'] / before['wall']:.2f}, "
              f"CPU time ×{after['cpu'] / before['cpu']:.2f}.", "",
              f"Where the time went before: importing torch ({before['imports']['torch']:.2f} s; the report never "
              "uses it, `reporting/report.py` imported `RunConfig` for a type), matplotlib "
              f"({before['imports']['matplotlib']:.2f} s) and drawing the picture into the page, Plotly's import "
              f"({before['imports']['plotly']:.2f} s); the rest is the interpreter, reading the timeline, the figure "
              "and writing 5.4 MB. After: no torch, no matplotlib (the interactive page holds the chart and the "
              "tables, not the picture), Plotly's bundle gzip-packed (level 6) and base64-encoded. Drawing in "
              "Chromium includes decoding and inflating the bundle (`atob`, `DecompressionStream`), in brackets; "
              "the rest of the drawing is the same bundle's and the same figure's."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
