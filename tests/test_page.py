"""The interactive page (``hf-memwatch report RUN -o memory.html``) in a real headless Chromium.

Debian's ``chromium`` (the Makefile's test target installs it when missing), driven by Playwright
from PyPI with ``executable_path``: no browser is downloaded. Every request other than the page's own
file is refused and recorded, so the page must load offline.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import Trainer

from hf_memwatch import MemWatch
from hf_memwatch.reporting.report import load_run, write_report

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
TRACES_PER_RANK = 8  # five classes, the spike, the step peaks, the host RSS


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("page") / "run"
    model = gpt2_model()
    args = training_args(out, max_steps=3, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    Trainer(model=model, args=args, train_dataset=token_dataset(16, 32, 1000), eval_dataset=token_dataset(8, 32, 1000),
            callbacks=[MemWatch(report=False, summary=False, full_steps=2)]).train()
    folder = out / "memwatch"
    records = read_records(out)
    rank1 = [dict(r, rank=1) for r in records]  # a second rank: rank 0's records relabelled
    (folder / "timeline.rank1.jsonl").write_text("\n".join(json.dumps(r) for r in rank1) + "\n")
    return {"out": out, "records": records}


@contextlib.contextmanager
def opened(page_file: Path):
    """``page_file`` in headless Chromium, offline: (the page, its console errors, the requests refused)."""
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium (make test installs it)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            outside: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:")
                       else (outside.append(r.request.url), r.abort()))
            page.goto(page_file.as_uri())
            yield page, errors, outside
        finally:
            browser.close()


def test_the_page_loads_offline_draws_every_step_and_a_click_shows_the_peak_tensors(run, tmp_path):
    page_file = write_report(run["out"], tmp_path / "memory.html")
    records = run["records"]
    snapshots = [r for r in records if r["event"] == "snapshot" and "stage" not in r]
    steps = [r for r in records if r["event"] == "step"]
    listed = [r for r in records if r["event"] == "peak_tensors"]
    assert [r["step"] for r in listed] == [r["step"] for r in steps if r["detail"] == "full"] and listed
    with opened(page_file) as (page, errors, outside):
        page.wait_for_selector("#memchart .main-svg")
        assert page.evaluate("() => document.querySelectorAll('script[src]').length") == 0  # all inlined
        data = page.evaluate("""() => document.getElementById('memchart').data.map(
            t => ({name: t.name, type: t.type, n: t.x.length, visible: t.visible}))""")
        assert len(data) == 2 * TRACES_PER_RANK
        bars = [t for t in data if t["type"] == "bar"]
        assert len(bars) == 2 * 5 and all(t["n"] == len(snapshots) for t in bars)
        peaks = [t for t in data if t["name"].startswith("step peak")]
        assert [t["n"] for t in peaks] == [len(steps), len(steps)]
        assert [t["visible"] for t in peaks] == [True, False]
        drawn = page.query_selector_all("#memchart .cartesianlayer .subplot.xy .barlayer .trace .point")
        assert len(drawn) == 5 * len(snapshots)  # every visible class's bar, in the DOM as SVG paths
        shapes = page.evaluate("() => document.getElementById('memchart').layout.shapes.length")
        assert shapes == len([r for r in records if r["event"] == "eval"])  # eval loops marked
        # a click on step 2's peak marker reveals its top tensors
        markers = page.query_selector_all("#memchart .cartesianlayer .subplot.xy .scatterlayer .trace .points path")
        assert len(markers) == len(steps)
        box = markers[1].bounding_box()
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_selector("#tensors table.top-tensors", timeout=10_000)
        assert page.inner_text("#tensors h2").startswith("step 2 (rank 0)")
        rows = page.query_selector_all("#tensors table.top-tensors tr")
        assert len(rows) == 1 + len(listed[1]["tensors"])
        first = [c.inner_text() for c in rows[1].query_selector_all("td")]
        top = listed[1]["tensors"][0]
        assert first[1:] == [" × ".join(map(str, top["shape"])), top["dtype"], top["class"], top["operator"],
                             top["module"], top["stage"]]
        assert page.query_selector_all("#tensors table.by-module tr")[1:]
        page.screenshot(path=str(tmp_path / "page.png"))
        # the rank menu shows rank 1's traces instead
        page.click("#memchart .updatemenu-header")
        page.click("#memchart .updatemenu-dropdown-button >> nth=1")
        visible = page.evaluate("() => document.getElementById('memchart').data.map(t => t.visible)")
        assert visible == [False] * TRACES_PER_RANK + [True] * TRACES_PER_RANK
        assert not errors, errors
        assert not outside, outside


def test_the_chart_speaks_mib_and_every_hover_shows_every_class_and_the_total(run):
    """The y-axis in binary units as every label (no SI "350M" for MiB), and a bar's hover, whichever class
    is under the pointer, lists each class at that snapshot and their total (the allocated bytes)."""
    from hf_memwatch.core.units import format_bytes
    from hf_memwatch.reporting.page import build_figure
    from hf_memwatch.reporting.report import load_run

    runs = load_run(run["out"])
    fig = build_figure(runs)
    assert all(text.endswith((" MiB", " GiB", " KiB")) for text in fig.layout.yaxis.ticktext)
    assert fig.layout.yaxis.tickformat is None
    bars = [t for t in fig.data if t.type == "bar" and t.name.endswith("(rank 0)")]
    snaps = runs[0].snapshots
    for i, snap in enumerate(snaps):
        hovers = {bar.hovertext[i] for bar in bars}
        assert len(hovers) == 1  # the same breakdown on every class's bar
        (hover,) = hovers
        for name in ("weights", "gradients", "optimizer states", "activations", "other"):
            assert f"{name}: " in hover
        assert f"total: {format_bytes(snap.allocated)}" in hover
    (rss,) = [t for t in fig.data if t.name.startswith("host RSS (rank 0")]
    assert list(rss.y) == [s.host_rss for s in snaps] and rss.yaxis == "y2"
    assert all(text.endswith((" MiB", " GiB", " KiB")) for text in fig.layout.yaxis2.ticktext)



def test_the_x_axis_switches_to_wall_clock_seconds_and_back(run, tmp_path):
    """The "x: seconds" button puts every bar at its snapshot's wall-clock time (seconds since the first
    snapshot) spanning the phase it closes, the peaks and spikes inside their phase; "x: steps" puts
    them back on the step axis."""
    page_file = write_report(run["out"], tmp_path / "memory.html")
    snaps = load_run(run["out"])[0].snapshots
    seconds = [round(s.time - snaps[0].time, 3) for s in snaps]
    assert seconds[-1] > 0
    with opened(page_file) as (page, errors, outside):
        page.wait_for_selector("#memchart .main-svg")
        axis = "() => { var d = document.getElementById('memchart'); return {x: d.data.map(t => t.x), " \
               "width: d.data.map(t => t.width || null), title: d.layout.xaxis.title.text}; }"
        page.click("#memchart .updatemenu-button >> text=x: seconds")
        page.wait_for_function("() => document.getElementById('memchart').layout.xaxis.title.text.startsWith('sec')")
        timed = page.evaluate(axis)
        assert timed["title"].startswith("seconds since the first snapshot")
        assert timed["x"][0] == seconds  # rank 0's first class
        assert timed["width"][0] == [0] + [round(b - a, 3) for a, b in zip(seconds, seconds[1:], strict=False)]
        peaks = timed["x"][6]  # five classes, the spike, then the step peaks: each inside its phase
        assert peaks and all(0 < x <= seconds[-1] for x in peaks)
        page.screenshot(path=str(tmp_path / "page-seconds.png"))
        page.click("#memchart .updatemenu-button >> text=x: steps")
        page.wait_for_function("() => document.getElementById('memchart').layout.xaxis.title.text.startsWith('opt')")
        stepped = page.evaluate(axis)
        assert stepped["x"][0] == list(range(len(snaps))) and stepped["width"][0] is None
        assert not errors, errors
        assert not outside, outside


def test_a_page_whose_chart_cannot_be_drawn_says_so_and_fails_the_check(run, tmp_path):
    """The checks above would see a broken page: with plotly.js unreadable the chart is not drawn, the
    page says why where the chart should be and logs a console error."""
    page_file = write_report(run["out"], tmp_path / "memory.html")
    broken = base64.b64encode(gzip.compress(b"throw new Error('broken bundle')")).decode()
    text = re.sub(r"(id='plotly-gzip'>)[^<]*", lambda m: m.group(1) + broken, page_file.read_text(encoding="utf-8"))
    page_file.write_text(text, encoding="utf-8")
    with opened(page_file) as (page, errors, _):
        page.wait_for_function("() => !document.getElementById('chart-status').textContent.startsWith('drawing')")
        assert page.inner_text("#chart-status").startswith("The chart could not be drawn")
        assert page.query_selector("#memchart .main-svg") is None
        assert any("broken bundle" in e for e in errors), errors


def test_two_runs_compared_render_in_chromium(run, tmp_path):
    """``hf-memwatch report RUN_A RUN_B -o compare.html``: the static comparison (a panel per run, each
    run's steps table) loads offline, its picture decoded."""
    other = tmp_path / "other"
    shutil.copytree(run["out"] / "memwatch", other / "memwatch")
    page_file = write_report([run["out"], other], tmp_path / "compare.html")
    with opened(page_file) as (page, errors, outside):
        page.wait_for_load_state("load")
        width = page.evaluate("() => { var i = document.querySelector('img'); return i.complete ? i.naturalWidth : 0; }")
        assert width > 500
        ranks = [rank.rank for rank in load_run(run["out"])]
        heads = [h.inner_text() for h in page.query_selector_all("h2")]
        assert heads == [f"{path} rank {r}: steps" for path in (run["out"], other) for r in ranks]
        page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)
        assert not errors, errors
        assert not outside, outside


def test_the_page_is_under_half_of_plotly_alone(run, tmp_path):
    """Plotly's bundle is packed (gzip, base64): the whole page weighs less than half the bundle it
    carries (5.4 MB with the bundle inlined as it is; benchmarks/results/page_build.md)."""
    from plotly.offline import get_plotlyjs

    page_file = write_report(run["out"], tmp_path / "memory.html")
    assert page_file.stat().st_size < len(get_plotlyjs()) / 2


def test_the_page_is_built_without_torch(run, tmp_path):
    """``hf-memwatch report`` needs neither torch nor matplotlib for the interactive page (importing
    them was 4.3 s of the 11.3 s build: benchmarks/results/page_build.md)."""
    code = ("import sys; from hf_memwatch.cli.main import main; status = main(sys.argv[1:]); "
            "print(status, 'torch' in sys.modules, 'matplotlib' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, "report", str(run["out"]), "-o", str(tmp_path / "m.html")],
                          capture_output=True, text=True, timeout=300)
    assert proc.stdout.split()[-3:] == ["0", "False", "False"], proc.stderr


def test_the_screenshots_the_docs_show_are_there():
    """README and docs/reporting.md show the page (x on steps, on seconds), the comparison and the
    picture, as examples/screenshots.py took them from the demo's runs in headless Chromium."""
    import matplotlib.image

    docs = Path(__file__).resolve().parent.parent / "docs"
    shown = re.findall(r"\]\(([\w-]+\.png)\)", (docs / "reporting.md").read_text(encoding="utf-8"))
    readme = (docs.parent / "README.md").read_text(encoding="utf-8")
    assert {"page.png", "page-seconds.png", "page-compare.png"} <= set(shown)
    assert "](docs/page.png)" in readme and "](docs/example-memory.png)" in readme
    for name in [*shown, "example-memory.png"]:
        assert matplotlib.image.imread(docs / name).shape[1] >= 1200, name
