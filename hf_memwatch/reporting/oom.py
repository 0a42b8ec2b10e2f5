"""OOM post-mortem: ``memwatch/oom_report.md`` written before an out-of-memory error leaves ``train()``.

:mod:`hf_memwatch.integration.patches` guards the Trainer instance's ``train``. On an OOM the report
is written and the *same* exception object is re-raised with a bare ``raise``: the user's traceback
is the original one (the tracker's frames around the failing operator spliced out). The report says at which
step and phase the run died, what was live at the last snapshot, and which remedy would have saved
how much, from :func:`hf_memwatch.estimation.estimate.estimate` when that module is importable.

On CUDA, ``MemWatch(record_history=True)`` records the allocator's history
(:func:`start_allocator_history`) and the post-mortem dumps ``oom_snapshot.pickle`` for
https://pytorch.org/memory_viz, each allocation tagged with the step and phase that made it.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..compat.torch_cuda_memory import allocator_snapshot
from ..core.categories import LIVE_CLASSES
from ..core.records import OomRecord, PlanRecord, Snapshot, StepRecord
from ..core.run_config import RunConfig, is_peft_model
from ..core.units import format_bytes
from ..measure.footprint import advice_from_stats, allocator_settings
from ..planning.catalogue import advice, precision_advice, with_state_share
from .allocator_history import PHASE_IN_PROGRESS
from .oom_tensors import tensor_lines, tensors_at_failure

logger = logging.getLogger("hf_memwatch")

REPORT_NAME = "oom_report.md"
SNAPSHOT_NAME = "oom_snapshot.pickle"
_WRAPPED_MARK = "_hf_memwatch_oom"



# -- installing ---------------------------------------------------------------------------------
def prepare_post_mortem() -> None:
    """Import the estimator now: at the OOM there may be no memory left to import with.

    The guard that calls :func:`write_oom_report` wraps ``train`` in
    :mod:`hf_memwatch.integration.patches` and re-raises the same exception object.
    """
    _load_estimator()


# -- the remedies ------------------------------------------------------------------------------
_ESTIMATOR: Any = None
_ESTIMATOR_ERROR: str | None = None


def _load_estimator() -> Any:
    global _ESTIMATOR, _ESTIMATOR_ERROR
    if _ESTIMATOR is None and _ESTIMATOR_ERROR is None:
        try:
            from ..estimation.estimate import estimate

            _ESTIMATOR = estimate
        except Exception as exc:  # noqa: BLE001 - another module; absent or broken degrades to a note
            _ESTIMATOR_ERROR = f"{type(exc).__name__}: {exc}"
    return _ESTIMATOR


def cpu_memory_exhausted(exc: BaseException) -> bool:
    """True for a failure of the CPU allocator (or Python's), as opposed to an accelerator's."""
    return isinstance(exc, MemoryError) or "DefaultCPUAllocator" in str(exc)


def estimate_command(model: Any, config: RunConfig) -> str:
    """The ``hf-memwatch estimate`` command line for ``config``.

    Example:
        >>> run = RunConfig(8, 2, activation_checkpointing=True, precision="bf16", seq_len=128)
        >>> estimate_command(None, run)
        'hf-memwatch estimate <model dir or config.json> --micro-batch-size 8 --seq-len 128 --precision bf16 --optim adamw_torch --gradient-accumulation-steps 2 --device cpu --activation-checkpointing'
    """
    source = getattr(getattr(model, "config", None), "name_or_path", "") or "<model dir or config.json>"
    parts = [
        "hf-memwatch estimate", source, f"--micro-batch-size {config.micro_batch_size}",
        f"--seq-len {config.seq_len or '<tokens>'}", f"--precision {config.precision}", f"--optim {config.optim}",
        f"--gradient-accumulation-steps {config.gradient_accumulation_steps}", f"--device {config.device}",
    ]
    if config.activation_checkpointing:
        parts.append("--activation-checkpointing")
    return " ".join(parts)


def estimate_remedies(model: Any, config: RunConfig) -> tuple[int | None, list[tuple[str, int | None, str]], str]:
    """(predicted peak of ``config``, [(remedy, predicted peak, note)], note on the whole).

    The planning core's figures: one :class:`~hf_memwatch.planning.chooser.PlanRequest` — the
    chooser's candidates and its one cache of the estimator's predictions — gives the run's peak and
    each remedy alone (:func:`~hf_memwatch.planning.remedies.single_steps`); the figures are the
    estimator's peaks (:func:`hf_memwatch.estimation.estimate.estimate`) of those candidates. Without
    the estimator, no figures and a note saying why.
    """
    if _load_estimator() is None:
        return None, [], f"the estimator is not available ({_ESTIMATOR_ERROR})"
    if config.seq_len is None:
        return None, [], "the sequence length of the failing batch is unknown, so the estimator was not run"
    from ..planning.chooser import PlanRequest
    from ..planning.plan import Plan
    from ..planning.predict import EstimatorPredictor
    from ..planning.remedies import single_steps

    # The config, not the module: the live module carries our hooks (and the user's), which the
    # estimator's copy must not drag along. A PEFT model is the exception: its config alone would be
    # estimated as a full fine-tune of an unquantized base (the estimator's copy keeps plain-function
    # hooks only, never a callback's bound method).
    subject = model if is_peft_model(model) else (getattr(model, "config", None) or model)
    predictor = EstimatorPredictor(subject, config, estimator=_ESTIMATOR)
    try:
        given = predictor.estimate(Plan.of(config))
    except Exception as exc:  # noqa: BLE001 - report what we can
        return None, [], f"the estimator failed on this run's configuration ({type(exc).__name__}: {exc})"
    baseline = int(given.peak_bytes)
    config = predictor.run = with_state_share(config, given)  # no 8-bit AdamW where the states are a rounding error
    request = PlanRequest(config, predictor)
    rows: list[tuple[str, int | None, str]] = []

    def estimated(plan: Plan) -> int:  # the estimator's figure of the chooser's prediction (one cache)
        request.predicted(plan)
        return int(predictor.estimate(plan).peak_bytes)

    for description, plan in single_steps(request):
        rows.append(_predicted_row(description, functools.partial(estimated, plan)))
    bf16 = precision_advice(config)
    if bf16 is not None:  # changes numerics: the estimator's figure as advice, never a plan
        rows.append(_predicted_row(bf16[0], lambda: _ESTIMATOR(subject, **bf16[1].estimate_kwargs()).peak_bytes))
    # Savings that change the code path or what is trained: named with their bytes, no plan figure.
    from ..estimation.estimate import logits_bytes

    for item in advice(config, given.frozen_models, logits_bytes(given), baseline, classes=given.classes,
                       peak_phase=given.peak_phase):
        rows.append((f"{item.name} (advice)", None, f"saves up to {format_bytes(item.saving)}: {item.how}"))
    return baseline, rows, ""


def _predicted_row(description: str, peak_of: Any) -> tuple[str, int | None, str]:
    try:
        return description, int(peak_of()), ""
    except Exception as exc:  # noqa: BLE001 - one remedy's failure must not cost the others
        return description, None, f"estimator failed: {type(exc).__name__} {exc}".strip()


# -- the report --------------------------------------------------------------------------------
_TRIED = re.compile(r"(?:you tried to allocate|Tried to allocate)\s+([0-9.]+)\s*(bytes|[KMGT]i?B)", re.IGNORECASE)
_UNIT = {"bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
         "gb": 10**9, "tb": 10**12}


def requested_bytes(exc: BaseException) -> int | None:
    """The allocation that failed, from the allocator's message (CPU and CUDA wordings).

    Example:
        >>> requested_bytes(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1048576 bytes."))
        1048576
    """
    match = _TRIED.search(str(exc))
    if not match:
        return None
    return int(float(match.group(1)) * _UNIT[match.group(2).lower()])


def write_oom_report(
    directory: str | Path,
    exc: BaseException,
    monitor: Any,
    trainer: Any,
    *,
    seq_len: int | None = None,
    plan: Any = None,
    snapshot_path: Path | None = None,
) -> Path:
    """Write ``<directory>/oom_report.md`` (and an ``oom`` timeline record); returns its path.

    On CUDA with allocator history being recorded, also dumps ``oom_snapshot.pickle``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    last = monitor.step_snapshots[-1] if monitor.step_snapshots else None
    try:
        at_failure = split_at_failure(monitor)
    except Exception:  # noqa: BLE001 - the dying process may not afford the walk; report without it
        at_failure = None
    live_now = at_failure.allocated if at_failure else None
    try:
        failure_tensors = tensors_at_failure(monitor)
    except Exception:  # noqa: BLE001 - as above: the report goes on without the list
        failure_tensors = None
    monitor.stop_tracking()  # the estimator below must not run under our tracking mode
    if snapshot_path is None:
        snapshot_path = _dump_cuda_snapshot(directory)
    model = getattr(trainer, "model", None)
    config = RunConfig.from_trainer(trainer, seq_len)
    advice = None
    if getattr(monitor.backend, "kind", None) == "cuda":
        # The peak figures since the last snapshot: the failed step's, up to the failure.
        advice = advice_from_stats(torch.cuda.memory_stats(monitor.device), allocator_settings())
    record = OomRecord(
        step=monitor.step, micro_step=monitor.micro_step, rank=monitor.rank,
        time=time.time(), last_phase=last.phase if last else None,
        requested=requested_bytes(exc), allocated_at_failure=live_now,
        live_at_failure=at_failure.live if at_failure else None,
        error=f"{type(exc).__name__}: {str(exc)[:300]}",
    )
    if monitor.writer is not None:
        monitor.writer.write(record)
        monitor.writer.flush()
    path = directory / REPORT_NAME

    limit_line = binding_limit_line(monitor.backend, record.requested)

    failure = PostMortem(exc=exc, monitor=monitor, last=last, config=config, model=model, at_failure=at_failure,
                         plan=plan, snapshot_path=snapshot_path, allocator_advice=advice,
                         failure_tensors=failure_tensors, limit_line=limit_line)

    def render(baseline: int | None, remedies: list[tuple[str, int | None, str]], note: str) -> None:
        text = render_oom_report(failure, baseline, remedies, note)
        partial = path.with_suffix(".md.partial")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)  # atomic: a write that fails for want of memory leaves the last report

    # What was measured goes to disk first: the estimates below need memory the process may lack.
    render(None, [], "the estimator did not finish (the process may have had no memory left to run it)")
    if cpu_memory_exhausted(exc):
        # The failing pass's tensors are still held by the traceback, so the process has no memory
        # left; running the estimator here has crashed the process outright (seen: SIGSEGV under
        # RLIMIT_AS). Name the command that gives the figures instead.
        render(None, [], "CPU memory was exhausted, so the estimator was not run in the dying process; "
                         f"`{estimate_command(model, config)}` gives what each remedy saves")
    else:
        render(*estimate_remedies(model, config))
    logger.warning("hf-memwatch: out of memory at step %s; post-mortem in %s", monitor.step, path)
    return path


def binding_limit_line(backend: Any, requested: int | None) -> str | None:
    """The report's line naming the limit that bound the run, with its figure: among the limits
    read now (``RLIMIT_AS``/``RLIMIT_DATA`` against the process size, the cgroup's ``memory.max``,
    ``MemAvailable``; on CUDA the free memory and ``set_per_process_memory_fraction``'s cap), the
    tightest of those the failed request exceeded (else the tightest); None when none is readable."""
    from ..planning.budget import device_limits

    try:
        limits = device_limits(backend)
    except Exception:  # noqa: BLE001 - an unreadable limit must not cost the report
        return None
    if not limits:
        return None
    exceeded = [limit for limit in limits if requested is not None and limit.available < requested]
    binding = min(exceeded or limits, key=lambda limit: limit.available)
    figure = ""
    if binding.name.startswith("RLIMIT_"):
        import resource

        soft = resource.getrlimit(getattr(resource, binding.name))[0]
        figure = f" = {format_bytes(soft)} (soft limit, `ulimit {'-v' if binding.name == 'RLIMIT_AS' else '-d'}`)"
    others = "; ".join(limit.describe() for limit in limits if limit is not binding)
    return (f"- **Binding limit:** {binding.name}{figure}: {format_bytes(binding.available)} left "
            f"{binding.detail}" + (f" (also read: {others})" if others else ""))


def split_at_failure(monitor: Any) -> Snapshot | None:
    """The live classes at the moment of the failure (a snapshot record, not written to the timeline).

    Only where the figures are real: an allocator that counts for itself (CUDA) or a CPU step being
    tracked in full; None otherwise. The activations saved so far in the failing pass count as
    activations.
    """
    backend = monitor.backend
    if not (backend.exact or backend.tracking) or not monitor.in_step:
        return None
    # The monitor's own full snapshot, without recording it: same attribution as every snapshot.
    return monitor.measure("oom", monitor.micro_step)


def _dump_cuda_snapshot(directory: Path) -> Path | None:
    if not torch.cuda.is_available():
        return None
    try:
        snapshot = allocator_snapshot()  # one snapshot at an OOM (``_dump_snapshot`` takes another)
        if snapshot is None or not any(snapshot.get("device_traces") or []):
            return None  # history is not being recorded
        path = directory / SNAPSHOT_NAME
        with open(path, "wb") as fh:
            pickle.dump(snapshot, fh)  # what torch.cuda.memory._dump_snapshot writes
        return path
    except Exception as exc:  # noqa: BLE001 - the report matters more than the snapshot
        logger.warning("hf-memwatch: no allocator snapshot (%s: %s)", type(exc).__name__, exc)
        return None


@dataclass(frozen=True)
class PostMortem:
    """What was measured when the allocation failed — everything the report says but the remedies.

    ``last``: the step's last snapshot; ``at_failure``: the classes live at the failure (a snapshot
    record not written); ``plan``: the ``plan`` record in force; ``allocator_advice``: the CUDA
    allocator's (:func:`~hf_memwatch.measure.footprint.expandable_segments_advice`), when the gap
    called for it; ``limit_line``: :func:`binding_limit_line`'s."""

    exc: BaseException
    monitor: Any
    last: Snapshot | None
    config: RunConfig
    model: Any
    at_failure: Snapshot | None = None
    plan: PlanRecord | Mapping[str, Any] | None = None
    snapshot_path: Path | None = None
    allocator_advice: str | None = None
    failure_tensors: Any = None
    limit_line: str | None = None


def render_oom_report(failure: PostMortem, baseline: int | None, remedies: list[tuple[str, int | None, str]],
                      note: str) -> str:
    """The Markdown text of the post-mortem: ``failure``'s figures, then what each remedy would have
    saved (``remedies``: description, predicted peak, problem; against ``baseline``, or ``note`` why none)."""
    exc, monitor, last, config, model = failure.exc, failure.monitor, failure.last, failure.config, failure.model
    at_failure, plan, snapshot_path = failure.at_failure, failure.plan, failure.snapshot_path
    allocator_advice, failure_tensors, limit_line = failure.allocator_advice, failure.failure_tensors, failure.limit_line
    lines = ["# hf-memwatch: out-of-memory post-mortem", ""]
    name = type(model).__name__ if model is not None else "?"
    params = sum(p.numel() for p in model.parameters()) if model is not None else None
    model_text = f"{name} ({params:,} parameters), " if params is not None else ""
    lines += [
        f"- **Error:** `{type(exc).__name__}: {_first_line(exc)}`",
        f"- **Run:** {model_text}batch {config.micro_batch_size} per device × gradient accumulation "
        f"{config.gradient_accumulation_steps}, "
        f"sequence length {config.seq_len or '?'}, {config.precision}, optim {config.optim}, "
        f"gradient checkpointing {'on' if config.activation_checkpointing else 'off'}, device {config.device}",
    ]
    if last is not None:
        lines.append(
            f"- **Where:** optimizer step {monitor.step}, micro-batch {monitor.micro_step}, during "
            f"{PHASE_IN_PROGRESS.get(last.phase, last.phase)} (last snapshot: `{last.phase}`)"
        )
    else:
        lines.append(f"- **Where:** before the first snapshot of step {monitor.step} (model or batch set-up)")
    requested = requested_bytes(exc)
    if requested is not None:
        lines.append(f"- **Failed allocation:** {format_bytes(requested)}")
    if at_failure is not None:
        lines.append(f"- **Live when it failed:** {format_bytes(at_failure.allocated)}")
    if last is not None and last.device_total is not None:
        lines.append(
            f"- **Device:** {format_bytes(last.device_total)} in all, "
            f"{format_bytes(last.device_free)} free at the last snapshot"
        )
    if limit_line is not None:
        lines.append(limit_line)
    if at_failure is not None:
        lines += ["", "## Live memory when the allocation failed", ""]
        lines += _class_table(at_failure, spike=False)
    lines += tensor_lines(failure_tensors)
    lines += ["", f"## Live memory at the last snapshot (`{last.phase}`)" if last else "", ""]
    if last is not None and last.allocated is not None:
        lines += _class_table(last)
    else:
        lines.append("No snapshot with allocator figures was taken in this step.")
    previous: StepRecord | None = monitor.last_step
    if previous is not None and previous.step != monitor.step:
        lines += [
            "",
            f"Last completed step ({previous.step}): peak {format_bytes(previous.peak)} "
            f"at `{previous.peak_phase}`, dominated by {previous.dominant}.",
        ]
    lines += ["", "## What would have saved how much", ""]
    lines += _remedy_lines(baseline, remedies, note, last)
    if allocator_advice:
        lines += ["", "## The CUDA allocator", "", allocator_advice[0].upper() + allocator_advice[1:] + "."]
    lines += ["", "## Plan in force", "", _plan_text(plan)]
    if snapshot_path is not None:
        lines += [
            "", "## Allocator snapshot", "",
            f"`{snapshot_path.name}`: drag it onto https://pytorch.org/memory_viz. Allocations carry "
            "`hf_memwatch step N mb M: <phase>` as metadata (the phase in progress when they were made).",
        ]
    return "\n".join(lines) + "\n"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:400] if text else ""


def _class_table(snapshot: Snapshot, spike: bool = True) -> list[str]:
    allocated = snapshot.allocated or 0
    live = snapshot.live or {}
    rows = ["| class | bytes | share |", "|---|---:|---:|"]
    for name in LIVE_CLASSES:
        value = live.get(name)
        share = f"{100 * value / allocated:.1f} %" if value is not None and allocated else "-"
        rows.append(f"| {name} | {format_bytes(value)} | {share} |")
    rows.append(f"| **allocated** | **{format_bytes(allocated)}** | 100 % |")
    if spike:
        rows.append(f"| spike (temporaries above live, in the phase) | {format_bytes(snapshot.spike)} | |")
    return rows


def _remedy_lines(
    baseline: int | None, remedies: list[tuple[str, int | None, str]], note: str, last: Snapshot | None
) -> list[str]:
    if baseline is None:
        lines = [f"No estimator figures: {note}."]
        if last is not None and last.live:
            lines += ["", "From the measured split only (rough, not a prediction):"]
            live = last.live
            activations = live.get("activations") or 0
            states = live.get("optimizer_states") or 0
            if activations:
                lines.append(f"- halving the batch frees about {format_bytes(activations / 2)} of activations; "
                             "gradient checkpointing most of the rest")
            if states:
                lines.append(f"- 8-bit AdamW would keep about a quarter of the {format_bytes(states)} "
                             "of optimizer states")
            if not activations and not states:
                lines.append("- the last snapshot was before the forward pass: the activations of the failing "
                             "batch were never measured; a smaller batch or gradient checkpointing is the usual fix")
        return lines
    lines = [
        f"Predicted peak of this configuration: **{format_bytes(baseline)}** (hf_memwatch.estimation.estimate).",
        "",
        "| remedy | predicted peak | saves |",
        "|---|---:|---:|",
    ]
    for description, peak, problem in sorted(remedies, key=lambda r: r[1] if r[1] is not None else 1 << 62):
        if peak is None:
            lines.append(f"| {description} | - | ({problem}) |")
        else:
            lines.append(f"| {description} | {format_bytes(peak)} | {format_bytes(baseline - peak)} |")
    return lines


def _plan_text(plan: PlanRecord | Mapping[str, Any] | None) -> str:
    from .summary import describe_plan

    if plan is None:
        return "None (the auto mode was off or had no plan)."
    reason = plan.get("reason") if isinstance(plan, Mapping) else plan.reason
    return describe_plan(plan) + (f". Reason: {reason}" if reason else "")
