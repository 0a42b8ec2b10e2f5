"""Memory scalars (``memory/*``) in the integrations of ``args.report_to``, at the loss's global step.

Two pieces, both installed by :mod:`hf_memwatch.integration.patches` for the duration of a run:

1. The Trainer instance's ``log`` method is wrapped so that, on a training logging step, the
   ``memory/*`` figures join the very ``logs`` dict that the Trainer hands to its callbacks. The
   Trainer calls the reporting callbacks *before* user callbacks in ``on_log``, so adding keys from
   ``MemWatch.on_log`` would arrive too late; the wrapper runs before any of them. Integrations that
   log keys as they are (MLflow: ``log_metrics(..., step=state.global_step)``) thus get
   ``memory/peak``, ... with no code of ours, and the keys stay in ``trainer.state.log_history``.
2. TensorBoard's and W&B's callbacks pass training logs through ``rewrite_logs``, which prefixes
   every training key with ``train/``. Their ``on_log`` (per instance) is wrapped by
   :func:`routed_on_log`: it hands them the logs *without* the ``memory/*`` keys and writes
   those keys itself, under their exact names, through the callback's own live object:
   ``tb_writer.add_scalar(tag, value, state.global_step)`` then ``flush()``; for W&B
   ``run.log(memory, commit=False)`` just before the callback's own ``wandb.log({..., "train/global_step":
   step})``, which commits the row: the scalars land in the same history row as ``train/loss``,
   on the step metric (``train/global_step``) that the callback defines for every key (``"*"``).
   So TensorBoard and W&B show ``memory/peak``, not ``train/memory/peak``, and no duplicate.
   Other prefixing integrations (Comet, Neptune, Trackio, SwanLab, ...) keep the plain route and
   show ``train/memory/...``.

Why not write to every integration ourselves: each has its own run object, step handling and
name rules; the ``logs`` dict serves them all, and only the two prefixing integrations the
project supports get writer-level code.

The console progress line stays as it was because :func:`strip_memory_keys` removes the keys
from ``logs`` in ``MemWatch.on_log``, which runs after the integrations and before the progress
printer (added last by the Trainer). Evaluation logs get the ``memory/eval_*`` figures of the loop
that produced them (:func:`eval_scalars`); end-of-training logs get no memory keys. A fault in our code is logged
once per occurrence and the log goes on; a fault of the integration itself propagates as before.

Distributed: every rank calls ``Trainer.log`` at a logging step, so the wrapper gathers each rank's
figures (``all_gather_object``) and logs the maximum over ranks (the minimum for ``headroom``:
the tightest rank) plus ``memory/rank<N>/<name>`` for the main figures of each rank. TensorBoard
and W&B write on the main process only, as their callbacks do.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from ..compat.trainer import tensorboard_routable, tensorboard_writer, wandb_run
from ..core.categories import EVAL_LIVE_CLASSES, LIVE_CLASSES
from ..core.records import EvalRecord, Snapshot, StepRecord

logger = logging.getLogger("hf_memwatch")

PREFIX = "memory/"
PER_RANK_FIGURES: tuple[str, ...] = ("peak", "allocated", "reserved", "spike")
_WRAPPED_MARK = "_hf_memwatch_scalars"


def step_scalars(
    step_record: StepRecord,
    snapshots: list[Snapshot] | None = None,
    *,
    budget: int | None = None,
    predicted_peak: int | None = None,
    leak_bytes_per_step: int | None = None,
) -> dict[str, int]:
    """``memory/*`` figures (bytes) of one optimizer step.

    ``step_record`` is the monitor's ``step`` record, ``snapshots`` that step's snapshots in order.
    The classes are those live at the moment of the peak (see :func:`composition_at_peak`), so
    ``allocated`` = sum of the classes and ``peak`` = ``allocated`` + ``spike``. Figures the device
    does not keep (``reserved`` and ``fragmentation`` on the CPU) are left out, not logged as zero.

    Example:
        >>> rec = StepRecord.from_dict({"peak": 100, "peak_phase": "after_forward", "spike_at_peak": 10,
        ...     "live_at_peak": {"weights": 40, "activations": 50, "other": 0}}, lenient=True)
        >>> step_scalars(rec, budget=150)["memory/headroom"]
        50
    """
    scalars: dict[str, int] = {}
    peak = step_record.peak
    _put(scalars, "peak", peak)
    live, allocated = composition_at_peak(step_record, snapshots or [])
    _put(scalars, "allocated", allocated)
    _put(scalars, "reserved", step_record.reserved)
    for name in LIVE_CLASSES:
        _put(scalars, name, live.get(name))
    _put(scalars, "spike", step_record.spike_at_peak)
    fragmentation = [s.fragmentation for s in snapshots or [] if s.fragmentation is not None]
    _put(scalars, "fragmentation", max(fragmentation) if fragmentation else None)
    if budget is not None and peak is not None:
        _put(scalars, "headroom", int(budget) - int(peak))
    _put(scalars, "predicted_peak", predicted_peak)
    _put(scalars, "leak_bytes_per_step", leak_bytes_per_step)  # once a leak was found (measure/leaks.py)
    return scalars


def eval_scalars(eval_record: EvalRecord) -> dict[str, int]:
    """``memory/eval_*`` figures (bytes) of one evaluation loop's ``eval`` record.

    ``memory/eval_peak``, the classes live at that peak (``memory/eval_weights``, ...,
    ``memory/eval_outputs``, ``memory/eval_other``) and ``memory/eval_spike``; they sum to the peak.

    Example:
        >>> loop = EvalRecord.from_dict({"peak": 120, "spike": 20, "live": {"weights": 40, "outputs": 60, "other": 0}},
        ...                             lenient=True)
        >>> eval_scalars(loop)
        {'memory/eval_peak': 120, 'memory/eval_weights': 40, 'memory/eval_outputs': 60, 'memory/eval_other': 0, 'memory/eval_spike': 20}
    """
    scalars: dict[str, int] = {}
    _put(scalars, "eval_peak", eval_record.peak)
    live = eval_record.live or {}
    for name in EVAL_LIVE_CLASSES:
        _put(scalars, "eval_" + name, live.get(name))
    _put(scalars, "eval_spike", eval_record.spike)
    return scalars


def is_eval_log(logs: Mapping[str, Any]) -> bool:
    """The metrics ``Trainer.evaluate`` logs (``eval_loss``, ``eval_<metric>``, ...)."""
    return "loss" not in logs and any(isinstance(k, str) and k.startswith("eval_") for k in logs)


def _put(scalars: dict[str, int], name: str, value: Any) -> None:
    if value is not None and not (isinstance(value, float) and math.isnan(value)):
        scalars[PREFIX + name] = int(value)


def composition_at_peak(
    step_record: StepRecord, snapshots: list[Snapshot]
) -> tuple[dict[str, Any], int | None]:
    """(live classes, their sum) at the moment of the step's peak.

    A snapshot's peak is the highest point *since the previous snapshot*; the monitor measures the
    spike above the higher of the phase's two ends. So the classes live at the peak are those of
    that higher end: during the backward pass, for instance, the after-forward snapshot (the
    activations still live), not the after-backward one. Then classes + spike = peak.

    Example:
        >>> snaps = [Snapshot.from_dict(s, lenient=True) for s in (
        ...     {"phase": "after_forward", "micro_step": 0, "allocated": 90, "live": {"activations": 90}},
        ...     {"phase": "after_backward", "micro_step": 0, "allocated": 30, "live": {"activations": 0}})]
        >>> step = StepRecord.from_dict({"peak_phase": "after_backward", "peak_micro_step": 0}, lenient=True)
        >>> composition_at_peak(step, snaps)
        ({'activations': 90}, 90)
    """
    phase, micro = step_record.peak_phase, step_record.peak_micro_step
    for i, snap in enumerate(snapshots):
        if snap.phase == phase and (micro is None or snap.micro_step == micro):
            end = snap
            if i > 0 and (snapshots[i - 1].allocated or 0) > (snap.allocated or 0):
                end = snapshots[i - 1]
            return dict(end.live or {}), end.allocated
    live = dict(step_record.live_at_peak or {})
    known = [v for v in live.values() if v is not None]
    return live, sum(known) if known else None


def merge_ranks(per_rank: list[Mapping[str, int] | None]) -> dict[str, int]:
    """One dict from every rank's scalars: max over ranks (min for headroom) + per-rank main figures.

    A single rank's scalars come back unchanged.

    Example:
        >>> merge_ranks([{"memory/peak": 5, "memory/headroom": 9}, {"memory/peak": 7, "memory/headroom": 3}])
        {'memory/peak': 7, 'memory/headroom': 3, 'memory/rank0/peak': 5, 'memory/rank1/peak': 7}
    """
    present = [(rank, s) for rank, s in enumerate(per_rank) if s]
    if len(per_rank) <= 1:
        return dict(present[0][1]) if present else {}
    merged: dict[str, int] = {}
    for _, scalars in present:
        for key, value in scalars.items():
            if key not in merged:
                merged[key] = value
            elif key == PREFIX + "headroom":
                merged[key] = min(merged[key], value)
            else:
                merged[key] = max(merged[key], value)
    for rank, scalars in present:
        for name in PER_RANK_FIGURES:
            if PREFIX + name in scalars:
                merged[f"{PREFIX}rank{rank}/{name}"] = scalars[PREFIX + name]
    return merged


def gather_over_ranks(scalars: dict[str, int] | None) -> dict[str, int] | None:
    """Every rank's scalars merged with :func:`merge_ranks`; a collective when a process group is up.

    Must be called by every rank at the same point (``Trainer.log`` at a logging step is).
    """
    from ..measure.ranks import gather_objects, is_distributed

    if not is_distributed():
        return scalars
    return merge_ranks(gather_objects(scalars)) or None


def strip_memory_keys(logs: dict[str, Any] | None) -> None:
    """Remove ``memory/*`` keys from ``logs`` in place (keeps the console progress line short)."""
    if logs:
        for key in [k for k in logs if isinstance(k, str) and k.startswith(PREFIX)]:
            del logs[key]


def run_before_printer(handler: Any, callback: Any) -> None:
    """Move ``callback`` just before the console printer (``ProgressCallback``/``PrinterCallback``) where
    ``trainer.add_callback`` put it after: its ``on_log`` strips the ``memory/*`` keys before the printer
    prints them (raw byte counts would fill the console). The integrations, which the Trainer adds
    before the printer, still see the keys."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    callbacks = getattr(handler, "callbacks", None)
    if not callbacks or callback not in callbacks:
        return
    printer = next((i for i, c in enumerate(callbacks) if isinstance(c, (PrinterCallback, ProgressCallback))), None)
    if printer is not None and callbacks.index(callback) > printer:
        callbacks.remove(callback)
        callbacks.insert(printer, callback)


def is_training_log(logs: Mapping[str, Any]) -> bool:
    """A training logging step's logs (carry ``loss``), not evaluation or end-of-training metrics."""
    return "loss" in logs and not any(isinstance(k, str) and k.startswith(("eval_", "test_")) for k in logs)


def split_memory_keys(logs: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``logs`` without the ``memory/*`` keys, the ``memory/*`` keys); ``logs`` itself is untouched.

    Example:
        >>> split_memory_keys({"loss": 1.5, "memory/peak": 10})
        ({'loss': 1.5}, {'memory/peak': 10})
    """
    rest: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    for key, value in (logs or {}).items():
        (memory if isinstance(key, str) and key.startswith(PREFIX) else rest)[key] = value
    return rest, memory


def _tensorboard_write(callback: Any, memory: Mapping[str, Any], step: int) -> bool:
    """``add_scalar`` each key at ``step`` on the callback's writer, then ``flush`` (as it does).

    Runs after the callback's own ``on_log``, which creates the writer when it is missing.
    """
    writer = tensorboard_writer(callback)
    if writer is None:
        return False
    for tag, value in memory.items():
        writer.add_scalar(tag, value, step)
    writer.flush()
    return True


def _wandb_stage(callback: Any, memory: Mapping[str, Any], step: int) -> bool:
    """Put the keys in the W&B run's pending row (``commit=False``); the callback's own ``log`` right
    after commits that row with ``train/loss`` and ``train/global_step``. False when no run is up."""
    run = wandb_run(callback)
    if run is None:
        return False
    run.log(dict(memory), commit=False)
    return True


def _wandb_own_row(callback: Any, memory: Mapping[str, Any], step: int) -> bool:
    """Fallback when nothing was staged (the callback set its run up in this very ``on_log``): a row
    of their own, at the same ``train/global_step`` (the step metric the callback defines)."""
    run = wandb_run(callback)
    if run is None:
        return False
    run.log({**memory, "train/global_step": step})
    return True


Writer = Callable[[Any, Mapping[str, Any], int], bool]


def _exact_name_routes() -> list[tuple[type, Writer | None, Writer]]:
    """(integration class, write before its ``on_log`` or None, write after it unless done before)
    for the integrations whose ``on_log`` prefixes training keys with ``train/``."""
    from transformers.integrations import TensorBoardCallback, WandbCallback

    tensorboard = [(TensorBoardCallback, None, _tensorboard_write)] if tensorboard_routable() else []
    return [*tensorboard, (WandbCallback, _wandb_stage, _wandb_own_row)]


def exact_name_routes(callbacks: list[Any] | None) -> list[tuple[Any, Writer | None, Writer]]:
    """(callback, write before its ``on_log`` or None, write after it) for each TensorBoard and W&B
    callback in ``callbacks`` whose ``on_log`` is not routed yet; :func:`routed_on_log` builds the
    wrapper (installed by :mod:`hf_memwatch.integration.patches`)."""
    routes = _exact_name_routes()
    found = []
    for callback in callbacks or []:
        route = next(((before, after) for cls, before, after in routes if isinstance(callback, cls)), None)
        if route is not None and not getattr(callback.on_log, _WRAPPED_MARK, False):
            found.append((callback, *route))
    return found


def routed_on_log(
    callback: Any, original: Callable[..., Any], before: Writer | None, after: Writer
) -> Callable[..., Any]:
    """``original`` fed the logs without ``memory/*``; those written by ``before`` or else ``after``."""

    @functools.wraps(original)
    def on_log(args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> Any:
        rest, memory = split_memory_keys(logs) if isinstance(logs, Mapping) else (logs, {})
        if not memory or not state.is_world_process_zero:  # the callbacks write on the main process only
            return original(args, state, control, logs=rest, **kwargs)
        step = int(state.global_step)
        done = before is not None and _safely(before, callback, memory, step)
        result = original(args, state, control, logs=rest, **kwargs)
        if not done:
            _safely(after, callback, memory, step)
        return result

    setattr(on_log, _WRAPPED_MARK, True)
    return on_log


def _safely(writer: Writer, callback: Any, memory: Mapping[str, Any], step: int) -> bool:
    """``writer``'s answer; a fault of ours is logged (False) and training goes on."""
    try:
        return bool(writer(callback, memory, step))
    except Exception as exc:  # noqa: BLE001 - a logging fault of ours must not stop training
        logger.warning("hf-memwatch: memory scalars not written to %s (%s: %s)",
                       type(callback).__name__, type(exc).__name__, exc)
        return False


def scalar_logging(
    trainer: Any,
    current: Callable[..., Any],
    scalars_for_step: Callable[[int], dict[str, int] | None],
    scalars_for_eval: Callable[[], dict[str, int] | None] | None = None,
) -> Callable[..., Any]:
    """A ``log`` for ``trainer`` (wrapping ``current``) where ``memory/*`` scalars join training logs
    before the integrations see them; installed by :mod:`hf_memwatch.integration.patches`.

    ``scalars_for_step(global_step)`` returns this rank's figures for that step, or None when the
    step was not measured. A fault in ours is logged and the log goes on without memory keys.
    ``scalars_for_eval()``, when given, returns the ``memory/eval_*`` figures of the eval loop whose
    metrics are being logged (``evaluate()`` logs them right after its loop), joined to those logs.
    """
    source = [scalars_for_step, scalars_for_eval]

    @functools.wraps(current)
    def log(logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if isinstance(logs, dict) and is_training_log(logs):
            mine = None
            try:
                mine = source[0](int(trainer.state.global_step))
            except Exception as exc:  # noqa: BLE001 - a logging fault of ours must not stop training
                logger.warning("hf-memwatch: memory scalars not logged (%s: %s)", type(exc).__name__, exc)
            # Every rank joins the gather, with or without figures, so no rank waits forever.
            figures = gather_over_ranks(mine)
            if figures:
                logs.update({k: v for k, v in figures.items() if k not in logs})
        elif isinstance(logs, dict) and source[1] is not None and is_eval_log(logs):
            mine = None
            try:
                mine = source[1]()
            except Exception as exc:  # noqa: BLE001 - a logging fault of ours must not stop training
                logger.warning("hf-memwatch: eval memory scalars not logged (%s: %s)", type(exc).__name__, exc)
            figures = gather_over_ranks(mine)
            if figures:
                logs.update({k: v for k, v in figures.items() if k not in logs})
        return current(logs, *args, **kwargs)

    setattr(log, _WRAPPED_MARK, True)
    return log
