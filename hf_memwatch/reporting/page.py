"""The pages: ``hf-memwatch report RUN -o memory.html`` — one self-contained file. The interactive
one (below) where Plotly is installed and one run is drawn; else the static one (:func:`render_html`:
the picture, each rank's steps table and events in words; a comparison of runs, or no Plotly).

Plotly (inlined gzip-compressed, base64: :func:`plotly_script`; the page loads with no network) draws,
for every rank, the live classes of each snapshot as stacked bars (one bar per phase of each step,
hover: step, micro-batch, phase, every class, their total and the phase peak, in MiB/GiB as the
y-axis), the spike on top, each step's peak as a marker, the process's host RSS as a dotted line on a
right-hand axis, the budget and the plan's predicted peak as lines, eval/predict loops and
plan/remedy/OOM events as marked vertical lines; a range slider zooms over steps; a menu selects the rank;
two buttons put the x-axis on steps (one bar per phase) or on wall-clock seconds since the first
snapshot (each bar spans the phase it closes: :func:`~hf_memwatch.reporting.report.time_positions`). A click on
a step (its bars or its peak marker) shows that step's ``peak_tensors`` record below the chart: the
largest tensors alive at its peak, then the bytes by module and by operator. The static PNG
(``memory.png``) stays for the summary and CI logs; the page holds the chart and a table of every step
(``hf-memwatch report`` no longer draws the picture into it: 1.2 s and 150 kB for what the chart shows).

==================  ===================================================================
element id           content
==================  ===================================================================
``memchart``         the Plotly chart (``data``: per rank, the classes, spike, peaks)
``peak-data``        JSON: ``"rank:step"`` -> that step's ``peak_tensors`` record
``tensors``          filled on click: ``<h2>``, the top-tensors table, module/operator tables
``plotly-gzip``      plotly.js, gzip-compressed, base64 (decompressed by the browser)
``chart-figure``     JSON: the figure's ``data``, ``layout`` and ``config``
``chart-status``     empty once drawn; says why where the chart could not be drawn
==================  ===================================================================

Size and build time (``benchmarks/page_build.py``, ``benchmarks/results/page_build.md``): Plotly's
bundle is 4.8 MB of the 5.4 MB page as ``to_html(include_plotlyjs=True)`` inlined it; gzip at level 6
(0.17 s) and base64 make it 1.96 MB, which the browser's standard ``DecompressionStream`` (Chromium
80, Firefox 113, Safari 16.4) inflates before drawing. The installed Plotly's own bundle is used, so
the page's plotly.js always matches the figure's schema.
"""

from __future__ import annotations

import base64
import functools
import gzip
import html
import io
import json
from collections.abc import Mapping
from typing import Any

from ..core.categories import LIVE_CLASSES
from ..core.extras import installed
from ..core.units import format_bytes
from .run_view import (
    COLOURS,
    LABELS,
    SPIKE,
    RankTimeline,
    budget_of,
    choose_unit,
    eval_position,
    event_label,
    event_step,
    event_text,
    first_of_steps,
    live_bands,
    peak_index,
    predicted_peak_of,
    step_starts,
    title_of,
)
from .timeaxis import time_positions, timed, x_axes

CHART_ID = "memchart"

# Runs after Plotly drew the chart: a click on any point carries [rank, step] in its customdata.
_CLICK_JS = """
var chart = document.getElementById('memchart');
var peaks = JSON.parse(document.getElementById('peak-data').textContent);
function esc(s) { var d = document.createElement('div'); d.textContent = String(s); return d.innerHTML; }
function size(n) {
  var units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'], i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i ? n.toFixed(2) + ' ' + units[i] : n + ' B';
}
function table(cls, head, rows) {
  var out = '<table class="' + cls + '"><tr>' + head.map(function (h) { return '<th>' + esc(h) + '</th>'; }).join('') + '</tr>';
  rows.forEach(function (r) { out += '<tr>' + r.map(function (c) { return '<td>' + esc(c) + '</td>'; }).join('') + '</tr>'; });
  return out + '</table>';
}
function show(rank, step) {
  var box = document.getElementById('tensors'), rec = peaks[rank + ':' + step];
  if (!rec) { box.innerHTML = '<h2>step ' + esc(step) + ' (rank ' + esc(rank) + ')</h2><p class="none">no tensor list for this step: only fully tracked CPU steps have one</p>'; return; }
  var html = '<h2>step ' + esc(step) + ' (rank ' + esc(rank) + '): ' + size(rec.peak) + ' at ' + esc(rec.phase) + ', ' + rec.count + ' storages alive</h2>';
  html += '<h3>the ' + rec.tensors.length + ' largest tensors at the peak</h3>';
  html += table('top-tensors', ['bytes', 'shape', 'dtype', 'class', 'operator', 'module', 'stage'],
    rec.tensors.map(function (t) { return [size(t.bytes), t.shape.join(' \\u00d7 '), t.dtype, t['class'], t.operator, t.module, t.stage]; }));
  var groups = function (g) { return g.map(function (x) { return [x.name, size(x.bytes), x.count]; }); };
  html += '<h3>by module</h3>' + table('by-module', ['module', 'bytes', 'storages'], groups(rec.by_module));
  html += '<h3>by operator</h3>' + table('by-operator', ['operator', 'bytes', 'storages'], groups(rec.by_operator));
  box.innerHTML = html;
}
chart.on('plotly_click', function (ev) {
  var p = ev.points && ev.points[0];
  if (p && p.customdata) { show(p.customdata[0], p.customdata[1]); }
});
"""

_STYLE = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin-bottom:1em}"
          "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}th{background:#eee}"
          "td:nth-child(6),td:nth-child(5){text-align:left}.hint{color:#555}")


def _rank_traces(go: Any, run: RankTimeline, visible: bool) -> list[Any]:
    """The stacked classes, the spike and the step peaks of one rank (all carry [rank, step])."""
    snaps = run.snapshots
    xs = list(range(len(snaps)))
    custom = [[run.rank, s.step] for s in snaps]
    labels = [f"step {s.step} · mb {s.micro_step or 0} · {s.phase}" for s in snaps]
    bands = live_bands(snaps)
    everything = [hover_text(labels[i], bands, i, snap) for i, snap in enumerate(snaps)]
    traces = []
    for band in bands:
        traces.append(go.Bar(
            x=xs, y=band.values, name=f"{band.label} (rank {run.rank})", legendgroup=band.name,
            marker_color=band.colour, customdata=custom, text=labels, textposition="none", visible=visible,
            hovertext=everything, hovertemplate="%{hovertext}<extra></extra>"))
    # The spike of each phase: from the higher live end of the phase up to its peak, between the snapshots.
    sx: list[Any] = []
    sy: list[Any] = []
    scustom: list[Any] = []
    stext: list[Any] = []
    for i, snap in enumerate(snaps):
        if snap.spike:
            floor = snap.allocated if i == 0 else max(snaps[i - 1].allocated, snap.allocated)
            x = 0 if i == 0 else i - 0.5
            sx += [x, x, None]
            sy += [floor, floor + snap.spike, None]
            scustom += [custom[i], custom[i], None]
            text = f"{labels[i]}<br>spike: {format_bytes(snap.spike)} (temporaries inside the phase)"
            stext += [text, text, None]
    traces.append(go.Scatter(
        x=sx, y=sy, mode="lines", name=f"{LABELS[SPIKE]} (rank {run.rank})", customdata=scustom, text=stext,
        line={"color": COLOURS[SPIKE], "width": 9}, visible=visible, hovertemplate="%{text}<extra></extra>"))
    peak_x, peak_y, peak_custom, peak_text = [], [], [], []
    for i, step in peak_index(run):
        peak_x.append(i - 0.5 if i else 0)
        peak_y.append(step.peak)
        peak_custom.append([run.rank, step.step])
        peak_text.append(f"step {step.step} peak {format_bytes(step.peak)} at {step.peak_phase}"
                         f" · dominant {step.dominant} · click: its tensors")
    traces.append(go.Scatter(
        x=peak_x, y=peak_y, mode="markers", name=f"step peak (rank {run.rank})", customdata=peak_custom,
        marker={"symbol": "triangle-down", "size": 11, "color": "black"}, text=peak_text, visible=visible,
        hovertemplate="%{text}<extra></extra>"))
    # The process's resident host memory (every snapshot's host_rss), on its own axis at the right:
    # on the CPU it holds the libraries too, far above the tensors, and would flatten the bars.
    rss = [s.host_rss for s in snaps]
    traces.append(go.Scatter(
        x=xs, y=rss, mode="lines", name=f"host RSS (rank {run.rank}, right axis)", yaxis="y2", visible=visible,
        line={"color": "#555555", "dash": "dot", "width": 1.5}, customdata=custom,
        text=[f"{labels[i]}<br>host RSS: {format_bytes(v)}" for i, v in enumerate(rss)],
        hovertemplate="%{text}<extra></extra>"))
    return traces


def hover_text(label: str, bands: list[Any], i: int, snap: Any) -> str:
    """A bar's hover, whichever class is under the pointer: every class at that snapshot, their total
    (allocated) and the phase's peak, in MiB/GiB as the axis."""
    rows = [f"{band.name.replace('_', ' ')}: {format_bytes(band.values[i])}" for band in bands]
    total = sum(band.values[i] for band in bands)
    rows.append(f"<b>total: {format_bytes(total)}</b>")
    if snap.peak is not None:
        rows.append(f"phase peak: {format_bytes(snap.peak)}")
    return "<br>".join([label, *rows])


def binary_ticks(highest: float, count: int = 6) -> tuple[list[float], list[str]]:
    """Y-axis ticks in binary units (MiB/GiB, as every label of the page and the picture) at a round
    step, instead of Plotly's SI ("350M" for 350 MB while the labels say MiB).

    Example:
        >>> binary_ticks(420 * 2**20)[1]
        ['0 MiB', '100 MiB', '200 MiB', '300 MiB', '400 MiB']
    """
    unit, scale = choose_unit(highest or 1)
    top = (highest or 1) / scale
    step = next(s * 10**e for e in range(-2, 6) for s in (1, 2, 5) if top / (s * 10**e) <= count - 1)
    values = [n * step for n in range(int(top / step) + 1)]
    return [v * scale for v in values], [f"{v:g} {unit}" for v in values]


def _marks(run: RankTimeline) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Vertical lines and labels: eval/predict loops (after the step they followed), plan/remedy/oom."""
    snaps = run.snapshots
    first = first_of_steps(snaps)
    shapes, notes = [], []
    for loop in run.evals:
        x = eval_position(loop, snaps)
        shapes.append({"type": "line", "x0": x, "x1": x, "yref": "paper", "y0": 0, "y1": 1,
                       "line": {"color": "darkorange", "dash": "dash"}})
        notes.append({"x": x, "y": loop.peak, "text": f"{loop.stage} {format_bytes(loop.peak)}",
                      "showarrow": False, "font": {"color": "darkorange"}, "yshift": 10})
    for event in run.events:
        step = event_step(event)
        x = first.get(step, 0) if step is not None else 0
        label = event_label(event)
        shapes.append({"type": "line", "x0": x - 0.5, "x1": x - 0.5, "yref": "paper", "y0": 0, "y1": 1,
                       "line": {"color": "purple", "dash": "dot"}})
        notes.append({"x": x - 0.5, "yref": "paper", "y": 1.0, "text": label, "showarrow": False,
                      "font": {"color": "purple", "size": 10}, "xanchor": "left"})
    return shapes, notes


def _time_restyle(runs: list[RankTimeline], per_rank: list[int], fig: Any) -> dict[str, list[Any]]:
    """The traces' ``x`` on the time axis (and each bar's span: the phase it closes, from the previous
    snapshot to its own: :class:`~hf_memwatch.reporting.timeaxis.XAxis`), for the x-axis buttons; every
    rank on one clock (the earliest snapshot = 0 s)."""
    xs: list[Any] = []
    widths: list[Any] = []
    offsets: list[Any] = []
    traces = iter(fig.data)
    for run, count, axis in zip(runs, per_rank, x_axes(runs, "seconds"), strict=True):
        times = axis.times or []
        spans = [round(high - low, 3) for low, high in map(axis.span, range(len(run.snapshots)))]
        for _ in range(count):
            trace = next(traces)
            bar = trace.type == "bar"
            xs.append(times if bar else time_positions(list(trace.x), times))
            widths.append(spans if bar else None)
            offsets.append([-w for w in spans] if bar else None)
    return {"x": xs, "width": widths, "offset": offsets}


def _axis_buttons(runs: list[RankTimeline], per_rank: list[int], fig: Any, step_axis: dict[str, Any]) -> dict[str, Any]:
    """Two buttons: the x-axis on optimizer steps (one bar per phase) or on wall-clock seconds."""
    by_step = {"x": [list(t.x) for t in fig.data], "width": [None] * len(fig.data), "offset": [None] * len(fig.data)}
    by_time = _time_restyle(runs, per_rank, fig)
    times = x_axes(runs, "seconds")[0].times or []  # the marks are the first rank's, on the common clock
    def moved(items: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
        return [{**item, **{k: time_positions([item[k]], times)[0] for k in keys if k in item
                            and item.get("xref", "x") == "x"}} for item in items]

    shapes, notes = list(fig.layout.shapes), list(fig.layout.annotations)
    shapes = [s.to_plotly_json() for s in shapes]
    notes = [n.to_plotly_json() for n in notes]
    time_axis = {"xaxis.title.text": "seconds since the first snapshot (wall clock; a bar spans the phase it closes)",
                 "xaxis.tickmode": "auto", "xaxis.tickvals": None, "xaxis.ticktext": None, "xaxis.autorange": True,
                 "shapes": moved(shapes, ("x0", "x1")), "annotations": moved(notes, ("x",))}
    step_layout = {"xaxis.title.text": step_axis["title"], "xaxis.tickmode": "array",
                   "xaxis.tickvals": step_axis["tickvals"], "xaxis.ticktext": step_axis["ticktext"],
                   "xaxis.autorange": True, "shapes": shapes, "annotations": notes}
    every = list(range(len(fig.data)))
    return {"type": "buttons", "direction": "right", "x": 1, "xanchor": "right", "y": 1.12, "yanchor": "top",
            "showactive": True, "active": 0, "buttons": [
                {"label": "x: steps", "method": "update", "args": [by_step, step_layout, every]},
                {"label": "x: seconds", "method": "update", "args": [by_time, time_axis, every]}]}


def build_figure(runs: list[RankTimeline], budget: int | None = None) -> Any:
    """The Plotly figure: every rank's traces, the first rank visible, a menu to choose, the x-axis
    buttons (steps or seconds)."""
    import plotly.graph_objects as go

    budget = budget if budget is not None else budget_of(runs)
    fig = go.Figure()
    per_rank: list[int] = []
    for n, run in enumerate(runs):
        traces = _rank_traces(go, run, visible=n == 0)
        per_rank.append(len(traces))
        fig.add_traces(traces)
    shapes, notes = _marks(runs[0]) if runs else ([], [])
    if budget:
        shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": budget, "y1": budget,
                       "line": {"color": "black", "dash": "dash"}})
        notes.append({"xref": "paper", "x": 1, "y": budget, "text": f"budget {format_bytes(budget)}",
                      "showarrow": False, "xanchor": "right", "yshift": 8})
    predicted = predicted_peak_of(runs[0])
    if predicted:
        shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": predicted, "y1": predicted,
                       "line": {"color": "purple", "dash": "dashdot"}})
    snaps = runs[0].snapshots
    starts = step_starts(snaps)
    every = max(1, len(starts) // 20)
    ticks = binary_ticks(max([s.peak or s.allocated or 0 for r in runs for s in r.snapshots]
                             + [e.peak or 0 for r in runs for e in r.evals] + [budget or 0, predicted or 0]))
    rss_ticks = binary_ticks(max([s.host_rss or 0 for r in runs for s in r.snapshots] or [0]))
    buttons = []
    for n, run in enumerate(runs):
        visible = [m == n for m, count in enumerate(per_rank) for _ in range(count)]
        buttons.append({"label": f"rank {run.rank}", "method": "update", "args": [{"visible": visible}]})
    step_axis = {"title": "optimizer step (one bar per phase)", "tickvals": [i for i, _ in starts[::every]],
                 "ticktext": [str(step) for _, step in starts[::every]]}
    fig.update_layout(
        title=title_of(runs).replace("\n", "<br><sup>") + ("</sup>" if "\n" in title_of(runs) else ""),
        barmode="stack", bargap=0.05, shapes=shapes, annotations=notes, hovermode="closest",
        xaxis={"title": step_axis["title"], "rangeslider": {"visible": True}, "tickmode": "array",
               "tickvals": step_axis["tickvals"], "ticktext": step_axis["ticktext"]},
        yaxis={"title": "memory", "tickvals": ticks[0], "ticktext": ticks[1], "rangemode": "tozero"}, height=620,
        yaxis2={"title": "host RSS (resident)", "overlaying": "y", "side": "right", "showgrid": False,
                "tickvals": rss_ticks[0], "ticktext": rss_ticks[1], "rangemode": "tozero"},
        legend={"orientation": "v", "x": 1.07, "xanchor": "left"},  # clear of the host RSS axis
    )
    menus = [_axis_buttons(runs, per_rank, fig, step_axis)] if snaps and timed(runs) else []
    if len(runs) > 1:
        menus.append({"buttons": buttons, "direction": "down", "x": 0, "xanchor": "left", "y": 1.12,
                      "yanchor": "top", "showactive": True})
    fig.update_layout(updatemenus=menus)
    return fig


def peak_data(runs: list[RankTimeline]) -> dict[str, Any]:
    """``"rank:step"`` -> the step's ``peak_tensors`` record (what a click shows)."""
    return {f"{run.rank}:{step}": record.to_dict() for run in runs for step, record in run.peak_tensors.items()}


# Inflates plotly.js (gzip, base64) with the browser's DecompressionStream, runs it, then draws the
# figure and wires the clicks. Any failure is shown in #chart-status and logged as a console error.
_LOADER_JS = """
(function () {
  var status = document.getElementById('chart-status');
  function fail(e) {
    status.textContent = 'The chart could not be drawn (' + e + '). It needs a browser with DecompressionStream '
      + '(Chromium 80, Firefox 113, Safari 16.4 or later); the tables below need nothing.';
    console.error('hf-memwatch page: ' + e);
  }
  if (typeof DecompressionStream === 'undefined') { fail('no DecompressionStream'); return; }
  var text = atob(document.getElementById('plotly-gzip').textContent.trim());
  var bytes = new Uint8Array(text.length);
  for (var i = 0; i < text.length; i++) { bytes[i] = text.charCodeAt(i); }
  var inflated = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'));
  new Response(inflated).text().then(function (js) {
    var script = document.createElement('script');
    script.textContent = js;
    document.head.appendChild(script);
    var fig = JSON.parse(document.getElementById('chart-figure').textContent);
    return Plotly.newPlot('memchart', fig.data, fig.layout, fig.config);
  }).then(function () {
    status.textContent = '';
    CLICK_JS
  }).catch(fail);
})();
"""


@functools.lru_cache(maxsize=1)
def plotly_script() -> str:
    """The installed Plotly's plotly.min.js, gzip-compressed (level 6) and base64-encoded: 4.8 MB ->
    1.96 MB for plotly.js 4.1.1, in 0.17 s (once per process)."""
    from plotly.offline import get_plotlyjs

    packed = gzip.compress(get_plotlyjs().encode("utf-8"), compresslevel=6, mtime=0)
    return base64.b64encode(packed).decode("ascii")


def chart_html(fig: Any) -> str:
    """The chart's part of the page: the target div, the figure as JSON, plotly.js packed, its loader."""
    figure = json.loads(fig.to_json())
    figure["config"] = {"displaylogo": False, "responsive": True}
    data = json.dumps(figure, separators=(",", ":")).replace("</", "<\\/")
    return "\n".join([
        f"<div id='{CHART_ID}' style='height:{fig.layout.height or 620}px;width:100%'></div>",
        "<p id='chart-status' class='hint'>drawing the chart...</p>",
        f"<script type='application/json' id='chart-figure'>{data}</script>",
        f"<script type='application/octet-stream' id='plotly-gzip'>{plotly_script()}</script>",
        f"<script>{_LOADER_JS.replace('CLICK_JS', _CLICK_JS)}</script>",
    ])


def render_page(runs: list[RankTimeline], png_base64: str | None, steps_tables: list[str], budget: int | None = None) -> str:
    """The whole page: the chart (Plotly inlined, packed), the click target, the PNG and the steps tables."""
    fig = build_figure(runs, budget)
    data = json.dumps(peak_data(runs)).replace("</", "<\\/")
    title = html.escape(title_of(runs).replace("\n", " — "))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>", f"<title>{title}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<script type='application/json' id='peak-data'>{data}</script>",
        chart_html(fig),
        "<p class='hint'>Hover a bar for its bytes; drag or use the slider to zoom over steps; the buttons at the "
        "top right put the x-axis on steps or on seconds; click a step (a bar or its peak ▼) for the tensors "
        "alive at its peak, by module and operator.</p>",
        "<div id='tensors'></div>",
        *(["<h2>picture</h2>", f"<img alt='memory per phase' src='data:image/png;base64,{png_base64}'>"]
          if png_base64 is not None else []),  # None: no matplotlib
        *steps_tables,
        "</body></html>",
    ]
    return "\n".join(parts)


def render_html(runs: list[RankTimeline], fig: Any, budget: int | None = None, interactive: bool = True) -> str:
    """A self-contained page: the interactive chart (:mod:`hf_memwatch.reporting.page`, Plotly inlined)
    where Plotly is installed and ``interactive``, the picture (inline PNG; none when ``fig`` is None: no matplotlib) and a
    table of every step."""
    image = None
    if fig is not None:
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
        image = base64.b64encode(buffer.getvalue()).decode("ascii")
    if interactive and installed("plotly"):
        return render_page(runs, image, [_rank_section(run) for run in runs], budget)
    title = html.escape(title_of(runs).replace("\n", " — "))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{title}</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}th{background:#eee}"
        "img{max-width:100%;height:auto}</style>",  # the picture fits the window, its legend too
        f"</head><body><h1>{title}</h1>",
    ]
    if image is not None:
        parts.append(f"<img alt='memory per phase' src='data:image/png;base64,{image}'>")
    parts += [_rank_section(run) for run in runs]
    parts.append("</body></html>")
    return "\n".join(parts)


def _rank_section(run: RankTimeline) -> str:
    parts = [f"<h2>{html.escape(run.name)}: steps</h2>", _steps_table(run)]
    if run.events:
        parts.append("<h3>events</h3><ul>")
        parts += [f"<li>{html.escape(event_text(e))}</li>" for e in run.events]
        parts.append("</ul>")
    return "\n".join(parts)


def _steps_table(run: RankTimeline) -> str:
    head = ["step", "peak", "peak phase", "dominant", *LIVE_CLASSES, SPIKE]
    rows = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for step in run.steps:
        live: Mapping[str, Any] = step.live_at_peak or {}
        cells = [str(step.step), format_bytes(step.peak), str(step.peak_phase), str(step.dominant)]
        cells += [format_bytes(live.get(name)) for name in LIVE_CLASSES]
        cells.append(format_bytes(step.spike_at_peak))
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    rows.append("</table>")
    return "\n".join(rows)


__all__ = ["CHART_ID", "build_figure", "chart_html", "peak_data", "plotly_script", "render_html", "render_page", "LIVE_CLASSES"]
