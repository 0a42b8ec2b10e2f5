"""The interactive page (``hf-memwatch report RUN -o memory.html``) in a real headless Chromium.

Debian's ``chromium`` (the Makefile's test target installs it when missing), driven by Playwright
from PyPI with ``executable_path``: no browser is downloaded. Every request other than the page's own
file is refused and recorded, so the page must load offline.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import Trainer

from hf_memwatch import MemWatch
from hf_memwatch.reporting.report import write_report

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


def test_the_page_loads_offline_draws_every_step_and_a_click_shows_the_peak_tensors(run, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium (make test installs it)")
    page_file = write_report(run["out"], tmp_path / "memory.html")
    records = run["records"]
    snapshots = [r for r in records if r["event"] == "snapshot" and "stage" not in r]
    steps = [r for r in records if r["event"] == "step"]
    listed = [r for r in records if r["event"] == "peak_tensors"]
    assert [r["step"] for r in listed] == [r["step"] for r in steps if r["detail"] == "full"] and listed
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            outside: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))

            def route(r):
                if r.request.url.startswith("file:"):
                    r.continue_()
                else:
                    outside.append(r.request.url)
                    r.abort()

            page.route("**/*", route)
            page.goto(page_file.as_uri())
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
        finally:
            browser.close()


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
