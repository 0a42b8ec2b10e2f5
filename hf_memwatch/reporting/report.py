"""The picture of a run: where each step's memory goes, phase by phase (PNG via matplotlib, or HTML).

One panel per rank (small multiples, shared axes): the live classes stacked across the phases of
every step, the spike (temporaries above live memory inside a phase) on top, a marker at each
step's peak, the budget as a line and the auto mode's plan events as vertical marks.

Usage:
    >>> write_report("out/memwatch", "memory.png")   # doctest: +SKIP
    >>> # or: hf-memwatch report out -o memory.html
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.categories import PHASES
from ..core.errors import MemWatchConfigError
from ..core.extras import installed, off_line
from ..core.records import (
    MetaRecord,
    Snapshot,
)
from ..core.units import format_bytes
from .run_view import (  # noqa: F401  (re-exported: the report's readers load runs from here)
    COLOURS,
    FROZEN,
    LABELS,
    SPIKE,
    Band,
    RankTimeline,
    budget_of,
    choose_unit,
    eval_position,
    event_label,
    event_step,
    first_of_steps,
    live_bands,
    load_run,
    load_runs,
    peak_index,
    predicted_peak_of,
    step_starts,
    title_of,
)
from .timeaxis import XAxis, x_axes

if TYPE_CHECKING:  # torch is imported by run_config; the report never needs it (1.35 s of its 6 s)
    from ..core.run_config import RunConfig

PHASE_LETTERS = dict(zip(PHASES, "bFBOe", strict=True))


def run_meta(model: Any, run: RunConfig, degraded: list[str] | None = None) -> MetaRecord:
    """The ``meta`` timeline record: what the picture's title and the summary say about the run;
    ``degraded``: the features a failed probe turned off (:mod:`hf_memwatch.compat.probes`)."""
    params = sum(p.numel() for p in model.parameters()) if model is not None else None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if model is not None else None
    return MetaRecord(
        model=type(model).__name__ if model is not None else None,
        params=params,
        trainable_params=trainable,
        micro_batch_size=run.micro_batch_size,
        gradient_accumulation_steps=run.gradient_accumulation_steps,
        precision=run.precision,
        optim=run.optim,
        world_size=run.world_size,
        degraded=degraded or None,
    )


def draw(runs: list[RankTimeline], budget: int | None = None, x_axis: str = "steps") -> Any:
    """The matplotlib Figure of ``runs`` (one panel per rank); ``x_axis``: ``steps`` (one band per
    phase) or ``seconds`` (wall clock since the first snapshot; a band spans the phase it closes)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    budget = budget if budget is not None else budget_of(runs)
    highest = max(
        [max((s.peak or 0), s.allocated + (s.spike or 0)) for r in runs for s in r.snapshots]
        + [e.peak for r in runs for e in r.evals] + [budget or 0]
    )
    unit, scale = choose_unit(highest)
    panels = [run for run in runs if run.snapshots] or runs
    axes_x = x_axes(panels, x_axis)
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(11, 3.6 + 2.6 * (len(panels) - 1) if len(panels) > 1 else 5.2),
        sharex=True, sharey=True, squeeze=False,
    )
    for ax, run, xaxis in zip(axes[:, 0], panels, axes_x, strict=True):
        _draw_rank(ax, run, unit, scale, budget, show_rank=len(panels) > 1, xaxis=xaxis)
    axes[-1, 0].set_xlabel("optimizer step (phases: b=begin, F=after forward, B=after backward, O=after optimizer)"
                           if x_axis == "steps" else "seconds since the first snapshot (wall clock; a band spans "
                                                     "the phase it closes)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 0.92), frameon=False, fontsize=9)
    fig.suptitle(title_of(runs), fontsize=12)
    fig.tight_layout()
    return fig


def _draw_rank(ax: Any, run: RankTimeline, unit: str, scale: int, budget: int | None, show_rank: bool,
               xaxis: XAxis | None = None) -> None:
    snaps = run.snapshots
    xaxis = xaxis or XAxis()
    # Each snapshot a flat band from i - 0.5 to i + 0.5 (as the page's bars), not a slope between
    # snapshots: a phase's spike, drawn at the boundary from the higher of its two ends, then sits on
    # the bars instead of floating over an interpolated middle.
    xs = [x for i in range(len(snaps)) for x in xaxis.span(i)]
    bands = live_bands(snaps)
    polys = ax.stackplot(xs, [[v / scale for v in band.values for _ in (0, 1)] for band in bands],
                         labels=[band.label for band in bands], colors=[band.colour for band in bands], alpha=0.9)
    for poly, band in zip(polys, bands, strict=True):
        if band.hatch:
            poly.set_hatch(band.hatch)
    _draw_spikes(ax, snaps, scale, xaxis)
    _mark_peaks(ax, run, snaps, scale, unit, xaxis)
    if budget:
        ax.axhline(budget / scale, color="black", linestyle="--", linewidth=1.2, label=f"budget {format_bytes(budget)}")
    predicted = predicted_peak_of(run)
    if predicted:
        ax.axhline(predicted / scale, color="purple", linestyle="-.", linewidth=1.0,
                   label=f"predicted peak {format_bytes(predicted)}")
    _mark_events(ax, run, snaps, xaxis)
    _mark_evals(ax, run, snaps, scale, xaxis)
    if xaxis.times is None:
        _step_ticks(ax, snaps)
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(bottom=0)
    low, high = xaxis.at(-0.5), xaxis.at(len(snaps) - 0.5)
    ax.set_xlim(low, high if high > low else low + 1)
    ax.grid(axis="y", alpha=0.3)
    if show_rank:
        ax.set_title(run.name, fontsize=10, loc="left")


def _phase_span(snaps: list[Snapshot], i: int) -> tuple[float, float]:
    """(x, floor) of the phase that ends at snapshot ``i``: its middle and the higher live end."""
    if i == 0:
        return 0.0, snaps[0].allocated
    return i - 0.5, max(snaps[i - 1].allocated, snaps[i].allocated)


def _draw_spikes(ax: Any, snaps: list[Snapshot], scale: int, xaxis: XAxis) -> None:
    """The spike of each phase: a block from the higher live end of the phase up to the phase's peak."""
    xs, bottoms, heights, widths = [], [], [], []
    for i, snap in enumerate(snaps):
        if snap.spike:
            x, floor = _phase_span(snaps, i)
            xs.append(xaxis.at(x))
            bottoms.append(floor / scale)
            heights.append(snap.spike / scale)
            low, high = xaxis.span(i)
            widths.append(0.4 if xaxis.times is None else 0.4 * (high - low))
    ax.bar(xs, heights, bottom=bottoms, width=widths, color=COLOURS[SPIKE], alpha=0.95, label=LABELS[SPIKE],
           linewidth=0.4, edgecolor="#9a7612")


def _mark_peaks(ax: Any, run: RankTimeline, snaps: list[Snapshot], scale: int, unit: str, xaxis: XAxis) -> None:
    xs, ys = [], []
    for i, step in peak_index(run):
        xs.append(xaxis.at(_phase_span(snaps, i)[0]))
        ys.append(step.peak / scale)
    if xs:
        size = 6 if len(xs) <= 40 else 3
        ax.plot(xs, ys, linestyle="none", marker="v", color="black", markersize=size, label="step peak")
        top = max(range(len(xs)), key=lambda k: ys[k])
        ax.annotate(f"peak {ys[top]:.1f} {unit}", (xs[top], ys[top]), textcoords="offset points", xytext=(5, 5),
                    fontsize=9)


def _mark_events(ax: Any, run: RankTimeline, snaps: list[Snapshot], xaxis: XAxis) -> None:
    first_of_step = first_of_steps(snaps)
    labelled = False
    for event in run.events:
        step = event_step(event)
        x = xaxis.at((first_of_step.get(step, 0) if step is not None else 0) - 0.5)  # before the step's first bar
        label = event_label(event)
        ax.axvline(x, color="purple", linestyle=":", linewidth=1.4, label=None if labelled else "plan / remedy / oom")
        ax.annotate(label, (x, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=8, color="purple")
        labelled = True


def _mark_evals(ax: Any, run: RankTimeline, snaps: list[Snapshot], scale: int, xaxis: XAxis) -> None:
    """Each eval/predict loop: a dashed line after the step it followed, its peak as a diamond."""
    labelled = False
    for loop in run.evals:
        x = xaxis.at(eval_position(loop, snaps))
        label = None if labelled else "eval / predict loop (its peak)"
        ax.axvline(x, color="darkorange", linestyle="--", linewidth=1.2, label=label)
        ax.plot([x], [loop.peak / scale], linestyle="none", marker="D", color="darkorange", markersize=6)
        ax.annotate(f"{loop.stage} {format_bytes(loop.peak)}", (x, loop.peak / scale),
                    textcoords="offset points", xytext=(4, 4), fontsize=8, color="darkorange")
        labelled = True


def _step_ticks(ax: Any, snaps: list[Snapshot]) -> None:
    starts = step_starts(snaps)
    if not starts:
        return
    every = max(1, len(starts) // 12)  # at most ~12 labelled steps, readable for long runs
    ax.set_xticks([i for i, _ in starts[::every]], [str(step) for _, step in starts[::every]])
    if len(starts) <= 6:  # few steps: name the phases as well
        ax.set_xticks(range(len(snaps)), minor=True)
        ax.set_xticklabels([PHASE_LETTERS.get(s.phase, "") for s in snaps], minor=True, fontsize=7)
        ax.tick_params(axis="x", which="major", pad=12)
    if len(starts) <= 40:  # step separators only while they do not blur into a grey band
        for i, _ in starts:
            ax.axvline(i - 0.5, color="white", linewidth=0.6, alpha=0.6)


def write_report(path: str | os.PathLike[str] | list[Any], out: str | os.PathLike[str], budget: int | None = None,
                 notes: list[str] | None = None, x_axis: str = "steps") -> Path:
    """Draw the run under ``path`` into ``out`` (``.png`` or ``.html``); returns the file written.
    Several paths: the runs side by side (a panel each, shared axes; the page is the static one).

    The interactive page (Plotly installed, one run) holds the chart and the tables, not the picture
    (the chart shows all it does; drawing it cost 1.2 s and 150 kB). Without matplotlib (the ``plot``
    extra) a ``.png`` cannot be drawn: the steps table is written
    beside it as ``.html`` instead (the path returned); without Plotly (``page``) the page is the
    static one. ``x_axis``: the picture's (``steps`` or ``seconds``: :func:`draw`; the interactive page
    has buttons for both). Each such fallback appends its one line (:func:`~hf_memwatch.core.extras.off_line`)
    to ``notes`` for the caller to print.
    """
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in (".png", ".html", ".htm"):
        raise MemWatchConfigError(f"report output must end in .png or .html; got {out.name!r}")
    from .page import render_html  # the pages, static and interactive

    runs = load_runs(path)
    notes = [] if notes is None else notes
    drawable = installed("matplotlib")
    out.parent.mkdir(parents=True, exist_ok=True)
    compared = len({run.label for run in runs}) > 1
    if suffix == ".png" and not drawable:  # the steps table alone (no Plotly either: it is written in no time)
        out = out.with_suffix(".html")
        notes.append(f"{off_line('matplotlib')}; wrote the steps table to {out.name} instead")
        out.write_text(render_html(runs, None, budget, interactive=False), encoding="utf-8")
        return out
    if suffix != ".png" and not installed("plotly"):
        notes.append(f"{off_line('plotly')}; {out.name} is the static page (picture and table)")
    elif suffix != ".png" and not compared:  # the interactive page draws everything the picture does: no
        out.write_text(render_html(runs, None, budget), encoding="utf-8")  # matplotlib (1.2 s of 5 s before)
        return out
    if not drawable:
        out.write_text(render_html(runs, None, budget), encoding="utf-8")
        return out
    fig = draw(runs, budget, x_axis)
    try:
        if suffix == ".png":
            fig.savefig(out, dpi=120, bbox_inches="tight")
        else:
            out.write_text(render_html(runs, fig, budget, interactive=not compared), encoding="utf-8")
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return out
