"""The timeline's records, typed: one dataclass per event (README "Timeline" is their contract).

Each record is built as its dataclass and serialises itself: :meth:`Record.to_dict` is the one
place a record becomes the JSON object of a timeline line, :func:`parse_record` (and each class's
:meth:`Record.from_dict`) the one reader back. :func:`validate_record` checks a plain dict against
its event's definition — the test suite checks every record it writes. Fields are never removed;
more may be added: keys a definition does not know are kept in ``extra`` and written back.

A field with no default is required (always written); an *optional* field (declared with
:func:`optional`) is written only when it is known (not None).

Example:
    >>> validate_record({"event": "meta", "model": "GPT2LMHeadModel", "params": 10, "trainable_params": 10,
    ...                  "micro_batch_size": 8, "gradient_accumulation_steps": 1, "precision": "fp32",
    ...                  "optim": "adamw_torch", "world_size": 1})
    []
    >>> validate_record({"event": "step", "step": 1})[0]
    "step record: missing 'detail'"
    >>> leak = LeakRecord(klass="other", bytes_per_step=2097152, since_step=2, step=6, predicted_oom_step=None, rank=0)
    >>> leak.to_dict()["class"], parse_record(leak.to_dict()) == leak
    ('other', True)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypedDict

from .plan import Plan
from .renamed import accepts_renamed
from .serial import Serial, Slot, _field_slots, optional, renamed

Bytes = int  # every figure is in bytes; None where a device cannot tell


class LiveClasses(TypedDict):
    """The five live classes of a snapshot; they sum to ``allocated``."""

    weights: Bytes | None
    gradients: Bytes | None
    optimizer_states: Bytes | None
    activations: Bytes | None
    other: Bytes | None




@dataclass(kw_only=True)
class Record(Serial):
    """A timeline record: ``EVENT`` is its ``event`` key."""

    EVENT: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return {"event": self.EVENT, **super().to_dict()}


@dataclass(kw_only=True)
class Snapshot(Record):
    """The allocator at one phase of an optimizer step (or of an eval loop: ``stage``, ``batch``)."""

    EVENT: ClassVar[str] = "snapshot"
    step: int
    micro_step: int
    phase: str
    rank: int
    device: str
    time: float
    allocated: Bytes | None
    reserved: Bytes | None
    peak: Bytes | None
    live: LiveClasses
    spike: Bytes | None
    allocator_overhead: Bytes | None
    fragmentation: Bytes | None
    num_alloc_retries: int | None
    num_ooms: int | None
    device_free: Bytes | None
    device_total: Bytes | None
    host_rss: Bytes | None
    host_vms: Bytes | None
    detail: str
    stage: str | None = optional()  # eval loops only: "eval" | "predict"
    batch: int | None = optional()  # eval loops only: the batch
    outputs: Bytes | None = optional()  # eval loops only: the outputs the loop holds
    frozen_models: dict[str, int] | None = optional()  # models the Trainer holds: name -> bytes


SnapshotRecord = Snapshot  # the name before the records were dataclasses


@dataclass(kw_only=True)
class StepRecord(Record):
    """One optimizer step: its peak, where, and what dominated."""

    EVENT: ClassVar[str] = "step"
    step: int
    rank: int
    peak: Bytes | None
    peak_phase: str
    peak_micro_step: int
    dominant: str
    detail: str
    live_at_peak: LiveClasses
    spike_at_peak: Bytes | None
    reserved: Bytes | None


@dataclass(kw_only=True)
class PlannedBatch(Serial):
    """The batch a plan was computed for (the plan record's ``sample``): the longest sample of the
    whole dataset (``index``, ``seq_len`` tokens, ``source``: how it was found), and the samples of
    the planned micro-batch — ``indices`` (the ``k`` longest distinct samples where the sampler or
    collator forms such batches, else the longest repeated) with their ``tokens`` before padding."""

    index: int | None
    seq_len: int | None
    source: str | None
    notes: list[str] = field(default_factory=list)
    indices: list[int] | None = optional()
    tokens: int | None = optional()


@dataclass(kw_only=True)
class PlanRecord(Record):
    """The auto mode's plan (also the callback's saved state): the plan, its budget and provenance.

    ``status`` is ``"failed"`` when planning failed and the run goes on as configured (only with
    ``allow_over_budget``; ``"over_budget"`` when it is predicted or measured over the budget);
    ``configured`` is the configuration it was made for; ``sample`` the batch it planned for
    (:class:`PlannedBatch`); ``budget_bound_by`` the real limit the default budget was taken from;
    ``margin`` the planning margin in force (``budget / (1 + margin)`` is planned against) and
    ``margin_source`` what it was measured from; ``resumed`` marks a plan kept from a checkpoint."""

    EVENT: ClassVar[str] = "plan"
    NESTED: ClassVar[dict[str, type[Serial]]] = {"sample": PlannedBatch}
    # the plan's attributes written flat, first, with their types on disk (``reason`` after ``budget``)
    PLAN_KEYS: ClassVar[dict[str, Any]] = {"micro_batch_size": int, "gradient_accumulation_steps": int,
                                           "activation_checkpointing": bool | None, "optim": str | None,
                                           "predicted_peak": Bytes | None}
    plan: Plan  # the configuration (None for checkpointing and optim of a run let go on as configured)
    budget: Bytes | None
    budget_source: str | None = optional()
    budget_bound_by: str | None = optional()
    margin: float | None = optional()  # footprint beyond the allocated bytes planned for, as a share of them
    margin_source: str | None = optional()  # what it was measured from (or the prior it still is)
    configured: dict[str, int] | None = optional()
    sample: PlannedBatch | None = optional()
    resumed: bool | None = optional()
    status: str | None = optional()
    recovered_from_oom: int | None = optional()
    planning_seconds: float | None = optional()  # wall seconds the plan took (its estimates' replays included)
    eval_batch_size: int | None = optional()
    eval_accumulation_steps: int | None = optional()
    eval_predicted_peak: Bytes | None = optional()
    eval_reason: str | None = optional()
    advice: list[dict[str, Any]] | None = optional()  # catalogue.Advice.as_dict(): name, saving, how; never applied
    source: str | None = optional()  # "predicted" (replayed), "measured" (micro-steps measured live), "none"
    # measured (integration.measured.Measurement): micro_batch_size, activation_checkpointing, gradient_accumulation, peak, before
    measurements: list[dict[str, Any]] | None = optional()
    # a measurement's key older timelines wrote -> its key now (read, never written)
    MEASUREMENT_OLD_KEYS: ClassVar[dict[str, str]] = {"accumulating": "gradient_accumulation"}

    @property
    def in_force(self) -> bool:
        """A plan the run follows (not a run let go on as configured, over budget or unplanned)."""
        return self.status not in ("failed", "over_budget")

    @classmethod
    def slots(cls) -> tuple[Slot, ...]:
        """The plan's attributes first (as the record always wrote them), ``budget``, the plan's
        ``reason``, then the record's own fields."""
        own = [slot for slot in _field_slots(cls) if slot.name != "plan"]
        flat = [Slot(name, name, hint, False, True, "plan") for name, hint in cls.PLAN_KEYS.items()]
        return (*flat, own[0], Slot("reason", "reason", str, False, True, "plan"), *own[1:])

    @classmethod
    def renamed_keys(cls, data: dict[str, Any]) -> dict[str, Any]:
        """As :meth:`Serial.renamed_keys`, and each measurement's keys by :attr:`MEASUREMENT_OLD_KEYS`."""
        data = super().renamed_keys(data)
        found = data.get("measurements")
        if not isinstance(found, list) or not any(isinstance(m, dict) and m.keys() & cls.MEASUREMENT_OLD_KEYS
                                                  for m in found):
            return data
        return {**data, "measurements": [renamed(m, cls.MEASUREMENT_OLD_KEYS) if isinstance(m, dict) else m
                                         for m in found]}

    @classmethod
    def _build(cls, values: dict[str, Any], extra: dict[str, Any]) -> PlanRecord:
        plan = Plan(values.pop("micro_batch_size"), values.pop("gradient_accumulation_steps"),
                    values.pop("activation_checkpointing"), values.pop("optim"),
                    predicted_peak=values.pop("predicted_peak"), reason=values.pop("reason"))
        return cls(plan=plan, **values, extra=extra)

    def replace(self, **changes: Any) -> PlanRecord:
        """A copy with ``changes``: the record's fields, or the plan's (``activation_checkpointing``, ``reason``, ...)."""
        planned = {name: changes.pop(name) for name in (*self.PLAN_KEYS, "reason") if name in changes}
        if planned:
            changes["plan"] = dataclasses.replace(changes.get("plan", self.plan), **planned)
        return dataclasses.replace(self, **changes)

    # the plan's attributes, read through the record as the timeline names them
    micro_batch_size = property(lambda self: self.plan.micro_batch_size)
    gradient_accumulation_steps = property(lambda self: self.plan.gradient_accumulation_steps)
    activation_checkpointing = property(lambda self: self.plan.activation_checkpointing)
    optim = property(lambda self: self.plan.optim)
    predicted_peak = property(lambda self: self.plan.predicted_peak)
    reason = property(lambda self: self.plan.reason)


@dataclass(kw_only=True)
class EvalRecord(Record):
    """One evaluation/prediction loop (:mod:`hf_memwatch.integration.eval_watch`); its snapshots carry
    ``stage`` and ``batch`` (training snapshots have no ``stage``)."""

    EVENT: ClassVar[str] = "eval"
    stage: str  # "eval" (evaluate, the eval inside train) or "predict"
    step: int  # the global step the loop ran at (0 before training)
    rank: int
    peak: Bytes | None
    peak_batch: int | None
    live: dict[str, Any] | None  # the live classes at the peak, ``outputs`` included; + spike = peak
    outputs: Bytes | None  # what the loop held at its end
    batches: int
    peak_phase: str | None = None
    spike: Bytes | None = None
    outputs_at_peak: Bytes | None = None
    time: float | None = None


@accepts_renamed({"batch_size": "micro_batch_size"})
@dataclass(kw_only=True)
class MetaRecord(Record):
    """The run: model and batch, for the picture's title and the summary. ``micro_batch_size`` was
    written ``batch_size`` before: an older timeline's key is read as it (``OLD_KEYS``)."""

    EVENT: ClassVar[str] = "meta"
    OLD_KEYS: ClassVar[dict[str, str]] = {"batch_size": "micro_batch_size"}
    model: str | None
    params: int | None
    trainable_params: int | None
    micro_batch_size: int
    gradient_accumulation_steps: int
    precision: str
    optim: str
    world_size: int
    degraded: list[str] | None = optional()  # features off on this stack (hf_memwatch.compat.probes)


@dataclass(kw_only=True)
class OomRecord(Record):
    """An out-of-memory error that ended the run (the post-mortem has the details); one inside an
    eval loop also has ``stage``, ``batch`` and ``outputs_at_failure`` (``live_at_failure`` has outputs)."""

    EVENT: ClassVar[str] = "oom"
    step: int
    micro_step: int
    rank: int
    time: float
    last_phase: str | None
    requested: Bytes | None
    allocated_at_failure: Bytes | None
    live_at_failure: LiveClasses | None
    error: str
    stage: str | None = optional()
    batch: int | None = optional()
    outputs_at_failure: Bytes | None = optional()


@dataclass(kw_only=True)
class LeakRecord(Record):
    """A class that grows step after step (:mod:`hf_memwatch.measure.leaks`)."""

    EVENT: ClassVar[str] = "leak"
    KEYS: ClassVar[dict[str, str]] = {"klass": "class"}
    klass: str  # a live class or "host_rss"; written as "class"
    bytes_per_step: float
    since_step: int
    step: int
    predicted_oom_step: int | None
    rank: int


@dataclass(kw_only=True)
class OomRecoveredRecord(Record):
    """An out-of-memory error in the first step that the auto mode recovered from (planned again)."""

    EVENT: ClassVar[str] = "oom_recovered"
    attempt: int
    error: str
    failed_plan: dict[str, Any]
    budget: Bytes


@dataclass(kw_only=True)
class FootprintRecord(Record):
    """One of the first steps measured as the limit counts it (:func:`hf_memwatch.measure.footprint.step_footprint`).

    ``kind``: what the limit counts (``reserved``, ``vms``, ``rss``, ``allocated``);
    ``footprint_gap``: its bytes beyond the allocated ones at the step's peak; ``margin``: the largest
    gap measured so far — the margin of later plans — as a share of the bytes planned against;
    ``next_step_need``: the measured step plus the optimizer states it left, or the planned worst
    batch with the margin (``planned_need``), whichever is more; ``fits``: within ``budget``;
    ``advice``: on CUDA, the expandable-segments recommendation when the gap calls for it.
    """

    EVENT: ClassVar[str] = "footprint"
    step: int
    kind: str
    allocated_peak: Bytes
    states_growth: Bytes
    footprint_gap: Bytes
    margin: float
    planned_need: Bytes
    next_step_need: Bytes
    budget: Bytes
    fits: bool
    advice: str | None


@dataclass(kw_only=True)
class PeakTensorsRecord(Record):
    """The tensors alive at a fully tracked step's peak (:mod:`hf_memwatch.measure.peak_watch`): the
    ``top`` largest storages (``bytes``, ``shape``, ``dtype``, ``class``, ``operator``, ``module``,
    ``stage``) and every storage then grouped ``by_module``, ``by_operator`` and ``by_class``."""

    EVENT: ClassVar[str] = "peak_tensors"
    step: int
    rank: int
    phase: str
    micro_step: int
    source: str  # tracker (CPU) | cuda_history | cuda_saved
    peak: Bytes
    count: int
    tensors: list
    by_module: list
    by_operator: list
    by_class: dict[str, int]


RECORDS: dict[str, type[Record]] = {
    kind.EVENT: kind
    for kind in (Snapshot, StepRecord, PlanRecord, MetaRecord, OomRecord, EvalRecord, LeakRecord,
                 OomRecoveredRecord, FootprintRecord, PeakTensorsRecord)
}


def parse_record(data: dict[str, Any], *, lenient: bool = False) -> Record:
    """The typed record of a timeline line (the one reader); ValueError for an unknown event or (not
    ``lenient``: see :meth:`Serial.from_dict`) a missing required field."""
    kind = RECORDS.get(data.get("event")) if isinstance(data.get("event"), str) else None
    if kind is None:
        raise ValueError(f"unknown event {data.get('event')!r}")
    return kind.from_dict(data, lenient=lenient)


def _matches(value: Any, hint: Any) -> bool:
    """A shallow type check: ``int``/``float``/``str``/``bool``/``dict`` and their ``| None``."""
    args = getattr(hint, "__args__", None)
    origin = getattr(hint, "__origin__", None)
    if origin is Literal:
        return value in args
    if args and origin is None or (args and type(None) in args):  # a union
        return any(_matches(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type) and (issubclass(hint, dict) or issubclass(hint, Serial)):  # TypedDicts, nested
        return isinstance(value, dict)
    if origin is dict:
        return isinstance(value, dict)
    if origin is list:
        return isinstance(value, list)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


@functools.cache
def _disk_hints(kind: type[Record]) -> dict[str, Any]:
    """Key on disk -> type hint of the field behind it."""
    return {slot.key: slot.hint for slot in kind.slots()}


def required_keys(kind: type[Record]) -> frozenset[str]:
    """The keys every record of ``kind`` has (``event`` included)."""
    return frozenset({"event", *(slot.key for slot in kind.slots() if slot.required)})


def validate_record(record: dict[str, Any]) -> list[str]:
    """What is wrong with ``record`` against its event's definition (empty: nothing)."""
    event = record.get("event")
    kind = RECORDS.get(event) if isinstance(event, str) else None
    if kind is None:
        return [f"unknown event {event!r}"]
    record = kind.renamed_keys(record)  # an older timeline's keys (OLD_KEYS) are valid under their names now
    hints = _disk_hints(kind)
    problems = [f"{event} record: missing {name!r}" for name in sorted(required_keys(kind)) if name not in record]
    for name, value in record.items():
        if name in hints and not _matches(value, hints[name]):
            problems.append(f"{event} record: {name}={value!r} is not {hints[name]}")
    return problems


def contract_table() -> str:
    """The README's table of every event's fields, generated from the dataclasses (a test keeps the
    README equal to it): the keys always written, then those written when known.

    Example:
        >>> contract_table().splitlines()[2].startswith("| `snapshot` | `step`, `micro_step`, `phase`")
        True
    """
    rows = ["| event | always written | written when known |", "|---|---|---|"]
    kinds: list[tuple[str, type[Serial]]] = [(kind.EVENT, kind) for kind in RECORDS.values()]
    kinds.append(("plan → sample", PlannedBatch))
    for name, kind in kinds:
        always = [slot.key for slot in kind.slots() if not slot.optional]
        known = [slot.key for slot in kind.slots() if slot.optional]
        rows.append(f"| `{name}` | {', '.join(f'`{k}`' for k in always)} | "
                    f"{', '.join(f'`{k}`' for k in known) or '—'} |")
    return "\n".join(rows)
