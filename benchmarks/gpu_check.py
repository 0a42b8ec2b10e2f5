"""GPU truth: one command that checks every CUDA claim of hf-memwatch on a real GPU (issues 8 and 23).

    python benchmarks/gpu_check.py --out benchmarks/results/gpu                 # make gpu-check
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/dry          # the dry run (make test)

Five checks, on real ``Trainer`` runs of models built from configs (random weights, no hub):

* **attribution** — the five live classes sum to the device's allocated bytes at every snapshot,
  read by a callback at the same instants on the module MemWatch hooks; each step's peak equals the
  device's peak over that step, and an unmonitored twin run (peaks reset the same way: at every step
  begin) agrees within 1%.
* **prediction** — ``estimate(..., device=...)`` against the measured peaks: allocated
  (``max_memory_allocated``), reserved (``max_memory_reserved``, the caching allocator replayed by
  :mod:`hf_memwatch.estimation.cuda_allocator`) and the device's used memory (``mem_get_info``, the
  estimate's ``device_bytes``). >= 1B-parameter shapes first (a Llama-3.2-1B-like and a
  Qwen3-1.7B-like config at 2k-8k tokens, bf16, SDPA, fused AdamW and 8-bit AdamW, with and without
  checkpointing, one QLoRA case), then smaller ones. Goals: allocated median |error| <= 3 %, worst
  <= 8 %; reserved worst <= 10 %.
* **prevention** — a limit below what the configured batch needs (CUDA:
  ``set_per_process_memory_fraction``): ``MemWatch(auto=True)`` must finish with 0 OOM, and the auto
  plan's predicted reserved bytes must match the measured ``max_memory_reserved`` within 10 % and
  stay inside the limit. The Trainer's ``auto_find_batch_size`` is reported for comparison.
* **overhead** — steady-state seconds per step with ``MemWatch(report=False)`` vs without, runs
  interleaved, ratio of medians (no background picture process during timing). Goal <= 1.01.

* **published** — three configurations of ``benchmarks/cuda_published.py``'s published GPU measurements
  (bert-large fp16 AMP through the Trainer, bert-base fp16 SDPA forward + backward, Mistral-7B LoRA with
  checkpointing), scaled to the card, run and estimated for it (:mod:`gpu_check_published`); the
  prediction check's goals.

``--device cpu`` runs the same checks through the same code — same Trainer runs, same comparisons —
with the CPU backend's figures (a :class:`~hf_memwatch.measure.tracker.StorageTracker` over the run)
in place of the allocator's; what only CUDA has (reserved bytes, ``mem_get_info``, ``num_ooms``, the
per-process fraction, ``auto_find_batch_size``'s OOM retries) is skipped and listed in the JSON's
``skipped``. ``--quick`` replaces every shape by a tiny one.

Results as they come: ``gpu_check.json`` and ``gpu_check.md`` in ``--out`` are rewritten atomically
(temporary file + ``os.replace``) after every check and every configuration of the prediction sweep,
so a run killed at any moment leaves valid JSON of what finished (``status: "running"`` until the
end). Each check gets a share of ``--time-budget-s`` (default 460 s, under 9 minutes with start-up)
and bounds itself by it: configurations or rounds that would not fit are dropped and listed. Exit 1
when a check fails. With ``--device cuda`` on a machine without CUDA: one line, exit 0.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, also when loaded by path

from gpu_check_report import CHECK_NAMES, DEFAULT_BUDGET_S  # noqa: E402 - no torch: read before it

NO_CUDA_MESSAGE = ("gpu-check: no CUDA device here (torch.cuda.is_available() is False); no check was run "
                   "(the CPU dry run: --device cpu --quick).")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (standard library only: it is read before anything heavy is imported)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--checks", default=",".join(CHECK_NAMES),
                        help=f"comma-separated subset of {', '.join(CHECK_NAMES)}")
    parser.add_argument("--time-budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"total seconds for the checks, each bounded by its share (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default) or cpu: the dry run, the CPU backend's figures for the allocator's")
    parser.add_argument("--quick", action="store_true", help="tiny shapes everywhere (the dry run)")
    args = parser.parse_args(argv)
    args.checks = [n.strip() for n in args.checks.split(",") if n.strip()]
    unknown = [n for n in args.checks if n not in CHECK_NAMES]
    if unknown:
        parser.error(f"unknown check(s): {', '.join(unknown)}")
    return args


def exit_if_no_cuda(argv: Sequence[str] | None) -> None:
    """CUDA asked for and absent: validate the command line, say so in one line, exit 0 (CPU CI)."""
    args = parse_args(argv)
    if args.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        sys.exit(0)


if __name__ == "__main__":  # before transformers is imported: a CPU machine answers at once
    exit_if_no_cuda(sys.argv[1:])

import torch  # noqa: E402
import transformers  # noqa: E402
from gpu_check_checks import (  # noqa: E402, F401 - re-exported: the script's API in one module
    CHECKS,
    check_attribution,
    check_overhead,
    check_prediction,
    check_prevention,
    check_published,
    measure_peak,
    prediction_result,
)
from gpu_check_probe import (  # noqa: E402, F401
    CPU_BLIND,
    CUDA_ONLY,
    Context,
    CpuProbe,
    CudaProbe,
    Probe,
    RunTracker,
    check_deadline,
)
from gpu_check_report import (  # noqa: E402, F401
    GOALS,
    CheckResult,
    Config,
    ResultsFile,
    attribution_verdict,
    configurations,
    error_stats,
    interleaved,
    overhead_ratio,
    prevention_verdict,
    relative_error,
    verdict_word,
    write_results,
)
from gpu_check_runs import build_model, model_config, timed_run, training_args  # noqa: E402, F401


def environment(probe: Probe, quick: bool) -> dict[str, Any]:
    info: dict[str, Any] = {"device": probe.kind, "quick": quick, "torch": torch.__version__,
                            "transformers": transformers.__version__, "python": platform.python_version()}
    from hf_memwatch.compat import versions

    below = versions.unsupported({name: versions.installed(name) for name in versions.VERIFIED})
    if below:  # run with HF_MEMWATCH_UNVERIFIED=1 (the lent machines' torch 2.11): said in every results file
        info["unverified"] = "; ".join(below)
    if probe.kind == "cuda":
        props = torch.cuda.get_device_properties(probe.device)
        info.update(gpu=props.name, gpu_memory=f"{props.total_memory / 2**30:.0f} GiB", cuda=torch.version.cuda)
    return info


def make_probe(device: str) -> Probe:
    if device == "cuda":
        return CudaProbe(torch.device("cuda", torch.cuda.current_device()))
    return CpuProbe(torch.device("cpu"))


def run_checks(names: Sequence[str], time_budget_s: float, workdir: str, results: ResultsFile, probe: Probe,
               quick: bool) -> list[CheckResult]:
    """Run the named checks in order, each within its share of the budget; results published as they come."""
    started = time.perf_counter()
    for name in names:
        results.publish(CheckResult(name, None, "not run yet"))
    for index, name in enumerate(names):
        deadline = check_deadline(started, time_budget_s, name, names[index:])
        ctx = Context(probe, workdir, quick, deadline, results)
        if ctx.left() <= 0:
            results.publish(CheckResult(name, None, f"not run: the {time_budget_s:.0f} s budget was spent"))
            continue
        results.publish(CheckResult(name, None, "running"))
        check_started = time.perf_counter()
        try:
            result = CHECKS[name](ctx)
        except Exception as exc:  # noqa: BLE001 - a crashed check is a failed check, the others still run
            result = CheckResult(name, False, f"crashed: {type(exc).__name__}: {exc}",
                                 {"traceback": traceback.format_exc()})
            probe.free()
        result.seconds = time.perf_counter() - check_started
        print(f"gpu-check: {name}: {verdict_word(result)} - {result.summary}", flush=True)
        results.publish(result)
    return list(results.results.values())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    probe = make_probe(args.device)
    results = ResultsFile(args.out, environment(probe, args.quick))
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        checks = run_checks(args.checks, args.time_budget_s, workdir, results, probe, args.quick)
    results.status = "finished"
    results.publish()
    json_path, md_path = results.paths
    print(f"gpu-check: wrote {json_path} and {md_path}")
    return 0 if all(r.passed for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
