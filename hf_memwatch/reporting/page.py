"""The interactive page: ``hf-memwatch report RUN -o memory.html`` — one self-contained file.

Plotly (``include_plotlyjs=True``: the library is inlined, the page loads with no network) draws,
for every rank, the live classes of each snapshot as stacked bars (one bar per phase of each step,
hover: step, micro-batch, phase, every class, their total and the phase peak, in MiB/GiB as the
y-axis), the spike on top, each step's peak as a marker, the process's host RSS as a dotted line on a
right-hand axis, the budget and the plan's predicted peak as lines, eval/predict loops and
plan/remedy/OOM events as marked vertical lines; a range slider zooms over steps; a menu selects the rank. A click on
a step (its bars or its peak marker) shows that step's ``peak_tensors`` record below the chart: the
largest tensors alive at its peak, then the bytes by module and by operator. The static PNG
(``memory.png``) stays for the summary and CI logs; the page also embeds it, and a table of every step.

==================  ===================================================================
element id           content
==================  ===================================================================
``memchart``         the Plotly chart (``data``: per rank, the classes, spike, peaks)
``peak-data``        JSON: ``"rank:step"`` -> that step's ``peak_tensors`` record
``tensors``          filled on click: ``<h2>``, the top-tensors table, module/operator tables
==================  ===================================================================
"""

from __future__ import annotations

import html
import json
from typing import Any

from ..core.categories import LIVE_CLASSES
from ..core.units import format_bytes
from .report import (
    COLOURS,
    LABELS,
    SPIKE,
    RankTimeline,
    budget_of,
    choose_unit,
    eval_position,
    event_label,
    event_step,
    first_of_steps,
    live_bands,
    peak_index,
    predicted_peak_of,
    step_starts,
    title_of,
)

CHART_ID = "memchart"

# Runs after Plotly drew the chart: a click on any point carries [rank, step] in its customdata.
_CLICK_JS = """
var chart = document.getElementById('{plot_id}');
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


def build_figure(runs: list[RankTimeline], budget: int | None = None) -> Any:
    """The Plotly figure: every rank's traces, the first rank visible, a menu to choose."""
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
    fig.update_layout(
        title=title_of(runs).replace("\n", "<br><sup>") + ("</sup>" if "\n" in title_of(runs) else ""),
        barmode="stack", bargap=0.05, shapes=shapes, annotations=notes, hovermode="closest",
        xaxis={"title": "optimizer step (one bar per phase)", "rangeslider": {"visible": True},
               "tickvals": [i for i, _ in starts[::every]], "ticktext": [str(step) for _, step in starts[::every]]},
        yaxis={"title": "memory", "tickvals": ticks[0], "ticktext": ticks[1], "rangemode": "tozero"}, height=620,
        yaxis2={"title": "host RSS (resident)", "overlaying": "y", "side": "right", "showgrid": False,
                "tickvals": rss_ticks[0], "ticktext": rss_ticks[1], "rangemode": "tozero"},
        legend={"orientation": "v"},
        updatemenus=[{"buttons": buttons, "direction": "down", "x": 0, "xanchor": "left", "y": 1.12,
                      "yanchor": "top", "showactive": True}] if len(runs) > 1 else [],
    )
    return fig


def peak_data(runs: list[RankTimeline]) -> dict[str, Any]:
    """``"rank:step"`` -> the step's ``peak_tensors`` record (what a click shows)."""
    return {f"{run.rank}:{step}": record.to_dict() for run in runs for step, record in run.peak_tensors.items()}


def render_page(runs: list[RankTimeline], png_base64: str | None, steps_tables: list[str], budget: int | None = None) -> str:
    """The whole page: the chart (Plotly inlined), the click target, the PNG and the steps tables."""
    fig = build_figure(runs, budget)
    chart = fig.to_html(full_html=False, include_plotlyjs=True, div_id=CHART_ID, post_script=_CLICK_JS,
                        config={"displaylogo": False, "responsive": True})
    data = json.dumps(peak_data(runs)).replace("</", "<\\/")
    title = html.escape(title_of(runs).replace("\n", " — "))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>", f"<title>{title}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<script type='application/json' id='peak-data'>{data}</script>",
        chart,
        "<p class='hint'>Hover a bar for its bytes; drag or use the slider to zoom over steps; click a step "
        "(a bar or its peak ▼) for the tensors alive at its peak, by module and operator.</p>",
        "<div id='tensors'></div>",
        *(["<h2>picture</h2>", f"<img alt='memory per phase' src='data:image/png;base64,{png_base64}'>"]
          if png_base64 is not None else []),  # None: no matplotlib
        *steps_tables,
        "</body></html>",
    ]
    return "\n".join(parts)


__all__ = ["CHART_ID", "build_figure", "peak_data", "render_page", "LIVE_CLASSES"]
