"""A run's timeline as the picture and the page draw it: every rank's records by kind, the colours, the bands.

:func:`load_run` reads each rank's timeline into a :class:`RankTimeline`; the helpers below (the live
bands, the peaks' positions, the events in words, the title, the unit) are what both renderings draw
with — the matplotlib picture (:mod:`hf_memwatch.reporting.report`) and the Plotly page
(:mod:`hf_memwatch.reporting.page`) — so neither imports the other for them.

Example:
    >>> choose_unit(3 * 2**30)
    ('GiB', 1073741824)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from ..core.categories import LIVE_CLASSES, STEP_BEGIN
from ..core.errors import MemWatchConfigError
from ..core.optimizers import EIGHT_BIT_NAMES
from ..core.records import (
    EvalRecord,
    MetaRecord,
    OomRecord,
    PeakTensorsRecord,
    PlanRecord,
    Snapshot,
    StepRecord,
)
from ..core.timeline import Unread, _rank_of, find_timelines, read_records
from ..core.units import format_bytes

SPIKE = "spike"
COLOURS = {"weights": "#4C72B0", "gradients": "#DD8452", "optimizer_states": "#55A868", "activations": "#C44E52",
           "other": "#8C8C8C", SPIKE: "#F2C14E"}
LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "activations": "activations (saved for backward)",
    "other": "other (inputs, logits, buffers)",
    SPIKE: "spike (temporaries inside the phase)",
}
# Bottom up: what stays from step to step (weights, optimizer states), then what each step makes and frees.
STACK_ORDER = ("weights", "optimizer_states", "gradients", "activations", "other")


@dataclass
class RankTimeline:
    """The typed records of one rank's timeline (:func:`~hf_memwatch.core.timeline.read_records`), by kind."""

    rank: int
    snapshots: list[Snapshot] = field(default_factory=list)  # training snapshots with allocator figures
    steps: list[StepRecord] = field(default_factory=list)
    events: list[PlanRecord | OomRecord] = field(default_factory=list)  # plan, oom
    evals: list[EvalRecord] = field(default_factory=list)  # one ``eval`` record per eval/predict loop
    meta: MetaRecord | None = None
    peak_tensors: dict[int, PeakTensorsRecord] = field(default_factory=dict)  # step -> its ``peak_tensors``
    skipped: list[str] = field(default_factory=list)  # "<file> record N: why" of each malformed record left out
    unknown: list[str] = field(default_factory=list)  # "<file> record N: unknown event ..." (a newer version's)
    label: str = ""  # the run it belongs to, where several runs are compared (load_runs)

    @property
    def name(self) -> str:  # "rank 1", or "RUN_B rank 1" where runs are compared
        return f"{self.label} rank {self.rank}".strip()


def load_runs(paths: str | os.PathLike[str] | list[Any]) -> list[RankTimeline]:
    """:func:`load_run` of one path, or of several runs to compare (each rank labelled with its run)."""
    if isinstance(paths, (str, os.PathLike)) or len(paths) == 1:
        return load_run(paths if isinstance(paths, (str, os.PathLike)) else paths[0])
    return [replace(rank, label=str(path)) for path in paths for rank in load_run(path)]


def load_run(path: str | os.PathLike[str]) -> list[RankTimeline]:
    """Every rank's timeline under ``path`` (a timeline file, a ``memwatch`` folder or an output dir)."""
    files = find_timelines(path)
    if not files:
        raise FileNotFoundError(f"no timeline*.jsonl under {path}")
    runs = []
    for file in files:
        run, unread = RankTimeline(rank=_rank_of(file)), list[Unread]()
        for record in read_records(file, unread):
            _file(run, record)
        for line in unread:
            (run.unknown if line.event is not None else run.skipped).append(f"{file.name} record {line.number}: "
                                                                             f"{line.why}")
        runs.append(run)
    if not any(run.snapshots for run in runs):
        raise MemWatchConfigError(f"the timeline under {path} has no snapshot with allocator figures to draw")
    return runs


def _file(run: RankTimeline, record: Any) -> None:
    """Put ``record`` where the picture reads it (eval loops are drawn from their ``eval`` records)."""
    if isinstance(record, Snapshot):
        if record.allocated is not None and record.stage is None:
            run.snapshots.append(record)
    elif isinstance(record, EvalRecord):
        if record.peak is not None:
            run.evals.append(record)
    elif isinstance(record, StepRecord):
        run.steps.append(record)
    elif isinstance(record, MetaRecord):
        run.meta = record
    elif isinstance(record, (PlanRecord, OomRecord)):
        run.events.append(record)
    elif isinstance(record, PeakTensorsRecord) and record.step is not None:
        run.peak_tensors[record.step] = record


def budget_of(runs: list[RankTimeline]) -> int | None:
    """The budget recorded by the last plan event, if any."""
    for run in runs:
        for event in reversed(run.events):
            if isinstance(event, PlanRecord) and event.budget:
                return int(event.budget)
    return None


def predicted_peak_of(run: RankTimeline) -> int | None:
    """The predicted peak of the rank's last plan event, if any."""
    return next((e.predicted_peak for e in reversed(run.events) if isinstance(e, PlanRecord)), None)


def event_label(event: PlanRecord | OomRecord) -> str:
    """``plan: micro-batch 2 × accum 4, checkpointing`` (a plan: every remedy it holds, checkpointing and
    an 8-bit optimizer included, so a plan whose only change is checkpointing says so), ``oom``: what the
    picture writes at an event."""
    label = event.EVENT
    if isinstance(event, PlanRecord) and event.micro_batch_size:
        label += f": micro-batch {event.micro_batch_size} × accum {event.gradient_accumulation_steps or 1}"
        label += ", checkpointing" if event.activation_checkpointing else ""
        label += f", {event.optim}" if event.optim in EIGHT_BIT_NAMES else ""  # the optimizer remedy
    return label


def event_text(event: PlanRecord | OomRecord) -> str:
    """An event in words for the page's list (not the record's raw fields)."""
    if isinstance(event, PlanRecord):
        return (f"{event_label(event)} — predicted peak {format_bytes(event.predicted_peak)}, budget "
                f"{format_bytes(event.budget)}: {event.reason}")
    return (f"out of memory at step {event.step} ({event.stage or 'train'}, {event.last_phase}): "
            f"{format_bytes(event.requested)} requested with {format_bytes(event.allocated_at_failure)} allocated")


def event_step(event: PlanRecord | OomRecord) -> int | None:
    """The step an event happened at (a plan is made before any: None)."""
    return getattr(event, "step", None)


def choose_unit(peak: float) -> tuple[str, int]:
    """GiB for figures of a GiB or more, MiB otherwise (KiB for tiny ones).

    Example:
        >>> choose_unit(3 * 2**30), choose_unit(5 * 2**20)
        (('GiB', 1073741824), ('MiB', 1048576))
    """
    if peak >= 2**30:
        return "GiB", 2**30
    if peak >= 2**20:
        return "MiB", 2**20
    return "KiB", 2**10


def title_of(runs: list[RankTimeline]) -> str:
    """``Memory per phase — GPT2LMHeadModel (1.2M params), batch 8 × accum 1, fp32`` and the peak."""
    meta = next((run.meta for run in runs if run.meta), None)
    parts = []
    if meta is not None and meta.model:
        parts.append(f"{meta.model}" + (f" ({_count(meta.params)} params)" if meta.params else ""))
    if meta is not None and meta.micro_batch_size:
        parts.append(f"batch {meta.micro_batch_size} × accum {meta.gradient_accumulation_steps or 1}")
    if meta is not None and meta.precision:
        parts.append(str(meta.precision))
    labels = list(dict.fromkeys(run.label for run in runs))
    if len(labels) > 1:  # runs compared: each run's peak, named as given
        parts.append(f"{len(labels)} runs")
    elif len(runs) > 1:
        parts.append(f"{len(runs)} ranks")
    head = "Memory per phase of each step"
    peaks = [(label, max((s.peak for run in runs if run.label == label for s in run.steps if s.peak is not None),
                         default=None)) for label in labels]
    if len(labels) > 1:
        head += " — peak " + ", ".join(f"{format_bytes(peak)} ({label})" for label, peak in peaks if peak is not None)
    elif peaks[0][1] is not None:
        head += f" — peak {format_bytes(peaks[0][1])}"
    return head + ("\n" + ", ".join(parts) if parts else "")


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


@dataclass
class Band:
    """One stacked band of the picture: bytes per snapshot."""

    name: str
    label: str
    colour: str
    values: list[int]
    hatch: str | None = None


FROZEN = "frozen_models"
FROZEN_COLOUR = "#9DB4D8"


def live_bands(snaps: list[Snapshot]) -> list[Band]:
    """The stacked bands of the live classes, bottom first. When the Trainer holds frozen models (TRL's
    ``ref_model``, a teacher; the snapshots' ``frozen_models``), the weights are split: the frozen
    models' part (hatched) below the trained model's own."""
    live = {name: [int(s.live.get(name) or 0) for s in snaps] for name in LIVE_CLASSES}
    frozen = [sum((s.frozen_models or {}).values()) for s in snaps]
    bands = [Band(name, LABELS[name], COLOURS[name], live[name]) for name in STACK_ORDER]
    if not any(frozen):
        return bands
    names = sorted({name for s in snaps for name in (s.frozen_models or {})})
    trained = Band("weights", "weights (trained model)", COLOURS["weights"],
                   [max(0, w - f) for w, f in zip(live["weights"], frozen, strict=True)])
    held = Band(FROZEN, f"weights: frozen models held ({', '.join(names)})", FROZEN_COLOUR, frozen, hatch="//")
    return [held, trained, *bands[1:]]


def peak_index(run: RankTimeline) -> list[tuple[int, StepRecord]]:
    """(the index of the snapshot that closes the phase of the step's peak, the step) of each
    measured step whose snapshot is drawn."""
    snaps = run.snapshots
    index = {(s.step, s.phase, s.micro_step or 0): i for i, s in enumerate(snaps)}
    found = ((index.get((step.step, step.peak_phase, step.peak_micro_step or 0)), step) for step in run.steps)
    return [(i, step) for i, step in found if i is not None and step.peak is not None]


def first_of_steps(snaps: list[Snapshot]) -> dict[int, int]:
    """Step -> the index of its first snapshot."""
    first: dict[int, int] = {}
    for i, s in enumerate(snaps):
        first.setdefault(s.step, i)
    return first


def eval_position(loop: EvalRecord, snaps: list[Snapshot]) -> float:
    """Where an eval/predict loop is drawn: just after the last snapshot of the step it followed."""
    after = [i for i, s in enumerate(snaps) if s.step <= (loop.step or 0)]
    return (after[-1] + 0.5) if after else -0.5


def step_starts(snaps: list[Snapshot]) -> list[tuple[int, int]]:
    """(index, step) of each step's ``step_begin`` snapshot."""
    return [(i, s.step) for i, s in enumerate(snaps) if s.phase == STEP_BEGIN]
