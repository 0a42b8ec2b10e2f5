"""MemWatch(auto=True) against the Trainer's ``auto_find_batch_size`` on one over-budget configuration.

Each contender trains in its own subprocess under an address-space limit (``resource.RLIMIT_AS``),
so going over it raises a real CPU out-of-memory error ("DefaultCPUAllocator: can't allocate
memory", the message accelerate's ``find_executable_batch_size`` catches). The limit leaves room for
about half of what the configuration as given needs beyond what is already allocated; the peak it
needs is measured first, unlimited, with ``torch.profiler`` (:mod:`hf_memwatch.testing.truth`).

Reported side by side, each measured in one run: OOM exceptions raised, optimizer steps and seconds
spent before the first step of the configuration that finally trains, the effective batch it ends
with, and the throughput of that configuration (samples/s after its first step).

Usage:
    .venv/bin/python benchmarks/autotune.py            # prints the table, writes benchmarks/results/autotune.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MICRO_BATCH = 32
SEQ_LEN = 256
MAX_STEPS = 10
RESULTS = Path(__file__).parent / "results" / "autotune.md"
CONTENDERS = ("as_given", "auto_find_batch_size", "memwatch_auto", "memwatch_auto_default_budget")


def build_trainer(output_dir: str, mode: str, budget: int | None) -> Any:
    """The same model, data and arguments for every contender; only the memory tool differs."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from hf_memwatch import MemWatch
    from hf_memwatch.testing.truth import StepMarker

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=SEQ_LEN))
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 1000, (SEQ_LEN,), generator=generator) for _ in range(MICRO_BATCH * MAX_STEPS)]
    data = [{"input_ids": ids, "labels": ids.clone()} for ids in samples]
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=MICRO_BATCH, max_steps=MAX_STEPS, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        auto_find_batch_size=(mode == "auto_find_batch_size"),
    )

    class Clock(TrainerCallback):
        """Times every attempt of the training loop (auto_find_batch_size restarts it after an OOM)."""

        def __init__(self) -> None:
            self.attempts: list[dict[str, Any]] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.attempts.append({"begin": time.perf_counter(), "step_begins": [], "step_ends": []})

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.attempts[-1]["step_begins"].append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.attempts[-1]["step_ends"].append(time.perf_counter())

    clock = Clock()
    callbacks: list[Any] = [clock, StepMarker()]
    if mode.startswith("memwatch_auto"):
        # the default budget: 90% of the tightest real limit (here the address-space limit, RLIMIT_AS)
        chosen_budget = None if mode == "memwatch_auto_default_budget" else budget
        callbacks.append(MemWatch(auto=True, budget=chosen_budget, detail="light", report=False, summary=False))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    return trainer, clock


def measure_peak(output_dir: str) -> dict[str, int]:
    """Unlimited run of the configuration as given: truth peak per step and the bytes live before."""
    import torch

    from hf_memwatch.testing.truth import cpu_memory_profile, step_peaks

    trainer, _ = build_trainer(output_dir, "as_given", None)
    trainer.args.max_steps = 2
    model = trainer.model
    baseline = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
    with cpu_memory_profile() as prof:
        trainer.train()
    del torch
    return {"peak": max(step_peaks(prof, baseline)), "baseline": baseline}


def unassisted_step_seconds(output_dir: str) -> float:
    """Seconds of one optimizer step of the configuration as given, unlimited and unprofiled: the unit
    of planning cost, measured in a child like the contenders' (same threads, same malloc settings)."""
    trainer, clock = build_trainer(output_dir, "as_given", None)
    trainer.args.max_steps = 4
    trainer.train()
    ends = clock.attempts[-1]["step_ends"]
    return (ends[-1] - ends[0]) / (len(ends) - 1)


ACCURACY_PLANS = (
    (8, 1, False, "adamw_torch_fused"), (4, 2, False, "adamw_torch_fused"), (2, 4, False, "adamw_torch_fused"),
    (8, 1, True, "adamw_torch_fused"), (8, 1, True, "adamw_bnb_8bit"), (2, 4, False, "adamw_bnb_8bit"),
)


def prediction_accuracy(output_dir: str) -> str:
    """The auto mode's predictions (the estimator replaying the Trainer's own step) against the
    profiler truth of the very plans, one run each."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from hf_memwatch.core.run_config import RunConfig
    from hf_memwatch.core.units import format_bytes
    from hf_memwatch.planning.plan import Plan
    from hf_memwatch.planning.predict import ESTIMATE_MARGIN, EstimatorPredictor
    from hf_memwatch.testing.truth import StepMarker, cpu_memory_profile, step_peaks

    def trainer_for(micro: int, accum: int, ckpt: bool, optim: str, callbacks: list[Any]) -> Any:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64))
        generator = torch.Generator().manual_seed(0)
        data = [{"input_ids": ids, "labels": ids.clone()}
                for ids in (torch.randint(0, 1000, (64,), generator=generator) for _ in range(32))]
        args = TrainingArguments(
            output_dir=output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
            activation_checkpointing=ckpt, optim=optim, max_steps=2, report_to=[], save_strategy="no",
            use_cpu=True, disable_tqdm=True, seed=0,
        )
        return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)

    trainer = trainer_for(8, 1, False, "adamw_torch_fused", [])
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    predictor = EstimatorPredictor(trainer, RunConfig.from_trainer(trainer))
    lines = [
        "Prediction accuracy: GPT-2 (2 layers, 128 wide), sequence 64, effective batch 8, CPU; predicted by the "
        "estimator replaying this Trainer's own step on fake tensors; truth = highest step peak of a 2-step run "
        "(torch.profiler memory events).",
        "",
        f"| plan | predicted raw | planned (x{1 + ESTIMATE_MARGIN} margin) | truth | planned / truth |",
        "|---|---|---|---|---|",
    ]
    for micro, accum, ckpt, optim in ACCURACY_PLANS:
        plan = Plan(micro, accum, ckpt, optim)
        raw, planned = predictor.estimate(plan).peak_bytes, predictor.peak(plan)
        run = trainer_for(micro, accum, ckpt, optim, [StepMarker()])
        with cpu_memory_profile() as prof:
            run.train()
        truth = max(step_peaks(prof, weights))
        lines.append(
            f"| {micro}x{accum}{', checkpointing' if ckpt else ''}, {optim} | {format_bytes(raw)} | "
            f"{format_bytes(planned)} | {format_bytes(truth)} | {planned / truth:.4f} |"
        )
    return "\n".join(lines)


def vm_size() -> int:
    """This process's virtual memory size in bytes (what RLIMIT_AS limits)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def child(mode: str, headroom: int, budget: int, output_dir: str) -> dict[str, Any]:
    """Train one contender under the address-space limit and report what happened."""
    trainer, clock = build_trainer(output_dir, mode, budget)
    limit = vm_size() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    started = time.perf_counter()
    error = None
    try:
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - the crash is a result to report
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    attempts = clock.attempts
    final = attempts[-1] if attempts else {"step_begins": [], "step_ends": []}
    ends = final["step_ends"]
    effective = trainer._train_batch_size * trainer.args.gradient_accumulation_steps
    useful = bool(ends) and error is None
    return {
        "mode": mode,
        "error": error,
        "attempts": len(attempts),
        "ooms": max(0, len(attempts) - 1) + (1 if error and "can't allocate memory" in error else 0),
        "wasted_steps": sum(len(a["step_ends"]) for a in attempts[:-1]),
        "seconds_before_first_useful_step": (final["step_begins"][0] - started) if useful else None,
        "effective_batch": effective,
        "micro_batch": trainer.args.per_device_train_batch_size if mode != "auto_find_batch_size" else trainer._train_batch_size,
        "accumulation": trainer.args.gradient_accumulation_steps,
        "checkpointing": bool(getattr(trainer.args, "activation_checkpointing", False)),
        "optim": str(getattr(trainer.args.optim, "value", trainer.args.optim)),
        "steps": len(ends),
        "steps_per_attempt": [len(a["step_ends"]) for a in attempts],
        "predicted_peak": next((cb.auto_plan or {} for cb in trainer.callback_handler.callbacks
                                if hasattr(cb, "auto_plan") and cb.auto_plan), {}).get("predicted_peak"),
        "budget_source": next((cb.auto_plan or {} for cb in trainer.callback_handler.callbacks
                               if hasattr(cb, "auto_plan") and cb.auto_plan), {}).get("budget_source"),
        "planning_seconds": next((cb.planning_seconds for cb in trainer.callback_handler.callbacks
                                  if getattr(cb, "planning_seconds", None) is not None), None),
        "samples_per_second": (effective * (len(ends) - 1) / (ends[-1] - ends[0])) if useful and len(ends) > 1 else None,
    }


def run_child(mode: str, headroom: int, budget: int, workdir: Path) -> dict[str, Any]:
    """One contender (or ``unassisted``: the step-time unit) in a subprocess; its RESULT line."""
    out = workdir / mode
    # A fixed mmap threshold makes glibc return every large freed block at once, so the address
    # space follows live tensor bytes instead of heap high-water marks (same for every contender).
    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1")
    cmd = [sys.executable, __file__, "--child", mode, "--headroom", str(headroom), "--budget", str(budget),
           "--output-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"mode": mode, "error": f"child exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}


def table(results: list[dict[str, Any]], calibration: dict[str, int], headroom: int, budget: int) -> str:
    from hf_memwatch.core.units import format_bytes

    def fmt(value: Any, pattern: str = "{}") -> str:
        return "-" if value is None else pattern.format(value)

    lines = [
        f"Configuration: GPT-2 (2 layers, 128 wide), micro-batch {MICRO_BATCH} x accumulation 1, sequence "
        f"{SEQ_LEN}, {MAX_STEPS} optimizer steps, CPU. Unlimited truth peak "
        f"{format_bytes(calibration['peak'])} (model {format_bytes(calibration['baseline'])}); address-space "
        f"headroom {format_bytes(headroom)} above the process at train(); MemWatch budget {format_bytes(budget)}. "
        f"Load average at start: {calibration['load']:.1f} on {os.cpu_count()} cores (shared machine: timings are "
        "indicative). One unassisted optimizer step of the configuration as given (unlimited, in a child process "
        "like the contenders': OMP_NUM_THREADS=1, same malloc settings): "
        f"{calibration['step_seconds']:.2f} s (mean of "
        + " s before and ".join(f"{s:.2f}" for s in calibration["step_seconds_measured"]) + " s after the contenders).",
        "",
        "| contender | OOM exceptions | steps wasted | seconds before first useful step (of which planning) | final micro-batch x accum (ckpt, optim) | effective batch | samples/s | outcome |",
        "|---|---|---|---|---|---|---|---|",
    ]
    def planning(r: dict[str, Any]) -> str:
        seconds = r.get("planning_seconds")
        if not seconds:
            return ""
        return f" ({seconds:.2f} = {seconds / calibration['step_seconds']:.1f} unassisted steps)"

    for r in results:
        plan = f"{r.get('micro_batch')} x {r.get('accumulation')} ({'ckpt' if r.get('checkpointing') else 'no ckpt'}, {r.get('optim')})"
        lines.append(
            f"| {r['mode']} | {fmt(r.get('ooms'))} | {fmt(r.get('wasted_steps'))} | "
            f"{fmt(r.get('seconds_before_first_useful_step'), '{:.2f}')}"
            f"{planning(r)} | {plan} | {fmt(r.get('effective_batch'))} | "
            f"{fmt(r.get('samples_per_second'), '{:.1f}')} | {r.get('error') or 'trained ' + str(r.get('steps')) + ' steps'}"
            f"{' (budget: ' + r['budget_source'] + ')' if r.get('budget_source') else ''} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=(*CONTENDERS, "unassisted"))
    parser.add_argument("--headroom", type=int)
    parser.add_argument("--budget", type=int)
    parser.add_argument("--output-dir", default="/tmp/hf_memwatch_autotune")
    parser.add_argument("--no-write", action="store_true", help="print only, do not update results/autotune.md")
    args = parser.parse_args()
    if args.child == "unassisted":
        print("RESULT " + json.dumps({"step_seconds": unassisted_step_seconds(args.output_dir)}), flush=True)
        return 0
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.headroom, args.budget, args.output_dir)), flush=True)
        return 0
    workdir = Path(args.output_dir)
    load = os.getloadavg()[0]
    calibration: dict[str, Any] = dict(measure_peak(str(workdir / "calibration")), load=load)
    need = calibration["peak"] - calibration["baseline"]
    headroom = need // 2  # about half of what the configuration as given needs
    budget = calibration["baseline"] + int(0.8 * headroom)  # tensors; the rest for Python, threads, malloc
    # The unit, measured before and after the contenders (the machine is shared): their mean.
    units = [run_child("unassisted", headroom, budget, workdir)]
    results = [run_child(mode, headroom, budget, workdir) for mode in CONTENDERS]
    units.append(run_child("unassisted", headroom, budget, workdir))
    calibration["step_seconds_measured"] = [unit["step_seconds"] for unit in units]
    calibration["step_seconds"] = sum(calibration["step_seconds_measured"]) / len(units)
    text = table(results, calibration, headroom, budget) + "\n\n" + prediction_accuracy(str(workdir / "accuracy"))
    print(text)
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text("# benchmarks/autotune.py — latest output\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
