"""The pure half of ``benchmarks/gpu_check.py``: verdicts, the sweep's configurations, the results files.

No torch here: what is written, and how a check passes, can be read (and tested) on its own.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CHECK_NAMES = ("attribution", "prediction", "prevention", "overhead", "published")
# Share of the time budget each check may use (what one leaves goes to the next ones).
CHECK_SHARES = {"attribution": 0.12, "prediction": 0.58, "prevention": 0.18, "overhead": 0.12, "published": 0.2}
DEFAULT_BUDGET_S = 460.0
GOALS = {"prediction_median": 0.03, "prediction_worst": 0.08, "reserved_worst": 0.10, "overhead_ratio": 1.01,
         "step_peak_rel": 0.01, "plan_reserved_rel": 0.10}

# -- results ------------------------------------------------------------------------------------
@dataclass
class CheckResult:
    """One check's verdict: ``passed`` is None while it runs or when it could not run."""

    name: str
    passed: bool | None
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def relative_error(predicted: float, measured: float) -> float:
    """Signed relative error of a prediction.

    Example:
        >>> relative_error(103, 100)
        0.03
    """
    return (predicted - measured) / measured


def error_stats(errors: Sequence[float]) -> dict[str, float | int]:
    """Median and worst absolute relative error (and the worst's sign) of signed ``errors``.

    Example:
        >>> error_stats([0.01, -0.05, 0.02])
        {'n': 3, 'median': 0.02, 'worst': 0.05, 'worst_signed': -0.05}
    """
    if not errors:
        raise ValueError("no errors to summarise")
    worst_signed = max(errors, key=abs)
    return {
        "n": len(errors),
        "median": statistics.median(abs(e) for e in errors),
        "worst": abs(worst_signed),
        "worst_signed": worst_signed,
    }


def interleaved(
    measure_a: Callable[[], float], measure_b: Callable[[], float], rounds: int,
    keep_going: Callable[[], bool] = lambda: True,
) -> tuple[list[float], list[float]]:
    """Up to ``rounds`` measurements of each, alternating A B, B A, A B, ... so drifts hit both alike.

    ``keep_going`` is asked before every round after the first (the check's time budget).
    """
    a: list[float] = []
    b: list[float] = []
    for round_index in range(rounds):
        if round_index and not keep_going():
            break
        order = ((measure_a, a), (measure_b, b)) if round_index % 2 == 0 else ((measure_b, b), (measure_a, a))
        for measure, into in order:
            into.append(measure())
    return a, b


def overhead_ratio(without: Sequence[float], with_memwatch: Sequence[float]) -> float:
    """Ratio of median step times, with over without.

    Example:
        >>> round(overhead_ratio([1.0, 1.2, 1.1], [1.1, 1.2, 1.15]), 4)
        1.0455
    """
    return statistics.median(with_memwatch) / statistics.median(without)


def attribution_verdict(snapshots: list[dict[str, Any]], reads: list[dict[str, Any]]) -> dict[str, Any]:
    """Compare MemWatch's snapshots with the device read at the same instants.

    ``reads``: ``{"phase", "step", "allocated", "peak"}`` taken just before each snapshot (the reader
    runs first, so its ``peak`` covers the same window MemWatch's does). Returns the mismatches and
    the per-step peaks both ways.
    """
    mismatches: list[str] = []
    if [(s["step"], s["phase"]) for s in snapshots] != [(r["step"], r["phase"]) for r in reads]:
        mismatches.append(f"{len(snapshots)} snapshots vs {len(reads)} reads at different phases")
        return {"mismatches": mismatches, "snapshots": len(snapshots)}
    for snap, read in zip(snapshots, reads):
        live_sum = sum(snap["live"].values())
        if not (live_sum == snap["allocated"] == read["allocated"]):
            mismatches.append(
                f"step {snap['step']} {snap['phase']}: classes sum {live_sum}, allocated {snap['allocated']}, "
                f"memory_allocated() {read['allocated']}"
            )
    ours: dict[int, int] = {}
    allocator: dict[int, int] = {}
    for snap, read in zip(snapshots, reads):
        ours[snap["step"]] = max(ours.get(snap["step"], 0), snap["peak"])
        allocator[snap["step"]] = max(allocator.get(snap["step"], 0), read["peak"])
    for step in ours:
        if ours[step] != allocator[step]:
            mismatches.append(f"step {step}: MemWatch peak {ours[step]}, max_memory_allocated {allocator[step]}")
    return {"mismatches": mismatches, "snapshots": len(snapshots), "step_peaks": ours, "allocator_step_peaks": allocator}


def prevention_verdict(run: dict[str, Any], allowed: int, predicted: int | None,
                       tolerance: float = GOALS["plan_reserved_rel"]) -> tuple[bool, str]:
    """Pass when the run finished with 0 OOM, and its measured peak (reserved on CUDA) is within
    ``tolerance`` of the auto plan's prediction and inside ``allowed``.

    Example:
        >>> prevention_verdict({"completed": True, "num_ooms": 0, "measured": 95}, allowed=100, predicted=100)[0]
        True
        >>> prevention_verdict({"completed": True, "num_ooms": 0, "measured": 80}, allowed=100, predicted=100)[1]
        'the plan predicted 100 but 80 was measured (+25.00%, tolerance 10%)'
    """
    if not run.get("completed"):
        return False, f"did not complete: {run.get('error', 'unknown error')}"
    if run.get("num_ooms"):
        return False, f"{run['num_ooms']} OOM(s) counted by the allocator"
    measured = run.get("measured")
    if predicted is None or not measured:
        return False, "no prediction or no measured peak to compare"
    error = relative_error(predicted, measured)
    if abs(error) > tolerance:
        return False, f"the plan predicted {predicted} but {measured} was measured ({error:+.2%}, tolerance {tolerance:.0%})"
    if measured > allowed:
        return False, f"measured {measured} above the allowed {allowed}"
    return True, f"completed, 0 OOM, measured {measured} = plan's {predicted} {error:+.2%}, <= allowed {allowed}"


# -- writing ------------------------------------------------------------------------------------
def _mib(value: Any) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f} MiB"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:+.2f}%"


def verdict_word(result: CheckResult) -> str:
    if result.passed is None:
        return "RUNNING" if result.summary.startswith("running") else "NOT RUN"
    return "pass" if result.passed else "FAIL"


PREDICTION_HEADER = (
    "| architecture | batch x seq | ckpt | optim | predicted | max allocated | error | predicted reserved "
    "| max reserved | error | predicted device | device used | error |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
)


PUBLISHED_HEADER = (
    "| published case | source | batch x seq | autocast | predicted | max allocated | error | predicted reserved "
    "| max reserved | error | predicted device | device used | error |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
)


def markdown_report(results: Sequence[CheckResult], environment: dict[str, Any],
                    skipped: Sequence[dict[str, str]] = ()) -> str:
    """The short Markdown table: one line per check, then the prediction table when there is one."""
    lines = ["# hf-memwatch GPU check", "", " · ".join(f"{k}: {v}" for k, v in environment.items()), "",
             "| check | result | summary | seconds |", "|---|---|---|---|"]
    for result in results:
        lines.append(f"| {result.name} | {verdict_word(result)} | {result.summary} | {result.seconds:.0f} |")
    for result in results:
        rows = result.details.get("configurations") if result.name == "prediction" else None
        if rows:
            lines += ["", *PREDICTION_HEADER]
            for row in rows:
                lines.append(
                    f"| {row['arch']} | {row['batch']} x {row['seq_len']} | {row['checkpointing']} | {row['optim']} "
                    f"| {_mib(row.get('predicted'))} | {_mib(row.get('max_allocated'))} "
                    f"| {_pct(row.get('error_allocated'))} | {_mib(row.get('predicted_reserved'))} "
                    f"| {_mib(row.get('max_reserved'))} | {_pct(row.get('error_reserved'))} "
                    f"| {_mib(row.get('predicted_device'))} | {_mib(row.get('device_used'))} "
                    f"| {_pct(row.get('error_device'))} |"
                )
    for result in results:
        cases = result.details.get("cases") if result.name == "published" else None
        if cases:
            lines += ["", *PUBLISHED_HEADER]
            for row in cases:
                if "error" in row:
                    lines.append(f"| {row['case']} | failed: {row['error']} |" + " |" * 11)
                    continue
                lines.append(
                    f"| {row['case']} | {row['source']} | {row['batch']} x {row['seq']} | {row['precision']} "
                    f"| {_mib(row.get('predicted'))} | {_mib(row.get('max_allocated'))} "
                    f"| {_pct(row.get('error_allocated'))} | {_mib(row.get('predicted_reserved'))} "
                    f"| {_mib(row.get('max_reserved'))} | {_pct(row.get('error_reserved'))} "
                    f"| {_mib(row.get('predicted_device'))} | {_mib(row.get('device_used'))} "
                    f"| {_pct(row.get('error_device'))} |"
                )
    if skipped:
        lines += ["", "Skipped (needs CUDA, or out of time):", ""]
        lines += [f"- {s['check']}: {s['what']} — {s['why']}" for s in skipped]
    return "\n".join(lines) + "\n"


def atomic_write(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` in one step: a reader (or a kill) sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_results(out_dir: Path, results: Sequence[CheckResult], environment: dict[str, Any],
                  skipped: Sequence[dict[str, str]] = (), status: str = "finished") -> tuple[Path, Path]:
    """Write ``gpu_check.json`` and ``gpu_check.md`` atomically; returns their paths.

    ``passed`` is None while ``status`` is ``"running"``; at the end, True when every check passed.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "status": status,
        "environment": environment,
        "passed": None if status == "running" else all(r.passed for r in results),
        "checks": [asdict(r) for r in results],
        "skipped": list(skipped),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    json_path = out_dir / "gpu_check.json"
    atomic_write(json_path, json.dumps(payload, indent=2, default=str) + "\n")
    md_path = out_dir / "gpu_check.md"
    atomic_write(md_path, markdown_report(results, environment, skipped))
    return json_path, md_path


class ResultsFile:
    """The results as they come: every :meth:`publish` rewrites both files (atomically)."""

    def __init__(self, out_dir: Path, environment: dict[str, Any]) -> None:
        self.out_dir = out_dir
        self.environment = environment
        self.results: dict[str, CheckResult] = {}
        self.skipped: list[dict[str, str]] = []
        self.status = "running"
        self.paths = write_results(out_dir, [], environment, status=self.status)

    def publish(self, result: CheckResult | None = None) -> None:
        if result is not None:
            self.results[result.name] = result
        self.paths = write_results(self.out_dir, list(self.results.values()), self.environment, self.skipped,
                                   self.status)

    def skip(self, check: str, what: str, why: str) -> None:
        self.skipped.append({"check": check, "what": what, "why": why})


@dataclass(frozen=True)
class Config:
    """One prediction configuration."""

    arch: str  # llama-1b | qwen3-1.7b | gpt2 | bert | llama
    batch: int
    seq_len: int
    checkpointing: bool
    optim: str
    precision: str = "bf16"
    qlora: bool = False


# Ordered so the most informative finish first: the >= 1B shapes, both optimizers, both checkpointing
# settings, 2k-8k tokens, QLoRA; then the small architectures the CPU benchmarks know.
FULL_SWEEP = (
    Config("llama-1b", 1, 4096, False, "adamw_torch_fused"),
    Config("qwen3-1.7b", 1, 4096, True, "adamw_bnb_8bit"),
    Config("llama-1b", 1, 8192, True, "adamw_bnb_8bit"),
    Config("qwen3-1.7b", 2, 2048, False, "adamw_torch_fused"),
    Config("llama-1b", 1, 4096, True, "adamw_torch_fused", qlora=True),
    Config("qwen3-1.7b", 1, 8192, True, "adamw_torch_fused"),
    Config("llama-1b", 2, 2048, False, "adamw_bnb_8bit"),
    Config("qwen3-1.7b", 1, 2048, False, "adamw_bnb_8bit"),
    Config("llama-1b", 4, 2048, True, "adamw_torch_fused"),
    Config("gpt2", 8, 512, False, "adamw_torch"),
    Config("bert", 16, 256, True, "adamw_bnb_8bit"),
    Config("llama", 4, 1024, True, "adamw_torch"),
)


def configurations(quick: bool = False) -> list[Config]:
    """The prediction sweep; ``quick``: the same list at tiny shapes (the dry run).

    Example:
        >>> [c.arch for c in configurations()][:2], {c.seq_len for c in configurations(quick=True)}
        (['llama-1b', 'qwen3-1.7b'], {32})
    """
    if quick:
        return [Config(c.arch, 2, 32, c.checkpointing, c.optim, c.precision, c.qlora) for c in FULL_SWEEP]
    return list(FULL_SWEEP)


