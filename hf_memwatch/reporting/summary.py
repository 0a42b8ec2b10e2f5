"""The console summary at train end: the peak step's memory classes, shares and bytes per parameter.

Bytes per parameter sit beside the rule of thumb of the Transformers "GPU memory usage" guide
(weights 4 B/param in fp32, 6 in mixed precision; gradients 4; AdamW 8, 8-bit AdamW 2, SGD with
momentum 4), so a class far from its rule stands out.

Usage:
    >>> print_summary("out/memwatch")   # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core.categories import LIVE_CLASSES, phase_words
from ..core.extras import installed
from ..core.records import EvalRecord, FootprintRecord, MetaRecord, PlanRecord, Record, Snapshot, StepRecord
from ..core.units import format_bytes
from ..measure.footprint import allocator_settings, expandable_segments_advice
from .sinks import composition_at_peak

logger = logging.getLogger("hf_memwatch")

PICTURE_NAME = "memory.png"
TABLE_NAME = "memory.html"  # the steps table, written instead of the picture without matplotlib


def rule_of_thumb(name: str, precision: str | None, optim: str | None) -> float | None:
    """The guide's bytes per parameter for class ``name`` (None where it gives none).

    Example:
        >>> rule_of_thumb("weights", "bf16", "adamw_torch"), rule_of_thumb("optimizer_states", "fp32", "adamw_bnb_8bit")
        (6, 2)
    """
    optim = (optim or "").lower()
    if name == "weights":
        return 4 if precision in (None, "fp32") else 6
    if name == "gradients":
        return 4
    if name == "optimizer_states":
        if "8bit" in optim:
            return 2
        if "adam" in optim:
            return 8
        if "sgd" in optim:
            return 4
    return None


def peak_step(steps: list[StepRecord]) -> StepRecord | None:
    """The step record with the highest peak."""
    measured = [s for s in steps if s.peak is not None]
    return max(measured, key=lambda s: s.peak) if measured else None


def summary_rows(
    step: StepRecord, meta: MetaRecord | None, snapshots: list[Snapshot] | None = None
) -> list[dict[str, Any]]:
    """One row per class at ``step``'s peak: bytes, share of the peak, B/param and the guide's rule.

    ``snapshots`` are the step's snapshots (for the classes live at the peak moment, see
    :func:`~hf_memwatch.reporting.sinks.composition_at_peak`); shares are of live bytes plus the spike.
    """
    live, _ = composition_at_peak(step, list(snapshots or []))
    figures = {name: live.get(name) for name in LIVE_CLASSES}
    figures["temporaries"] = step.spike_at_peak
    total = sum(v or 0 for v in figures.values())
    params = meta.params if meta is not None else None
    trainable = (meta.trainable_params if meta is not None else None) or params
    rows = []
    for name, value in figures.items():
        # B/param of the class at its largest in the step: the guide's rules are about full sizes,
        # and gradients, for one, are still being built at a backward-pass peak.
        largest = max([value or 0] + [(s.live or {}).get(name) or 0 for s in snapshots or []])
        per = trainable if name in ("gradients", "optimizer_states") else params
        rows.append({
            "class": name,
            "bytes": value,
            "share": (value or 0) / total if total else None,
            "largest": largest if name != "temporaries" else None,
            "bytes_per_param": largest / per if per and name != "temporaries" else None,
            "rule": rule_of_thumb(name, meta.precision if meta else None, meta.optim if meta else None),
        })
    return rows


def build_table(
    steps: list[StepRecord],
    meta: MetaRecord | None,
    plan: PlanRecord | Mapping[str, Any] | None,
    snapshots: list[Snapshot] | None = None,
) -> Any:
    """The rich ``Table`` of the peak step (None when no step was measured)."""
    from rich.table import Table

    step = peak_step(steps)
    if step is None:
        return None
    step_snaps = [s for s in snapshots or [] if s.step == step.step]
    frozen = next((s.frozen_models for s in step_snaps if s.frozen_models), None)
    table = Table(
        title=f"hf-memwatch: peak step {step.step} — {format_bytes(step.peak)} {phase_words(step.peak_phase)}",
        caption=_caption(meta, plan, frozen),
    )
    for header, justify in (("class", "left"), ("at peak", "right"), ("share", "right"),
                            ("max in step", "right"), ("B/param", "right"), ("guide", "right")):
        table.add_column(header, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in summary_rows(step, meta, step_snaps):
        table.add_row(
            row["class"],
            format_bytes(row["bytes"]),
            "-" if row["share"] is None else f"{100 * row['share']:.1f} %",
            "-" if row["largest"] is None else format_bytes(row["largest"]),
            "-" if row["bytes_per_param"] is None else f"{row['bytes_per_param']:.2f}",
            "-" if row["rule"] is None else f"{row['rule']:g}",
        )
    return table


def _caption(meta: MetaRecord | None, plan: PlanRecord | Mapping[str, Any] | None,
             frozen_models: Mapping[str, int] | None = None) -> str:
    parts = []
    if meta is not None and meta.model:
        parts.append(f"{meta.model}, {meta.params or 0:,} params, batch {meta.micro_batch_size} × "
                     f"accum {meta.gradient_accumulation_steps}, {meta.precision}, {meta.optim}")
    if frozen_models:  # models the Trainer holds beside the trained one (TRL's ref_model): in weights
        parts.append("weights include frozen models the Trainer holds: " + ", ".join(
            f"{name} {format_bytes(nbytes)}" for name, nbytes in frozen_models.items()))
    parts.append(f"plan in force: {describe_plan(plan)}")
    return "\n".join(parts)


def describe_plan(plan: PlanRecord | Mapping[str, Any] | None) -> str:
    """One line for a ``plan`` record of the auto mode (a plain dict, as the callback saves it, is
    read as its :class:`~hf_memwatch.core.records.PlanRecord`).

    Example:
        >>> describe_plan({"micro_batch_size": 8, "gradient_accumulation_steps": 2, "optim": "adamw_torch",
        ...                "activation_checkpointing": True, "predicted_peak": 2**30, "budget": 2**31})
        'micro-batch 8 × accum 2, checkpointing on, adamw_torch, predicted peak 1.00 GiB, budget 2.00 GiB'
    """
    if not plan:
        return "none (auto mode off)"
    if isinstance(plan, Mapping):
        plan = PlanRecord.from_dict(dict(plan), lenient=True)
    if plan.status == "failed":
        return "none (planning failed: trained as configured)"
    parts = []
    if plan.micro_batch_size is not None:
        parts.append(f"micro-batch {plan.micro_batch_size} × accum {plan.gradient_accumulation_steps or 1}")
    if plan.activation_checkpointing is not None:
        parts.append(f"checkpointing {'on' if plan.activation_checkpointing else 'off'}")
    if plan.optim:
        parts.append(str(plan.optim))
    for key, value in (("predicted peak", plan.predicted_peak), ("budget", plan.budget)):
        if value:
            parts.append(f"{key} {format_bytes(value)}")
    return ", ".join(parts) or str(plan.to_dict())


def load_summary_inputs(
    path: str | os.PathLike[str],
) -> tuple[list[StepRecord], MetaRecord | None, PlanRecord | None, list[Snapshot]]:
    """(step records, meta, last plan record, training snapshots) of rank 0's timeline under ``path``."""
    return summary_inputs(load_records(path))


def summary_inputs(
    records: list[Record],
) -> tuple[list[StepRecord], MetaRecord | None, PlanRecord | None, list[Snapshot]]:
    """:func:`load_summary_inputs` of records already read."""
    steps = [r for r in records if isinstance(r, StepRecord)]
    meta = next((r for r in reversed(records) if isinstance(r, MetaRecord)), None)
    plan = next((r for r in reversed(records) if isinstance(r, PlanRecord)), None)
    snapshots = [r for r in records if isinstance(r, Snapshot) and r.stage is None]  # eval loops': their records
    return steps, meta, plan, snapshots


def load_records(path: str | os.PathLike[str], event: str | None = None) -> list[Record]:
    """The typed records (the ``event`` ones, or all) of rank 0's timeline under ``path``
    (:func:`~hf_memwatch.core.timeline.read_records`: malformed lines and unknown events left out)."""
    from ..core.timeline import find_timelines, read_records

    files = find_timelines(path)
    return [r for r in (read_records(files[0]) if files else []) if event is None or r.EVENT == event]


def load_eval_records(path: str | os.PathLike[str]) -> list[EvalRecord]:
    """The ``eval`` records (one per evaluation/prediction loop) of rank 0's timeline under ``path``."""
    return [r for r in load_records(path, "eval") if isinstance(r, EvalRecord)]


def footprint_lines(footprints: list[FootprintRecord], steps: list[StepRecord],
                    snapshots: list[Snapshot], settings: str | None) -> list[str]:
    """What the limit counted beyond the allocated bytes, and the expandable-segments advice.

    ``footprints``: the auto mode's ``footprint`` records (their margin and advice, as measured in the
    run). Without them, on CUDA, the advice is worked out from the peak step's snapshots when the
    allocator ``settings`` of the run are known (at train end; ``None`` for a stored timeline).

    Example:
        >>> step = StepRecord.from_dict({"step": 2, "peak": 700 << 20}, lenient=True)
        >>> snaps = [Snapshot.from_dict({"step": 2, "reserved": 1 << 30, "num_alloc_retries": 0}, lenient=True)]
        >>> footprint_lines([], [step], snaps, "")[0][:62]
        'set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before th'
        >>> footprint_lines([], [step], snaps, "expandable_segments:True")
        []
    """
    lines = []
    if footprints:
        last = footprints[-1]
        if last.kind != "allocated":  # a byte budget on the CPU: nothing lies beyond the tensors
            lines.append(f"footprint measured in steps {', '.join(str(f.step) for f in footprints)}: "
                         f"up to {format_bytes(max(f.footprint_gap for f in footprints))} {last.kind} "
                         "beyond the allocated bytes, "
                         f"planning margin {last.margin:.1%}")
        advice = next((f.advice for f in footprints if f.advice), None)
    else:
        advice = None
        top = peak_step(list(steps))
        if top is not None and settings is not None:
            own = [s for s in snapshots if s.step == top.step and s.reserved is not None]
            if own:
                retries = max(int(s.num_alloc_retries or 0) for s in own)
                advice = expandable_segments_advice(max(int(s.reserved) for s in own), int(top.peak),
                                                    retries, settings)
    if advice:
        lines.append(advice)
    return lines


def highest_moment(steps: list[StepRecord], evals: list[EvalRecord]) -> str | None:
    """One line naming the run's highest moment, a training step or an eval loop.

    Example:
        >>> step = StepRecord.from_dict({"step": 3, "peak": 10 * 2**20, "peak_phase": "after_backward"}, lenient=True)
        >>> loop = EvalRecord.from_dict({"stage": "eval", "step": 2, "peak": 40 * 2**20, "peak_batch": 7,
        ...                              "live": {"outputs": 2**25}}, lenient=True)
        >>> highest_moment([step], [loop])
        'highest moment of the run: the eval loop after step 2, batch 7 — 40.00 MiB (accumulated outputs 32.00 MiB), above the highest training step (step 3, 10.00 MiB)'
    """
    step = peak_step(list(steps))
    loops = [e for e in evals if e.peak is not None]
    loop = max(loops, key=lambda e: e.peak) if loops else None
    if loop is not None and (step is None or loop.peak > step.peak):
        outputs = (loop.live or {}).get("outputs")
        text = (f"highest moment of the run: the {loop.stage} loop after step {loop.step}, batch "
                f"{loop.peak_batch} — {format_bytes(loop.peak)} (accumulated outputs {format_bytes(outputs)})")
        if step is not None:
            text += f", above the highest training step (step {step.step}, {format_bytes(step.peak)})"
        return text
    if step is None or loop is None:  # no eval loop: the table's title names the peak step already
        return None
    text = f"highest moment of the run: training step {step.step} {phase_words(step.peak_phase)} — {format_bytes(step.peak)}"
    if loop is not None:
        text += f"; eval loops peaked at {format_bytes(loop.peak)}"
    return text


def print_summary(path: str | os.PathLike[str], plan: PlanRecord | Mapping[str, Any] | None = None, console: Any = None,
                  settings: str | None = None) -> Any:
    """Print the table for the run under ``path``; returns it (None when there is nothing to show).

    ``settings``: the CUDA allocator settings the run had (:func:`footprint_lines`), when known."""
    from rich.console import Console

    records = load_records(path)  # the timeline read once
    steps, meta, recorded_plan, snapshots = summary_inputs(records)
    table = build_table(steps, meta, plan or recorded_plan, snapshots)
    moment = highest_moment(steps, [r for r in records if isinstance(r, EvalRecord)])
    footprints = [r for r in records if isinstance(r, FootprintRecord)]
    notes = footprint_lines(footprints, steps, snapshots, settings)
    if table is not None or moment or notes:
        console = console or Console()
        console.print()  # the progress bar may still hold the current line
        if table is not None:
            console.print(table)
        for line in [moment, *notes]:
            if line:
                console.print(line)
    return table


def finish_reports(directory: str | os.PathLike[str], report: bool | str, summary: bool,
                   plan: PlanRecord | Mapping[str, Any] | None) -> Any:
    """Train-end reporting of ``MemWatch`` in ``directory``: the picture and the summary (with the
    ``plan`` record in force), each failing alone, quietly; then, once, where the run's files are
    (:func:`files_line`; printed with the summary, else logged at INFO).

    ``report`` is ``True`` (the picture is drawn by a detached background process, returned so the
    caller can wait for it), ``"sync"`` (drawn here, before returning) or ``False``. Without
    matplotlib (the ``plot`` extra) no picture can be drawn: the steps table is written here instead
    (``memory.html``, no Plotly needed) and one line says so.
    """
    directory = Path(directory)
    process = None
    picture: Path | None = None
    if report == "sync" or (report and not installed("matplotlib")):
        picture = _draw_now(directory)
    elif report:
        try:
            from .background import start_report_process

            picture = directory / PICTURE_NAME
            process = start_report_process(directory, picture)
        except Exception as exc:  # noqa: BLE001 - no process (fork refused, ...): no picture, say so
            picture = None
            logger.warning("hf-memwatch: no memory picture (%s: %s); `hf-memwatch report %s` draws it",
                           type(exc).__name__, exc, directory)
    if summary:
        try:
            print_summary(directory, plan=plan, settings=allocator_settings())
        except Exception as exc:  # noqa: BLE001
            logger.warning("hf-memwatch: no summary table (%s: %s)", type(exc).__name__, exc)
    line = files_line(directory, picture, drawing=process is not None)
    if summary:
        print(line)
    else:
        logger.info(line)
    return process


def files_line(directory: Path, picture: Path | None, drawing: bool) -> str:
    """One line: where the run's timeline, picture and page are (the page: the command that writes it).

    Example:
        >>> files_line(Path("out/memwatch"), Path("out/memwatch/memory.png"), drawing=True)  # doctest: +NORMALIZE_WHITESPACE
        'hf-memwatch: files in out/memwatch: timeline timeline.jsonl; picture memory.png (drawn in the background:
        MemWatch.wait_for_reports() waits for it); page: hf-memwatch report out/memwatch -o memory.html'
    """
    from ..core.timeline import find_timelines

    timelines = [path.name for path in find_timelines(directory)] if directory.is_dir() else []
    timeline = (timelines[0] if len(timelines) == 1 else
                f"{len(timelines)} files timeline*.jsonl (one per rank)" if timelines else "timeline.jsonl")
    parts = [f"timeline {timeline}"]
    if picture is None:
        parts.append("no picture")
    elif picture.suffix == ".png":
        parts.append(f"picture {picture.name}" + (" (drawn in the background: MemWatch.wait_for_reports() "
                                                  "waits for it)" if drawing else ""))
    else:
        parts.append(f"steps table {picture.name} (no picture: matplotlib is not installed)")
    parts.append(f"page: hf-memwatch report {directory} -o memory.html")
    return f"hf-memwatch: files in {directory}: " + "; ".join(parts)


def _draw_now(directory: Path) -> Path | None:
    """Draw the picture (or, without matplotlib, the steps table) here; the file written, else None."""
    try:
        from .report import write_report

        notes: list[str] = []
        path = write_report(directory, directory / PICTURE_NAME, notes=notes)
        for note in notes:
            logger.warning("hf-memwatch: %s", note)
        return path
    except Exception as exc:  # noqa: BLE001 - a picture must never fail a finished run
        logger.warning("hf-memwatch: no memory picture (%s: %s)", type(exc).__name__, exc)
        return None
