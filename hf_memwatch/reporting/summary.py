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

from ..core.categories import LIVE_CLASSES
from ..core.units import format_bytes
from ..measure.footprint import allocator_settings, expandable_segments_advice
from .sinks import composition_at_peak

logger = logging.getLogger("hf_memwatch")

PICTURE_NAME = "memory.png"


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


def peak_step(steps: list[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The step record with the highest peak."""
    measured = [s for s in steps if s.get("peak") is not None]
    return max(measured, key=lambda s: s["peak"]) if measured else None


def summary_rows(
    step: Mapping[str, Any], meta: Mapping[str, Any], snapshots: list[Mapping[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """One row per class at ``step``'s peak: bytes, share of the peak, B/param and the guide's rule.

    ``snapshots`` are the step's snapshots (for the classes live at the peak moment, see
    :func:`~hf_memwatch.reporting.sinks.composition_at_peak`); shares are of live bytes plus the spike.
    """
    live, _ = composition_at_peak(step, list(snapshots or []))
    figures = {name: live.get(name) for name in LIVE_CLASSES}
    figures["temporaries"] = step.get("spike_at_peak")
    total = sum(v or 0 for v in figures.values())
    params, trainable = meta.get("params"), meta.get("trainable_params") or meta.get("params")
    rows = []
    for name, value in figures.items():
        # B/param of the class at its largest in the step: the guide's rules are about full sizes,
        # and gradients, for one, are still being built at a backward-pass peak.
        largest = max([value or 0] + [(s.get("live") or {}).get(name) or 0 for s in snapshots or []])
        per = trainable if name in ("gradients", "optimizer_states") else params
        rows.append({
            "class": name,
            "bytes": value,
            "share": (value or 0) / total if total else None,
            "largest": largest if name != "temporaries" else None,
            "bytes_per_param": largest / per if per and name != "temporaries" else None,
            "rule": rule_of_thumb(name, meta.get("precision"), meta.get("optim")),
        })
    return rows


def build_table(
    steps: list[Mapping[str, Any]],
    meta: Mapping[str, Any],
    plan: Mapping[str, Any] | None,
    snapshots: list[Mapping[str, Any]] | None = None,
) -> Any:
    """The rich ``Table`` of the peak step (None when no step was measured)."""
    from rich.table import Table

    step = peak_step(steps)
    if step is None:
        return None
    step_snaps = [s for s in snapshots or [] if s.get("step") == step["step"]]
    frozen = next((s["frozen_models"] for s in step_snaps if s.get("frozen_models")), None)
    table = Table(
        title=f"hf-memwatch: peak step {step['step']} — {format_bytes(step['peak'])} at {step.get('peak_phase')}",
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


def _caption(meta: Mapping[str, Any], plan: Mapping[str, Any] | None,
             frozen_models: Mapping[str, int] | None = None) -> str:
    parts = []
    if meta.get("model"):
        parts.append(f"{meta['model']}, {meta.get('params', 0):,} params, batch {meta.get('batch_size')} × "
                     f"accum {meta.get('gradient_accumulation_steps')}, {meta.get('precision')}, {meta.get('optim')}")
    if frozen_models:  # models the Trainer holds beside the trained one (TRL's ref_model): in weights
        parts.append("weights include frozen models the Trainer holds: " + ", ".join(
            f"{name} {format_bytes(nbytes)}" for name, nbytes in frozen_models.items()))
    parts.append(f"plan in force: {describe_plan(plan)}")
    return "\n".join(parts)


def describe_plan(plan: Mapping[str, Any] | None) -> str:
    """One line for a ``plan`` record of the auto mode.

    Example:
        >>> describe_plan({"micro_batch_size": 8, "gradient_accumulation_steps": 2, "optim": "adamw_torch",
        ...                "activation_checkpointing": True, "predicted_peak": 2**30, "budget": 2**31})
        'micro-batch 8 × accum 2, checkpointing on, adamw_torch, predicted peak 1.00 GiB, budget 2.00 GiB'
    """
    if not plan:
        return "none (auto mode off)"
    if plan.get("status") == "failed":
        return "none (planning failed: trained as configured)"
    parts = []
    if "micro_batch_size" in plan:
        parts.append(f"micro-batch {plan['micro_batch_size']} × accum {plan.get('gradient_accumulation_steps', 1)}")
    if "activation_checkpointing" in plan:
        parts.append(f"checkpointing {'on' if plan['activation_checkpointing'] else 'off'}")
    if plan.get("optim"):
        parts.append(str(plan["optim"]))
    for key in ("predicted_peak", "budget"):
        if plan.get(key):
            parts.append(f"{key.replace('_', ' ')} {format_bytes(plan[key])}")
    return ", ".join(parts) or str(dict(plan))


def load_summary_inputs(
    path: str | os.PathLike[str],
) -> tuple[list[dict[str, Any]], dict[str, Any], dict | None, list[dict[str, Any]]]:
    """(step records, meta, last plan record, snapshots) of rank 0's timeline under ``path``."""
    from ..core.timeline import find_timelines, read_timeline

    files = find_timelines(path)
    steps: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    plan = None
    snapshots: list[dict[str, Any]] = []
    for record in read_timeline(files[0]) if files else []:
        kind = record.get("event")
        if kind == "snapshot" and "stage" not in record:  # eval loops' snapshots: load_eval_records
            snapshots.append(record)
        elif kind == "step":
            steps.append(record)
        elif kind == "meta":
            meta.update(record)
        elif kind == "plan":
            plan = record
    return steps, meta, plan, snapshots


def load_records(path: str | os.PathLike[str], event: str) -> list[dict[str, Any]]:
    """The ``event`` records of rank 0's timeline under ``path``."""
    from ..core.timeline import find_timelines, read_timeline

    files = find_timelines(path)
    return [r for r in (read_timeline(files[0]) if files else []) if r.get("event") == event]


def load_eval_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The ``eval`` records (one per evaluation/prediction loop) of rank 0's timeline under ``path``."""
    return load_records(path, "eval")


def footprint_lines(footprints: list[Mapping[str, Any]], steps: list[Mapping[str, Any]],
                    snapshots: list[Mapping[str, Any]], settings: str | None) -> list[str]:
    """What the limit counted beyond the allocated bytes, and the expandable-segments advice.

    ``footprints``: the auto mode's ``footprint`` records (their margin and advice, as measured in the
    run). Without them, on CUDA, the advice is worked out from the peak step's snapshots when the
    allocator ``settings`` of the run are known (at train end; ``None`` for a stored timeline).

    Example:
        >>> step = {"step": 2, "peak": 700 << 20}
        >>> snaps = [{"step": 2, "reserved": 1 << 30, "num_alloc_retries": 0}]
        >>> footprint_lines([], [step], snaps, "")[0][:62]
        'set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before th'
        >>> footprint_lines([], [step], snaps, "expandable_segments:True")
        []
    """
    lines = []
    if footprints:
        last = footprints[-1]
        if last["kind"] != "allocated":  # a byte budget on the CPU: nothing lies beyond the tensors
            lines.append(f"footprint measured in steps {', '.join(str(f['step']) for f in footprints)}: "
                         f"up to {format_bytes(max(f['footprint_gap'] for f in footprints))} {last['kind']} "
                         "beyond the allocated bytes, "
                         f"planning margin {last['margin']:.1%}")
        advice = next((f["advice"] for f in footprints if f.get("advice")), None)
    else:
        advice = None
        top = peak_step(list(steps))
        if top is not None and settings is not None:
            own = [s for s in snapshots if s.get("step") == top["step"] and s.get("reserved") is not None]
            if own:
                retries = max(int(s.get("num_alloc_retries") or 0) for s in own)
                advice = expandable_segments_advice(max(int(s["reserved"]) for s in own), int(top["peak"]),
                                                    retries, settings)
    if advice:
        lines.append(advice)
    return lines


def highest_moment(steps: list[Mapping[str, Any]], evals: list[Mapping[str, Any]]) -> str | None:
    """One line naming the run's highest moment, a training step or an eval loop.

    Example:
        >>> highest_moment([{"step": 3, "peak": 10 * 2**20, "peak_phase": "after_backward"}],
        ...                [{"stage": "eval", "step": 2, "peak": 40 * 2**20, "peak_batch": 7, "live": {"outputs": 2**25}}])
        'highest moment of the run: the eval loop after step 2, batch 7 — 40.00 MiB (accumulated outputs 32.00 MiB), above the highest training step (step 3, 10.00 MiB)'
    """
    step = peak_step(list(steps))
    loops = [e for e in evals if e.get("peak") is not None]
    loop = max(loops, key=lambda e: e["peak"]) if loops else None
    if loop is not None and (step is None or loop["peak"] > step["peak"]):
        outputs = (loop.get("live") or {}).get("outputs")
        text = (f"highest moment of the run: the {loop.get('stage')} loop after step {loop.get('step')}, batch "
                f"{loop.get('peak_batch')} — {format_bytes(loop['peak'])} (accumulated outputs {format_bytes(outputs)})")
        if step is not None:
            text += f", above the highest training step (step {step['step']}, {format_bytes(step['peak'])})"
        return text
    if step is None:
        return None
    text = f"highest moment of the run: training step {step['step']} at {step.get('peak_phase')} — {format_bytes(step['peak'])}"
    if loop is not None:
        text += f"; eval loops peaked at {format_bytes(loop['peak'])}"
    return text


def print_summary(path: str | os.PathLike[str], plan: Mapping[str, Any] | None = None, console: Any = None,
                  settings: str | None = None) -> Any:
    """Print the table for the run under ``path``; returns it (None when there is nothing to show).

    ``settings``: the CUDA allocator settings the run had (:func:`footprint_lines`), when known."""
    from rich.console import Console

    steps, meta, recorded_plan, snapshots = load_summary_inputs(path)
    table = build_table(steps, meta, plan or recorded_plan, snapshots)
    moment = highest_moment(steps, load_eval_records(path))
    notes = footprint_lines(load_records(path, "footprint"), steps, snapshots, settings)
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
                   plan: Mapping[str, Any] | None) -> Any:
    """Train-end reporting of ``MemWatch`` in ``directory``: the picture and the summary (with the
    ``plan`` record in force), each failing alone, quietly.

    ``report`` is ``True`` (the picture is drawn by a detached background process, returned so the
    caller can wait for it), ``"sync"`` (drawn here, before returning) or ``False``.
    """
    directory = Path(directory)
    process = None
    if report == "sync":
        _draw_now(directory)
    elif report:
        try:
            from .background import start_report_process

            process = start_report_process(directory, directory / PICTURE_NAME)
            logger.info("hf-memwatch: drawing the memory picture into %s in the background",
                        directory / PICTURE_NAME)
        except Exception as exc:  # noqa: BLE001 - no process (fork refused, ...): no picture, say so
            logger.warning("hf-memwatch: no memory picture (%s: %s); `hf-memwatch report %s` draws it",
                           type(exc).__name__, exc, directory)
    if summary:
        try:
            print_summary(directory, plan=plan, settings=allocator_settings())
        except Exception as exc:  # noqa: BLE001
            logger.warning("hf-memwatch: no summary table (%s: %s)", type(exc).__name__, exc)
    return process


def _draw_now(directory: Path) -> None:
    try:
        from .report import write_report

        path = write_report(directory, directory / PICTURE_NAME)
        logger.info("hf-memwatch: memory picture in %s", path)
    except ImportError as exc:
        logger.warning("hf-memwatch: no memory picture: %s (pip install 'hf-memwatch[plot]', or "
                       "MemWatch(report=False))", exc)
    except Exception as exc:  # noqa: BLE001 - a picture must never fail a finished run
        logger.warning("hf-memwatch: no memory picture (%s: %s)", type(exc).__name__, exc)
