"""The docs' screenshots of the page and the picture, taken in headless Chromium from real runs.

    python examples/screenshots.py demo-output demo-output-as-given docs/

``RUN`` (the demo's run, ``make demo``) gives ``page.png`` (the interactive page, x on steps),
``page-seconds.png`` (x on wall-clock seconds) and ``example-memory.png`` (the picture); ``RUN`` and
``OTHER`` (the same example without ``--auto``: the configuration as given) give ``page-compare.png``
(``hf-memwatch report OTHER RUN -o compare.html``, the two runs side by side). The runs are named on the
pages as given on the command line. Chromium is Debian's (``make test`` installs it), driven by
Playwright (the ``dev`` extra); every request other than the page's own file is refused, so what is
shown is what a cluster without network shows. A page that logs an error or does not draw its chart
stops the script (``tests/test_page.py`` checks the same on every run of the suite).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

from hf_memwatch.reporting.report import write_report

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


def shoot(browser, page_file: Path, shots: list[tuple[str | None, Path]], chart: bool = True, height: int = 820) -> None:
    """Open ``page_file`` offline; for each (button label or None, png): click it, then take the png."""
    page = browser.new_page(viewport={"width": 1400, "height": height})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort())
    page.goto(page_file.as_uri())
    if chart:
        page.wait_for_selector("#memchart .main-svg", timeout=60_000)
    for button, png in shots:
        if button is not None:
            page.click(f"#memchart .updatemenu-button >> text={button}")
            page.wait_for_timeout(800)
        page.mouse.move(0, 0)  # no hover label in the picture
        page.screenshot(path=str(png))
        print(f"wrote {png}")
    if errors:
        sys.exit(f"{page_file.name}: {errors}")
    page.close()


def main(run: str, other: str, docs: str) -> None:
    out = Path(docs)
    with tempfile.TemporaryDirectory(prefix="screenshots-") as tmp:
        page = write_report(run, Path(tmp) / "memory.html")
        compare = write_report([other, run], Path(tmp) / "compare.html")
        write_report(run, out / "example-memory.png")
        print(f"wrote {out / 'example-memory.png'}")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                shoot(browser, page, [(None, out / "page.png"), ("x: seconds", out / "page-seconds.png")])
                shoot(browser, compare, [(None, out / "page-compare.png")], chart=False, height=1250)
            finally:
                browser.close()


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
