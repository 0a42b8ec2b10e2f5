"""OOM post-mortem of an evaluation loop: ``memwatch/oom_report.md`` naming the loop, the batch, the
outputs accumulated when it failed, and the eval remedies with their predicted savings.

Written by the ``MemWatch`` callback when ``Trainer.evaluation_loop`` (``evaluate()``, ``predict()``,
the eval inside ``train()``) raises an out-of-memory error; the error itself propagates unchanged
(same object, same traceback). Remedies — the catalogue's eval remedies
(:data:`hf_memwatch.planning.catalogue.EVAL_REMEDIES`), each alone one step from the loop
(:func:`hf_memwatch.planning.remedies.eval_single_steps`) — each predicted by
:func:`hf_memwatch.estimation.estimate.estimate_eval` at the loop's configuration:

* a smaller ``per_device_eval_batch_size`` (half);
* ``eval_accumulation_steps=1`` (on CUDA the outputs leave the device every batch; on the CPU the
  device is the host: numpy holds the same bytes, its concatenation the old and the new array at
  once, which the predicted figure adds, so it saves nothing there);
* ``preprocess_logits_for_metrics`` returning ``logits.argmax(-1)`` (token ids instead of logits);
* ``prediction_loss_only=True`` (no logits, no labels kept).

A CPU OOM leaves no memory in the dying process: the failed loop's frames (finished, reachable only
through the traceback) still hold its accumulated outputs and the failing batch. They are cleared
(``frame.clear()``: their locals go, the traceback's frames and line numbers stay) before the
estimator runs, after the measured part of the report is on disk.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.categories import EVAL_LIVE_CLASSES
from ..core.records import EvalRecord, OomRecord, Snapshot
from ..core.run_config import RunConfig
from ..core.units import format_bytes
from ..planning.eval_plan import eval_request
from ..planning.plan import EvalSetting
from ..planning.remedies import eval_single_steps
from .oom import REPORT_NAME, cpu_memory_exhausted, requested_bytes

logger = logging.getLogger("hf_memwatch")


@dataclasses.dataclass(frozen=True)
class EvalFailure:
    """The failing eval loop as the estimator needs it: the run's settings (one
    :class:`~hf_memwatch.core.run_config.RunConfig`, read from ``TrainingArguments`` by its one reader,
    ``seq_len`` the eval batch's) and what only the failure knows: the dataset's size and the optimizer
    states resident during the loop."""

    run: RunConfig
    samples: int | None
    optimizer_state_bytes: int = 0

    @classmethod
    def from_trainer(cls, trainer: Any, seq_len: int | None, optimizer_state_bytes: int) -> EvalFailure:
        dataloader = getattr(getattr(trainer, "callback_handler", None), "eval_dataloader", None)
        dataset = getattr(dataloader, "dataset", None)
        samples = len(dataset) if hasattr(dataset, "__len__") else None
        known = seq_len if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len > 0 else None
        return cls(RunConfig.from_args(trainer.args, seq_len=known), samples, optimizer_state_bytes)

    @property
    def batch_size(self) -> int:
        return int(self.run.eval_batch_size or 8)


def clear_failed_loop_frames(exc: BaseException) -> int:
    """Clear the finished frames from ``evaluation_loop`` inwards in ``exc``'s traceback; how many."""
    tb, cleared, inside = exc.__traceback__, 0, False
    while tb is not None:
        frame = tb.tb_frame
        inside = inside or frame.f_code.co_name == "evaluation_loop"
        if inside:
            try:
                frame.clear()
                cleared += 1
            except RuntimeError:  # a frame still executing (ours, on the way out)
                pass
        tb = tb.tb_next
    return cleared


def eval_remedies(
    model: Any, config: EvalFailure, estimate_eval: Callable[..., Any]
) -> tuple[int | None, list[tuple[str, int | None, str]], str]:
    """(predicted peak of the failing loop, [(remedy, predicted peak, note)], note on the whole)."""
    run = config.run
    if run.seq_len is None or config.samples is None:
        return None, [], "the eval batch's sequence length or the dataset's size is unknown"
    subject = getattr(model, "config", None) or model
    given = EvalSetting.of(run)

    def peak_of(setting: EvalSetting) -> tuple[int, int]:
        request = eval_request(run, setting, eval_samples=config.samples,
                               optimizer_state_bytes=config.optimizer_state_bytes)
        sim = estimate_eval(subject, request)
        return int(sim.peak_bytes), int(sim.host_bytes)

    try:
        baseline, _ = peak_of(given)
    except Exception as exc:  # noqa: BLE001 - report what we can
        return None, [], f"the estimator failed on this loop's configuration ({type(exc).__name__}: {exc})"
    rows: list[tuple[str, int | None, str]] = []
    for description, setting, note in eval_single_steps(run, given):
        try:
            peak, host = peak_of(setting)
            if run.device == "cpu" and setting.eval_accumulation_steps != given.eval_accumulation_steps:
                # The host *is* the device: numpy's copies count against the same RAM, and each
                # np.concatenate holds the old and the new array at once.
                peak += 2 * host
            rows.append((description, peak, note))
        except Exception as exc:  # noqa: BLE001
            rows.append((description, None, f"estimator failed: {type(exc).__name__} {exc}".strip()))
    return baseline, rows, ""


def write_eval_oom_report(
    directory: str | os.PathLike[str], exc: BaseException, loop: EvalRecord,
    failure: Snapshot | None, trainer: Any, seq_len: int | None, writer: Any = None,
) -> Path:
    """Write ``<directory>/oom_report.md`` for an OOM inside an eval loop (and an ``oom`` record)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    live = dict((failure.live if failure is not None else None) or {})
    config = EvalFailure.from_trainer(trainer, seq_len, int(live.get("optimizer_states") or 0))
    model = getattr(trainer, "model", None)
    record = OomRecord(
        stage=loop.stage, step=loop.step, batch=loop.batches,
        micro_step=loop.batches, rank=loop.rank if loop.rank is not None else 0,
        last_phase=None if failure is None else failure.phase, time=time.time(), requested=requested_bytes(exc),
        allocated_at_failure=None if failure is None else failure.allocated,
        live_at_failure=live or None,  # type: ignore[arg-type]
        outputs_at_failure=live.get("outputs"), error=f"{type(exc).__name__}: {str(exc)[:300]}",
    )
    if writer is not None:
        writer.write(record)
        writer.flush()
    path = directory / REPORT_NAME

    def render(baseline: int | None, remedies: list[tuple[str, int | None, str]], note: str) -> None:
        text = render_eval_oom_report(exc, loop, failure, config, model, baseline, remedies, note)
        partial = path.with_suffix(".md.partial")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)

    render(None, [], "the estimator did not finish (the process may have had no memory left to run it)")
    if cpu_memory_exhausted(exc):
        clear_failed_loop_frames(exc)
        gc.collect()
    from ..estimation.estimate import estimate_eval

    render(*eval_remedies(model, config, estimate_eval))
    logger.warning("hf-memwatch: out of memory in the %s loop (batch %s); post-mortem in %s",
                   loop.stage, loop.batches, path)
    return path


def render_eval_oom_report(
    exc: BaseException, loop: EvalRecord, failure: Snapshot | None, config: EvalFailure,
    model: Any, baseline: int | None, remedies: list[tuple[str, int | None, str]], note: str,
) -> str:
    """The Markdown text of an eval loop's post-mortem."""
    name = type(model).__name__ if model is not None else "?"
    stage = loop.stage
    call = "predict()" if stage == "predict" else "evaluate()"
    first = (str(exc).strip().splitlines() or [""])[0][:400]
    batches = "?" if config.samples is None else -(-config.samples // config.batch_size)
    lines = [
        "# hf-memwatch: out-of-memory post-mortem (evaluation loop)", "",
        f"- **Error:** `{type(exc).__name__}: {first}`",
        f"- **Where:** the {stage} loop (`Trainer.{call}`) at global step {loop.step}, "
        f"eval batch {loop.batches} of {batches} (0-based)",
        f"- **Loop:** {name}, per_device_eval_batch_size {config.batch_size}, {config.samples or '?'} samples, "
        f"sequence length {config.run.seq_len or '?'}, eval_accumulation_steps {config.run.eval_accumulation_steps}, "
        f"{config.run.precision}, device {config.run.device}",
    ]
    requested = requested_bytes(exc)
    if requested is not None:
        lines.append(f"- **Failed allocation:** {format_bytes(requested)}")
    live = (failure.live if failure is not None else None) or {}
    if failure is not None:
        lines.append(f"- **Live when it failed:** {format_bytes(failure.allocated)}, of which "
                     f"**{format_bytes(live.get('outputs'))} accumulated outputs** (predictions, logits, labels "
                     "held by the loop until it ends)")
        lines += ["", "## Live memory when the allocation failed", "", "| class | bytes |", "|---|---:|"]
        lines += [f"| {c} | {format_bytes(live.get(c))} |" for c in EVAL_LIVE_CLASSES]
        lines.append(f"| **allocated** | **{format_bytes(failure.allocated)}** |")
    if loop.peak is not None:
        lines.append(f"\nHighest point of the loop before it failed: {format_bytes(loop.peak)} "
                     f"(batch {loop.peak_batch}).")
    lines += ["", "## Eval remedies and what each would save", ""]
    if baseline is None:
        lines.append(f"No estimator figures: {note}.")
    else:
        lines += [f"Predicted peak of this loop: **{format_bytes(baseline)}** "
                  "(hf_memwatch.estimation.estimate_eval).", "",
                  "| remedy | predicted peak | saves | note |", "|---|---:|---:|---|"]
        for description, peak, problem in sorted(remedies, key=lambda r: r[1] if r[1] is not None else 1 << 62):
            saves = "-" if peak is None else format_bytes(max(baseline - peak, 0))
            lines.append(f"| {description} | {format_bytes(peak)} | {saves} | {problem} |")
    return "\n".join(lines) + "\n"
