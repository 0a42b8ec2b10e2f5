"""Per-rank accuracy of the engine-aware prediction on 2 CPU ranks (issue 19).

Launches ``tests/dist_scripts/deepspeed_zero.py`` with ``torchrun --nproc-per-node 2`` (gloo,
DeepSpeed's CPU accelerator; test GPT-2, 590,336 fp32 parameters, micro-batch 4 x accumulation 2,
32 tokens and, for ZeRO-2, ZeRO-3 and ZeRO-3 + offload, 128 (``_long``: activations dominate),
buckets of 100,000 elements, 2 steps) and writes, per engine and rank, the prediction made before
``train()`` (``estimate(trainer)``, no DeepSpeed engine yet) against the step peak MemWatch measured
on that rank, and the auto mode's runs (the script's ``AUTO_RUNS``: 0.7 x the 128-token runs' peaks,
0.76 x the 32-token ZeRO-3 + offload run's).

The reference is the profiler's per-rank step peak (each configured and each planned run profiled from
the model's construction on, the auto mode's planning taken out as ``estimate()``'s leftovers are), with the frees gloo's worker threads make reconciled (``hf_memwatch.testing.truth``,
``reconcile=True``: the profiler reports no free made on a thread that does not profile); the raw
running sum is shown beside it. Usage: ``python benchmarks/engines_accuracy.py --out benchmarks/results/engines_accuracy.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist_scripts" / "deepspeed_zero.py"
ENGINES = ("zero1", "zero2", "zero3", "zero3_offload", "zero3_offload_param", "zero2_long", "zero3_long",
           "zero3_offload_long")


def launch(out: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               HF_MEMWATCH_ZERO_TRUTH="1",  # the per-rank profiler truth (off in the test suite's launch)
               TMPDIR=str(out))  # torch elastic's folders in the launch's, not /tmp
    proc = subprocess.Popen([str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--master-addr",
                             "127.0.0.1", "--master-port", str(port), str(SCRIPT), str(out)], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        if proc.wait(timeout=900) != 0:
            raise SystemExit(f"{SCRIPT.name} exited with {proc.returncode}")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(f"{SCRIPT.name} did not finish in 900 s") from None


def step_peaks(run_dir: Path, rank: int) -> list[int]:
    name = "timeline.jsonl" if rank == 0 else f"timeline.rank{rank}.jsonl"
    records = [json.loads(line) for line in (run_dir / "memwatch" / name).read_text().splitlines() if line.strip()]
    return [r["peak"] for r in records if r["event"] == "step"]


def step_peak(run_dir: Path, rank: int) -> int:
    return max(step_peaks(run_dir, rank))


def truth_table(out: Path, facts: list[dict]) -> list[str]:
    lines = ["## Against the profiler, per rank", "",
             "| engine | rank | profiler step peaks, reconciled (B) | raw (B) | predicted before train() | error | "
             "worst branch (B) | its excess | MemWatch per step |",
             "|---|---|---|---|---|---|---|---|---|"]
    predicted_errors, watch_errors = [], []
    for engine in ENGINES:
        for rank in (0, 1):
            truth = facts[rank][engine].get("truth_step_peaks")
            if not truth:
                continue
            ours = step_peaks(out / engine, rank)
            predicted, worst = _branches(facts[rank][engine])
            error = predicted / max(truth) - 1
            predicted_errors.append(abs(error))
            per_step = [m / t - 1 for m, t in zip(ours, truth)]
            watch_errors.extend(abs(e) for e in per_step)
            raw = facts[rank][engine].get("truth_raw_step_peaks") or []
            lines.append(f"| {facts[rank][engine]['engine']}, {facts[rank][engine]['seq_len']} tokens | {rank} | "
                         f"{', '.join(f'{t:,}' for t in truth)} | "
                         f"{', '.join(f'{t:,}' for t in raw)} | "
                         f"{predicted:,} | {100 * error:+.2f}% | {worst:,} | {100 * (worst / max(truth) - 1):+.2f}% | "
                         f"{', '.join(f'{100 * e:+.2f}%' for e in per_step)} |")
    if predicted_errors:
        lines += ["", f"prediction: median |error| {100 * statistics.median(predicted_errors):.2f}%, worst "
                      f"{100 * max(predicted_errors):.2f}%; MemWatch per step: median "
                      f"{100 * statistics.median(watch_errors):.2f}%, worst {100 * max(watch_errors):.2f}%", "",
                  "The prediction is the branch of gloo's race that frees first (`MemoryEstimate.branches`); the "
                  "worst branch (the estimate, what a plan takes: a reduction's flat copy or bucket held by gloo's "
                  "workers, the last two collectives' tensors, `engines/zero/backward.py`) beside it with its excess "
                  "over the profiler's highest step.", ""]
    return lines


def _branches(fact: dict) -> tuple[int, int]:
    """``(the branch that frees first, the estimate)``: the same figure where the replay met no race."""
    worst = fact["predicted_peak"]
    return (fact.get("branches") or {}).get("freed first", worst), worst


def planned_truth_table(facts: list[dict]) -> list[str]:
    """The auto mode's planned runs (``<engine>_auto``) against the profiler, per rank and step."""
    lines = ["## Planned runs against the profiler, per rank", "",
             "| engine | rank | plan | budget (B) | profiler step peaks, reconciled (B) | raw (B) | MemWatch per step | "
             "plan's prediction vs profiler | profiler ≤ budget |",
             "|---|---|---|---|---|---|---|---|---|"]
    errors = []
    for engine in facts[0]["auto"]:
        for rank in (0, 1):
            run = facts[rank]["auto"][engine]
            truth = run.get("truth_step_peaks")
            if not truth:
                continue
            plan = run["plans"][-1]
            per_step = [m / t - 1 for m, t in zip(run["step_peaks"], truth)]
            errors.extend(abs(e) for e in per_step)
            # the plan's figure carries the planner's margin (planning/predict.py ESTIMATE_MARGIN)
            predicted = plan["predicted_peak"] / max(truth) - 1
            lines.append(f"| {engine} | {rank} | {plan['micro_batch_size']} x {plan['gradient_accumulation_steps']}, "
                         f"ckpt {plan['activation_checkpointing']}, {plan['optim']} | {run['budget']:,} | "
                         f"{', '.join(f'{t:,}' for t in truth)} | "
                         f"{', '.join(f'{t:,}' for t in run.get('truth_raw_step_peaks') or [])} | "
                         f"{', '.join(f'{100 * e:+.2f}%' for e in per_step)} | {100 * predicted:+.2f}% | "
                         f"{max(truth) <= run['budget']} |")
    if errors:
        lines += ["", f"MemWatch per step on the planned runs: median {100 * statistics.median(errors):.2f}%, "
                      f"worst {100 * max(errors):.2f}%", ""]
    return lines


def table(out: Path) -> str:
    facts = [json.loads((out / f"deepspeed.rank{rank}.json").read_text()) for rank in (0, 1)]
    lines = ["| engine | rank | predicted before train() (B) | measured step peak (B) | error | worst branch (B) |",
             "|---|---|---|---|---|---|"]
    errors = []
    for engine in ENGINES:
        for rank in (0, 1):
            (predicted, worst), measured = _branches(facts[rank][engine]), step_peak(out / engine, rank)
            error = predicted / measured - 1
            errors.append(abs(error))
            lines.append(f"| {facts[rank][engine]['engine']}, {facts[rank][engine]['seq_len']} tokens | {rank} | "
                         f"{predicted:,} | {measured:,} | {100 * error:+.2f}% | {worst:,} |")
    lines += ["", f"median |error| {100 * statistics.median(errors):.2f}%, worst {100 * max(errors):.2f}%", ""]
    lines = (truth_table(out, facts) + planned_truth_table(facts)
             + ["## Against MemWatch's step peak, per rank", ""] + lines)
    lines += [
              "| auto mode | rank | budget (x configured peak) | plan | predicted | measured step peaks | fits |",
              "|---|---|---|---|---|---|---|"]
    for engine, run in facts[0]["auto"].items():
        for rank in (0, 1):
            run = facts[rank]["auto"][engine]
            plan = run["plans"][-1]
            text = (f"{plan['micro_batch_size']} x {plan['gradient_accumulation_steps']}, "
                    f"ckpt {plan['activation_checkpointing']}, {plan['optim']}")
            peaks = ", ".join(f"{p:,}" for p in run["step_peaks"])
            lines.append(f"| {engine} | {rank} | {run['budget']:,} ({run['budget'] / run['configured_peak']:.2f} x) | {text} | {plan['predicted_peak']:,} | {peaks} | "
                         f"{max(run['step_peaks']) <= run['budget']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engines_accuracy.md"))
    parser.add_argument("--from", dest="source", default=None, help="a finished launch's OUT_DIR")
    args = parser.parse_args()
    if args.source:
        body = table(Path(args.source))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            launch(Path(tmp))
            body = table(Path(tmp))
    Path(args.out).write_text("# Engine-aware prediction per rank (2 CPU ranks, gloo, DeepSpeed 0.19.8)\n\n"
                              "`python benchmarks/engines_accuracy.py` (see its docstring for the setup).\n\n" + body + "\n")
    print(body)


if __name__ == "__main__":
    main()
