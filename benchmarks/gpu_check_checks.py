"""The checks of ``benchmarks/gpu_check.py``: attribution, prediction, prevention, overhead (here) and
published (:mod:`gpu_check_published`).

Each takes a :class:`~gpu_check_probe.Context` (the probe, its deadline, where results go) and
returns a :class:`~gpu_check_report.CheckResult`; each bounds itself by ``ctx`` inside its run.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from gpu_check_probe import CPU_BLIND, CUDA_ONLY, Context, measured_rows
from gpu_check_published import check_published
from gpu_check_report import (
    GOALS,
    CheckResult,
    Config,
    attribution_verdict,
    configurations,
    error_stats,
    interleaved,
    overhead_ratio,
    prevention_verdict,
    relative_error,
)
from gpu_check_runs import (
    AllocatorReader,
    PeakFromTrainBegin,
    PeakWindow,
    build_model,
    build_qlora_model,
    dataset_for,
    timed_run,
    train,
    training_args,
)

from hf_memwatch import MemWatch
from hf_memwatch.core.timeline import read_timeline
from hf_memwatch.estimation.estimate import estimate


# -- the checks -----------------------------------------------------------------------------------
def check_attribution(ctx: Context) -> CheckResult:
    """Classes sum to the device's allocated bytes at every snapshot; step peaks equal the device's."""
    probe = ctx.probe
    arch, batch, seq_len, steps = ("gpt2", 2, 32, 2) if ctx.quick else ("gpt2", 8, 512, 4)
    accum = 2
    details: dict[str, Any] = {"arch": arch, "batch": batch, "seq_len": seq_len, "steps": steps,
                               "gradient_accumulation_steps": accum, "truth": probe.kind}

    def run(tmp: str, callbacks: list[Any]) -> None:
        model = build_model(arch, ctx.quick, probe.device)
        args = training_args(tmp, batch=batch, steps=steps, device=probe.kind, bf16=ctx.cuda,
                             gradient_accumulation_steps=accum)
        train(probe, model, args, dataset_for(model, batch, seq_len, accum * steps), callbacks)
        del model
        probe.free()

    with tempfile.TemporaryDirectory(dir=ctx.workdir) as tmp:
        started = time.perf_counter()
        window, reader = PeakWindow(probe), AllocatorReader(probe)
        run(tmp, [window, reader, MemWatch(detail="full", report=False, summary=False)])
        records = list(read_timeline(Path(tmp) / "memwatch" / "timeline.jsonl"))
        first_run_s = time.perf_counter() - started
        twin: PeakWindow | None = None
        if ctx.fits(first_run_s):
            twin = PeakWindow(probe)  # unmonitored, peaks reset the same way
            run(tmp + "/twin", [twin])
        else:
            ctx.skip("attribution", "the unmonitored twin run",
                     f"out of time: {ctx.left():.0f} s left, the monitored run took {first_run_s:.0f} s")
    snapshots = [r for r in records if r["event"] == "snapshot"]
    verdict = attribution_verdict(snapshots, reader.reads)
    ours = [r["peak"] for r in records if r["event"] == "step"]
    details.update(verdict, hooked_module=reader.hooked, memwatch_step_peaks=ours)
    problems = list(verdict["mismatches"])
    twin_text = "twin run dropped (time)"
    if twin is not None:
        twin_errors = [relative_error(a, b) for a, b in zip(ours, twin.peaks)]
        details.update(unmonitored_step_peaks=twin.peaks, unmonitored_errors=twin_errors)
        if len(ours) != len(twin.peaks) or any(abs(e) > GOALS["step_peak_rel"] for e in twin_errors):
            problems.append(f"step peaks {ours} vs unmonitored twin {twin.peaks}")
        twin_text = f"unmonitored twin within {max(map(abs, twin_errors), default=0):.2%}"
    summary = (f"{verdict['snapshots']} snapshots: classes sum to the {probe.kind} allocated bytes and step peaks "
               f"equal the {probe.kind} peak; {twin_text}")
    if problems:
        summary = f"{len(problems)} mismatch(es): " + "; ".join(problems[:3])
    return CheckResult("attribution", not problems, summary, details)


def measure_peak(config: Config, ctx: Context) -> dict[str, Any]:
    """Estimate, then train 3 steps (2 quick: the second has the optimizer's states) and read the
    device's peaks, reset once the model is placed."""
    probe, steps = ctx.probe, 2 if ctx.quick else 3
    row: dict[str, Any] = asdict(config)
    if config.qlora:
        model, _, _ = build_qlora_model(config.arch, ctx.quick, probe.device, ctx.workdir)
    else:
        model = build_model(config.arch, ctx.quick, probe.device)
    est = estimate(model, micro_batch_size=config.batch, seq_len=config.seq_len, precision=config.precision,
                   optim=config.optim, activation_checkpointing=config.checkpointing, device=probe.kind)
    row.update(params=est.params, trainable_params=est.trainable_params, predicted=est.peak_bytes,
               predicted_reserved=getattr(est, "reserved_bytes", None),
               predicted_device=getattr(est, "device_bytes", None))
    with tempfile.TemporaryDirectory(dir=ctx.workdir) as tmp:
        args = training_args(tmp, batch=config.batch, steps=steps, device=probe.kind, bf16=config.precision == "bf16",
                             fp16=config.precision == "fp16", optim=config.optim, checkpointing=config.checkpointing)
        trainer = train(probe, model, args, dataset_for(model, config.batch, config.seq_len, steps),
                        [PeakFromTrainBegin(probe)])
        row.update(max_allocated=probe.peak(), max_reserved=probe.peak_reserved(), device_used=probe.device_used(),
                   num_alloc_retries=probe.num_alloc_retries(), num_ooms=probe.num_ooms())
        del trainer
    del model
    probe.free()
    row["error_allocated"] = relative_error(row["predicted"], row["max_allocated"])
    if not ctx.cuda and "bnb" in config.optim:
        row["excluded"] = CPU_BLIND["bnb"]
    for key, predicted, measured in (("error_reserved", "predicted_reserved", "max_reserved"),
                                     ("error_device", "predicted_device", "device_used")):
        if row[predicted] is not None and row[measured]:
            row[key] = relative_error(row[predicted], row[measured])
    return row


def prediction_result(rows: list[dict[str, Any]], planned: int, dropped: list[Config], running: bool) -> CheckResult:
    """The prediction check's verdict over the rows measured so far (``running``: partial, no verdict)."""
    measured = [r for r in rows if "error_allocated" in r and "excluded" not in r]
    failed = [r for r in rows if "error" in r]
    details: dict[str, Any] = {"configurations": rows, "planned": planned,
                               "dropped": [asdict(c) for c in dropped]}
    if not measured:
        return CheckResult("prediction", None if running else False,
                           "running: no configuration measured yet" if running else "no configuration could be measured",
                           details)
    allocated = error_stats([r["error_allocated"] for r in measured])
    reserved_errors = [r["error_reserved"] for r in measured if "error_reserved" in r]
    device_errors = [r["error_device"] for r in measured if "error_device" in r]
    reserved = error_stats(reserved_errors) if reserved_errors else None
    device = error_stats(device_errors) if device_errors else None
    details.update(allocated=allocated, reserved=reserved, device=device)
    text = (f"{len(measured)} of {planned} configurations; vs allocated: median {allocated['median']:.2%}, worst "
            f"{allocated['worst_signed']:+.2%}")
    if reserved:
        text += f"; vs reserved: median {reserved['median']:.2%}, worst {reserved['worst_signed']:+.2%}"
    if device:
        text += f"; vs mem_get_info: median {device['median']:.2%}, worst {device['worst_signed']:+.2%}"
    if failed:
        text += f"; {len(failed)} failed to run"
    if dropped:
        text += f"; {len(dropped)} dropped (time)"
    if running:
        return CheckResult("prediction", None, "running: " + text, details)
    passed = (not failed and allocated["median"] <= GOALS["prediction_median"]
              and allocated["worst"] <= GOALS["prediction_worst"]
              and (reserved is None or reserved["worst"] <= GOALS["reserved_worst"]))
    return CheckResult("prediction", passed, text, details)


def check_prediction(ctx: Context) -> CheckResult:
    """The estimator against the sweep, most informative first; what would not fit the budget is dropped."""
    configs = configurations(ctx.quick)
    started = time.perf_counter()

    def publish(rows: list[dict[str, Any]]) -> None:
        partial = prediction_result(rows, len(configs), [], running=True)
        partial.seconds = time.perf_counter() - started
        ctx.results.publish(partial)

    rows, dropped = measured_rows(
        ctx, "prediction", configs, lambda config: measure_peak(config, ctx),
        lambda config, exc: {**asdict(config), "error": f"{type(exc).__name__}: {str(exc)[:300]}"}, publish,
        lambda dropped: f"{len(dropped)} configuration(s): " + ", ".join(f"{c.arch} {c.batch}x{c.seq_len}"
                                                                         for c in dropped), "configuration")
    if not ctx.cuda:
        for what in ("reserved", "mem_get_info"):
            ctx.skip("prediction", f"predicted vs measured {what}", CUDA_ONLY[what])
        excluded = [r for r in rows if "excluded" in r]
        if excluded:
            ctx.skip("prediction", f"{len(excluded)} 8-bit AdamW configuration(s) in the statistics", CPU_BLIND["bnb"])
    return prediction_result(rows, len(configs), dropped, running=False)


def _auto_run(ctx: Context, arch: str, batch: int, seq_len: int, steps: int, memwatch: Any,
              **overrides: Any) -> dict[str, Any]:
    """One Trainer run of the prevention check, never raising: completion, OOMs, peaks, the plan."""
    probe = ctx.probe
    probe.free()
    ooms_before = probe.num_ooms()
    started = time.perf_counter()
    outcome: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=ctx.workdir) as tmp:
        try:
            model = build_model(arch, ctx.quick, probe.device)
            args = training_args(tmp, batch=batch, steps=steps, device=probe.kind, bf16=ctx.cuda, **overrides)
            callbacks = [PeakFromTrainBegin(probe)] + ([memwatch] if memwatch is not None else [])
            trainer = train(probe, model, args, dataset_for(model, batch, seq_len, 4 * steps), callbacks)
            outcome.update(completed=True, final_micro_batch=trainer._train_batch_size,
                           gradient_accumulation_steps=trainer.args.gradient_accumulation_steps,
                           global_steps=trainer.state.global_step)
            if memwatch is not None and memwatch.auto_plan:
                outcome["plan"] = dict(memwatch.auto_plan)
            del trainer, model
        except Exception as exc:  # noqa: BLE001 - the verdict records it
            outcome.update(completed=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        timeline = Path(tmp) / "memwatch" / "timeline.jsonl"
        snaps = [r for r in read_timeline(timeline) if r["event"] == "snapshot"] if timeline.exists() else []
    outcome["seconds"] = time.perf_counter() - started
    if ooms_before is not None:
        outcome["num_ooms"] = (probe.num_ooms() or 0) - ooms_before
        outcome["num_alloc_retries"] = probe.num_alloc_retries()
    if ctx.cuda:
        # MemWatch resets the allocator's peaks at every snapshot; without empty_cache (and without a
        # retry, which frees cached blocks: num_alloc_retries) reserved only grows, so its value at
        # the end and at every snapshot bound the run's peak from below.
        outcome["measured"] = max(probe.peak_reserved() or 0, probe.reserved() or 0,
                                  max((r.get("reserved") or 0 for r in snaps), default=0))
    else:
        outcome["measured"] = probe.peak()  # the CPU tracker: MemWatch does not reset it
    probe.free()
    return outcome


def _plan_prediction(ctx: Context, arch: str, seq_len: int, plan: dict[str, Any] | None) -> int | None:
    """The auto plan's predicted bytes (reserved on CUDA, allocated on the CPU), by the estimator."""
    if not plan or plan.get("micro_batch_size") is None:
        return None
    est = estimate(build_model(arch, ctx.quick, "cpu"), micro_batch_size=plan["micro_batch_size"],
                   seq_len=seq_len, gradient_accumulation_steps=plan["gradient_accumulation_steps"],
                   activation_checkpointing=bool(plan["activation_checkpointing"]), optim=plan["optim"],
                   precision="bf16" if ctx.cuda else "fp32", device=ctx.probe.kind)
    reserved = getattr(est, "reserved_bytes", None)
    return reserved if ctx.cuda and reserved is not None else est.peak_bytes


def check_prevention(ctx: Context) -> CheckResult:
    """A limit at half the configured batch's need: the auto mode must fit it, as its plan predicted."""
    probe = ctx.probe
    arch, batch, seq_len, steps = ("gpt2", 8, 64, 2) if ctx.quick else ("gpt2", 32, 1024, 4)
    configured = estimate(build_model(arch, ctx.quick, "cpu"), micro_batch_size=batch,
                          seq_len=seq_len, precision="bf16" if ctx.cuda else "fp32", device=probe.kind)
    need = getattr(configured, "reserved_bytes", None) or configured.peak_bytes
    allowed = int(0.5 * need)  # half of what the configured batch needs
    details: dict[str, Any] = {"arch": arch, "batch": batch, "seq_len": seq_len, "predicted_configured": need,
                               "allowed": allowed}
    if ctx.cuda:
        total = probe.total_memory() or 1
        fraction = min(1.0, allowed / total)
        details["fraction"] = fraction
        torch.cuda.set_per_process_memory_fraction(fraction, probe.device)
        memwatch = MemWatch(auto=True, report=False, summary=False)  # the default budget reads the fraction
    else:
        ctx.skip("prevention", "set_per_process_memory_fraction and num_ooms", CUDA_ONLY["fraction"])
        memwatch = MemWatch(auto=True, budget=allowed, report=False, summary=False)
    try:
        auto = _auto_run(ctx, arch, batch, seq_len, steps, memwatch)
        details["memwatch_auto"] = auto
        if ctx.cuda and not auto.get("completed") and ctx.fits(auto["seconds"]):
            # Tell a planning failure from a limit the auto mode could not see.
            details["memwatch_auto_explicit_budget"] = _auto_run(
                ctx, arch, batch, seq_len, steps, MemWatch(auto=True, budget=allowed, report=False, summary=False))
        if not ctx.cuda:
            ctx.skip("prevention", "auto_find_batch_size", CUDA_ONLY["auto_find_batch_size"])
        elif ctx.fits(auto["seconds"]):
            details["auto_find_batch_size"] = _auto_run(ctx, arch, batch, seq_len, steps, None,
                                                        auto_find_batch_size=True)
        else:
            ctx.skip("prevention", "auto_find_batch_size", f"out of time: {ctx.left():.0f} s left")
    finally:
        if ctx.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, probe.device)
    predicted = _plan_prediction(ctx, arch, seq_len, auto.get("plan"))
    details["plan_predicted"] = predicted
    passed, why = prevention_verdict(auto, allowed, predicted)
    summary = f"MemWatch(auto=True) within {allowed / 2**20:,.1f} MiB: {why}"
    hf = details.get("auto_find_batch_size")
    if hf:
        summary += (f". auto_find_batch_size: completed at micro-batch {hf.get('final_micro_batch')} after "
                    f"{hf.get('num_ooms')} OOM(s)" if hf.get("completed") else f". auto_find_batch_size: failed "
                    f"({hf.get('error')})")
    return CheckResult("prevention", passed, summary, details)


def check_overhead(ctx: Context) -> CheckResult:
    """MemWatch(report=False) vs none: interleaved runs, ratio of median seconds per step (the dry run:
    one round of each, its CPU timing has no goal; the interleaving itself is unit-tested)."""
    rounds = 1 if ctx.quick else 3
    shape = ({"arch": "gpt2", "batch": 2, "seq_len": 32, "steps": 4, "warmup": 1} if ctx.quick
             else {"arch": "gpt2", "batch": 8, "seq_len": 512, "steps": 40, "warmup": 10})
    durations: list[float] = []

    def measure(memwatch: bool) -> Callable[[], float]:
        def run() -> float:
            begun = time.perf_counter()
            seconds = timed_run(shape["arch"], batch=shape["batch"], seq_len=shape["seq_len"], steps=shape["steps"],
                                warmup=shape["warmup"], device=ctx.probe.kind, memwatch=memwatch, tiny=ctx.quick,
                                workdir=ctx.workdir)
            durations.append(time.perf_counter() - begun)
            return seconds
        return run

    without, with_memwatch = interleaved(measure(False), measure(True), rounds,
                                         keep_going=lambda: ctx.fits(2 * max(durations)))
    if len(without) < rounds:
        ctx.skip("overhead", f"{rounds - len(without)} of {rounds} rounds", f"out of time: {ctx.left():.0f} s left")
    ratio = overhead_ratio(without, with_memwatch)
    details = {**shape, "rounds": len(without), "seconds_without": without, "seconds_with": with_memwatch,
               "ratio": ratio, "memwatch": "MemWatch(report=False): no background picture process while timing"}
    summary = (f"{ratio:.4f}x step time with MemWatch() (median of {len(without)} interleaved runs of "
               f"{shape['steps'] - shape['warmup']} steady steps; goal <= {GOALS['overhead_ratio']})")
    passed = ratio <= GOALS["overhead_ratio"] if ctx.cuda else True  # CPU timing: reported, no goal
    if not ctx.cuda:
        ctx.skip("overhead", "the 1.01 goal", CUDA_ONLY["overhead_goal"])
    return CheckResult("overhead", passed, summary, details)


CHECKS: dict[str, Callable[[Context], CheckResult]] = {
    "attribution": check_attribution,
    "prediction": check_prediction,
    "prevention": check_prevention,
    "overhead": check_overhead,
    "published": check_published,  # gpu_check_published.py: the published configurations on this card
}
