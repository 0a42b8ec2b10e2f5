"""The timeline's records, typed: one definition of each event (README "Timeline" is their contract).

Writers build plain dicts of these shapes (:class:`~hf_memwatch.core.timeline.TimelineWriter`
writes them, :func:`~hf_memwatch.core.timeline.read_timeline` reads them back);
:func:`validate_record` checks one against its definition — the test suite checks every record it
writes. Fields are never removed; more may be added.

Example:
    >>> validate_record({"event": "meta", "model": "GPT2LMHeadModel", "params": 10, "trainable_params": 10,
    ...                  "batch_size": 8, "gradient_accumulation_steps": 1, "precision": "fp32",
    ...                  "optim": "adamw_torch", "world_size": 1})
    []
    >>> validate_record({"event": "step", "step": 1})[0]
    "step record: missing 'detail'"
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict, get_type_hints

Bytes = int  # every figure is in bytes; None where a device cannot tell


class LiveClasses(TypedDict):
    """The five live classes of a snapshot; they sum to ``allocated``."""

    weights: Bytes | None
    gradients: Bytes | None
    optimizer_states: Bytes | None
    activations: Bytes | None
    other: Bytes | None


class SnapshotRecord(TypedDict):
    """The allocator at one phase of an optimizer step."""

    event: Literal["snapshot"]
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
    detail: str
    host_rss: Bytes | None
    host_vms: Bytes | None


class StepRecord(TypedDict):
    """One optimizer step: its peak, where, and what dominated."""

    event: Literal["step"]
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


class _PlanRequired(TypedDict):
    event: Literal["plan"]
    micro_batch_size: int
    gradient_accumulation_steps: int
    activation_checkpointing: bool | None
    optim: str | None
    predicted_peak: Bytes | None
    budget: Bytes | None
    reason: str


class PlanRecord(_PlanRequired, total=False):
    """The auto mode's plan (also the callback's saved state). ``status`` is ``"failed"`` when planning
    failed and the run goes on as configured (only with ``allow_over_budget``; ``"over_budget"`` when it
    is predicted or measured over the budget); ``configured`` is the configuration it was made for;
    ``sample`` the sample it planned for (the longest batch of the whole dataset: its index, length,
    how it was found); ``budget_bound_by`` the real limit the default budget was taken from; ``margin``
    the planning margin in force (``budget / (1 + margin)`` is planned against) and ``margin_source``
    what it was measured from; ``resumed`` marks a plan kept from a checkpoint."""

    budget_source: str
    budget_bound_by: str | None
    margin: float  # footprint beyond the allocated bytes planned for, as a share of them
    margin_source: str  # what it was measured from (or the prior it still is)
    configured: dict[str, int]
    sample: dict[str, Any] | None
    resumed: bool
    status: str
    recovered_from_oom: int
    eval_batch_size: int
    eval_accumulation_steps: int | None
    advice: list[dict[str, Any]]  # catalogue.Advice.as_dict(): name, saving (bytes), how; never applied
    eval_predicted_peak: Bytes
    eval_reason: str
    source: str  # "predicted" (the estimator replayed the step), "measured" (micro-steps measured live), "none"
    measurements: list[dict[str, Any]]  # measured: micro_batch_size, activation_checkpointing, peak, before


class _EvalRequired(TypedDict):
    event: Literal["eval"]
    stage: str  # "eval" (evaluate, the eval inside train) or "predict"
    step: int  # the global step the loop ran at (0 before training)
    rank: int
    peak: Bytes | None
    peak_batch: int | None
    live: dict[str, Any] | None  # the live classes at the peak, ``outputs`` included; + spike = peak
    outputs: Bytes | None  # what the loop held at its end
    batches: int


class EvalRecord(_EvalRequired, total=False):
    """One evaluation/prediction loop (:mod:`hf_memwatch.integration.eval_watch`); its snapshots carry
    ``stage`` and ``batch`` (training snapshots have no ``stage``)."""

    peak_phase: str | None
    spike: Bytes | None
    outputs_at_peak: Bytes | None
    time: float


class MetaRecord(TypedDict):
    """The run: model and batch, for the picture's title and the summary."""

    event: Literal["meta"]
    model: str | None
    params: int | None
    trainable_params: int | None
    batch_size: int
    gradient_accumulation_steps: int
    precision: str
    optim: str
    world_size: int


class OomRecord(TypedDict):
    """An out-of-memory error that ended the run (the post-mortem has the details)."""

    event: Literal["oom"]
    step: int
    micro_step: int
    rank: int
    time: float
    last_phase: str | None
    requested: Bytes | None
    allocated_at_failure: Bytes | None
    live_at_failure: LiveClasses | None
    error: str
    # an OOM inside an eval loop also has: stage, batch, outputs_at_failure (live_at_failure has outputs)


LeakRecord = TypedDict("LeakRecord", {
    "event": Literal["leak"],
    "class": str,  # a live class or "host_rss"
    "bytes_per_step": float,
    "since_step": int,
    "step": int,
    "predicted_oom_step": "int | None",
    "rank": int,
})
LeakRecord.__doc__ = "A class that grows step after step (:mod:`hf_memwatch.measure.leaks`)."


class OomRecoveredRecord(TypedDict):
    """An out-of-memory error in the first step that the auto mode recovered from (planned again)."""

    event: Literal["oom_recovered"]
    attempt: int
    error: str
    failed_plan: dict[str, Any]
    budget: Bytes


class FootprintRecord(TypedDict):
    """One of the first steps measured as the limit counts it (:func:`hf_memwatch.measure.footprint.step_footprint`).

    ``kind``: what the limit counts (``reserved``, ``vms``, ``rss``, ``allocated``);
    ``footprint_gap``: its bytes beyond the allocated ones at the step's peak; ``margin``: the largest
    gap measured so far — the margin of later plans — as a share of the bytes planned against;
    ``next_step_need``: the measured step plus the optimizer states it left, or the planned worst
    batch with the margin (``planned_need``), whichever is more; ``fits``: within ``budget``;
    ``advice``: on CUDA, the expandable-segments recommendation when the gap calls for it.
    """

    event: Literal["footprint"]
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


class PeakTensorsRecord(TypedDict):
    """The tensors alive at a fully tracked step's peak (:mod:`hf_memwatch.measure.peak_watch`): the
    ``top`` largest storages (``bytes``, ``shape``, ``dtype``, ``class``, ``operator``, ``module``,
    ``stage``) and every storage then grouped ``by_module``, ``by_operator`` and ``by_class``."""

    event: Literal["peak_tensors"]
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


RECORDS: dict[str, type] = {
    "snapshot": SnapshotRecord,
    "step": StepRecord,
    "plan": PlanRecord,
    "meta": MetaRecord,
    "oom": OomRecord,
    "eval": EvalRecord,
    "leak": LeakRecord,
    "oom_recovered": OomRecoveredRecord,
    "footprint": FootprintRecord,
    "peak_tensors": PeakTensorsRecord,
}


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
    if isinstance(hint, type) and issubclass(hint, dict):  # TypedDicts and dict
        return isinstance(value, dict)
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def validate_record(record: dict[str, Any]) -> list[str]:
    """What is wrong with ``record`` against its event's definition (empty: nothing)."""
    event = record.get("event")
    kind = RECORDS.get(event) if isinstance(event, str) else None
    if kind is None:
        return [f"unknown event {event!r}"]
    hints = get_type_hints(kind)
    problems = [f"{event} record: missing {name!r}" for name in sorted(kind.__required_keys__) if name not in record]
    for name, value in record.items():
        if name in hints and not _matches(value, hints[name]):
            problems.append(f"{event} record: {name}={value!r} is not {hints[name]}")
    return problems
