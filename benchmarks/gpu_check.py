"""GPU truth: one command that checks every CUDA claim of hf-memwatch on a real GPU (issue 8).

    python benchmarks/gpu_check.py --out benchmarks/results/gpu        # make gpu-check

Four checks, on real ``Trainer`` runs of models built from configs (random weights, no hub):

* **attribution** — the five live classes sum to ``torch.cuda.memory_allocated()`` at every snapshot,
  read by a callback at the same instants; each step's peak equals ``max_memory_allocated`` over
  that step (read at the same instants, and from an unmonitored twin run reset at every step).
* **prediction** — ``hf_memwatch.estimation.estimate(..., device="cuda")`` against the measured peak
  (``max_memory_allocated`` and ``max_memory_reserved``), 12 configurations: 3 architectures ×
  checkpointing on/off × AdamW / 8-bit AdamW, bf16, one batch/sequence per architecture. Goal: median
  |error| <= 3 %, worst <= 8 % against allocated; reserved is reported.
* **prevention** — ``torch.cuda.set_per_process_memory_fraction`` so that the configured batch does
  not fit: ``MemWatch(auto=True)`` must finish with zero OOM and a peak inside the fraction; the
  Trainer's ``auto_find_batch_size`` on the same setup is reported for comparison.
* **overhead** — steady-state seconds per step with ``MemWatch()`` (default settings) vs without,
  runs interleaved, ratio of medians. Goal <= 1.01.

Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out`` and exits 1 when a check fails. On a
machine without CUDA it says so in one line and exits 0 without running anything.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NO_CUDA_MESSAGE = "gpu-check: no CUDA device here (torch.cuda.is_available() is False); no check was run."
CHECK_NAMES = ("attribution", "prediction", "prevention", "overhead")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (standard library only: it is read before anything heavy is imported)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--checks", default=",".join(CHECK_NAMES),
                        help=f"comma-separated subset of {', '.join(CHECK_NAMES)}")
    parser.add_argument("--time-budget-s", type=float, default=450.0,
                        help="checks not started by then are reported as not run (default 450)")
    args = parser.parse_args(argv)
    args.checks = [n.strip() for n in args.checks.split(",") if n.strip()]
    unknown = [n for n in args.checks if n not in CHECK_NAMES]
    if unknown:
        parser.error(f"unknown check(s): {', '.join(unknown)}")
    return args


def exit_if_no_cuda(argv: Sequence[str] | None) -> None:
    """Without CUDA: validate the command line, say so in one line, exit 0 (CPU machines, CI)."""
    parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        sys.exit(0)


if __name__ == "__main__":  # before transformers is imported: a CPU machine answers at once
    exit_if_no_cuda(sys.argv[1:])

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from hf_memwatch import MemWatch  # noqa: E402
from hf_memwatch.core.timeline import read_timeline  # noqa: E402
from hf_memwatch.estimation.estimate import estimate  # noqa: E402

GOALS = {"prediction_median": 0.03, "prediction_worst": 0.08, "overhead_ratio": 1.01, "step_peak_rel": 0.01}
PHASE_EVENTS = ("step_begin", "after_forward", "after_backward", "after_optimizer", "step_end")


# -- results ------------------------------------------------------------------------------------
@dataclass
class CheckResult:
    """One check's verdict: ``passed`` is None when it could not run (counted as a failure)."""

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
    measure_a: Callable[[], float], measure_b: Callable[[], float], rounds: int
) -> tuple[list[float], list[float]]:
    """``rounds`` measurements of each, alternating A B, B A, A B, ... so drifts hit both alike."""
    a: list[float] = []
    b: list[float] = []
    for round_index in range(rounds):
        order = ((measure_a, a), (measure_b, b)) if round_index % 2 == 0 else ((measure_b, b), (measure_a, a))
        for measure, into in order:
            into.append(measure())
    return a, b


def overhead_ratio(without: Sequence[float], with_memwatch: Sequence[float]) -> float:
    """Ratio of median step times, with over without.

    Example:
        >>> overhead_ratio([1.0, 1.2, 1.1], [1.1, 1.2, 1.15])
        1.0454545454545454
    """
    return statistics.median(with_memwatch) / statistics.median(without)


def attribution_verdict(snapshots: list[dict[str, Any]], reads: list[dict[str, Any]]) -> dict[str, Any]:
    """Compare MemWatch's snapshots with the allocator read at the same instants.

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


def prevention_verdict(run: dict[str, Any], allowed: int) -> tuple[bool, str]:
    """Pass when the run finished, the allocator counted no OOM and the peak stayed inside ``allowed``."""
    if not run.get("completed"):
        return False, f"did not complete: {run.get('error', 'unknown error')}"
    if run.get("num_ooms", 0) != 0:
        return False, f"{run['num_ooms']} OOM(s) counted by the allocator"
    if run.get("max_reserved", 0) > allowed:
        return False, f"peak reserved {run['max_reserved']} above the allowed {allowed}"
    return True, f"completed, 0 OOM, peak reserved {run['max_reserved']} <= allowed {allowed}"


# -- writing ------------------------------------------------------------------------------------
def _mib(value: Any) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f} MiB"


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:+.2f}%"


def markdown_report(results: Sequence[CheckResult], environment: dict[str, Any]) -> str:
    """The short Markdown table: one line per check, then the prediction table when there is one."""
    lines = [
        "# hf-memwatch GPU check",
        "",
        " · ".join(f"{k}: {v}" for k, v in environment.items()),
        "",
        "| check | result | summary | seconds |",
        "|---|---|---|---|",
    ]
    for result in results:
        verdict = "pass" if result.passed else ("FAIL" if result.passed is False else "NOT RUN")
        lines.append(f"| {result.name} | {verdict} | {result.summary} | {result.seconds:.0f} |")
    for result in results:
        rows = result.details.get("configurations") if result.name == "prediction" else None
        if rows:
            lines += [
                "",
                "| architecture | batch x seq | checkpointing | optim | predicted | max allocated | error "
                "| max reserved | error |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for row in rows:
                lines.append(
                    f"| {row['arch']} | {row['batch']} x {row['seq_len']} | {row['checkpointing']} | {row['optim']} "
                    f"| {_mib(row.get('predicted'))} | {_mib(row.get('max_allocated'))} "
                    f"| {_pct(row.get('error_allocated'))} | {_mib(row.get('max_reserved'))} "
                    f"| {_pct(row.get('error_reserved'))} |"
                )
    return "\n".join(lines) + "\n"


def write_results(out_dir: Path, results: Sequence[CheckResult], environment: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``gpu_check.json`` and ``gpu_check.md``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "environment": environment,
        "passed": all(r.passed for r in results),
        "checks": [asdict(r) for r in results],
    }
    json_path = out_dir / "gpu_check.json"
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    md_path = out_dir / "gpu_check.md"
    md_path.write_text(markdown_report(results, environment))
    return json_path, md_path


# -- models and runs ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """One prediction configuration."""

    arch: str  # gpt2 | bert | llama
    batch: int
    seq_len: int
    checkpointing: bool
    optim: str
    precision: str = "bf16"


ARCH_SHAPES = {  # arch -> (batch, sequence length) at full scale
    "gpt2": (8, 512),
    "bert": (16, 256),
    "llama": (4, 1024),
}


def configurations() -> list[Config]:
    """3 architectures x checkpointing on/off x AdamW / 8-bit AdamW, bf16: 12 configurations."""
    return [
        Config(arch, batch, seq_len, checkpointing, optim)
        for arch, (batch, seq_len) in ARCH_SHAPES.items()
        for checkpointing in (False, True)
        for optim in ("adamw_torch", "adamw_bnb_8bit")
    ]


def build_model(arch: str, tiny: bool = False) -> Any:
    """A model of ``arch`` from a config with random weights; ``tiny`` for CPU tests."""
    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2 if tiny else 12, n_embd=64 if tiny else 768, n_head=4 if tiny else 12,
                               vocab_size=1000 if tiny else 50257, n_positions=1024)
        return transformers.GPT2LMHeadModel(config)
    if arch == "bert":
        hidden = 64 if tiny else 768
        config = transformers.BertConfig(vocab_size=1000 if tiny else 30522, hidden_size=hidden,
                               num_hidden_layers=2 if tiny else 12, num_attention_heads=4 if tiny else 12,
                               intermediate_size=4 * hidden, max_position_embeddings=512, num_labels=2)
        return transformers.BertForSequenceClassification(config)
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=1000 if tiny else 32000, hidden_size=64 if tiny else 1024,
                                intermediate_size=172 if tiny else 2816, num_hidden_layers=2 if tiny else 8,
                                num_attention_heads=4 if tiny else 16, num_key_value_heads=2 if tiny else 8,
                                max_position_embeddings=2048)
        return transformers.LlamaForCausalLM(config)
    raise ValueError(f"unknown architecture {arch!r}")


class TokenDataset:
    """Random token sequences: LM labels copy the inputs, classification draws a class."""

    def __init__(self, n: int, seq_len: int, vocab: int, classification: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=gen)
        self.labels = torch.randint(0, 2, (n,), generator=gen) if classification else self.ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def dataset_for(model: Any, batch: int, seq_len: int, steps: int) -> TokenDataset:
    classification = type(model).__name__.endswith("ForSequenceClassification")
    return TokenDataset(batch * steps, seq_len, model.config.vocab_size, classification)


def training_args(output_dir: str, *, batch: int, steps: int, device: str, **overrides: Any) -> Any:
    """``TrainingArguments`` of every run here: no saving, no reporting, quiet."""
    values: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=batch, max_steps=steps, logging_steps=10_000,
        report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
        use_cpu=device == "cpu",
    )
    checkpointing = overrides.pop("checkpointing", False)
    fields = TrainingArguments.__dataclass_fields__
    values["activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"] = checkpointing
    values.update(overrides)
    return TrainingArguments(**values)


def free_device_memory() -> None:
    """Drop what earlier runs left in the caching allocator, so each run starts alike."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class StepClock(TrainerCallback):
    """Steady-state seconds per step: the time from step ``warmup``'s end to the last step's end.

    Synchronizes the device only at those two instants, so the steps in between run as in
    production (asynchronously) and per-step host costs show only where they cost time.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.end: float | None = None
        self.steps = 0

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.warmup:
            self.start = self._now()
        elif state.global_step > self.warmup:
            self.end = self._now()
            self.steps = state.global_step - self.warmup

    def seconds_per_step(self) -> float:
        if self.start is None or self.end is None or self.steps < 1:
            raise RuntimeError("the run was shorter than the warm-up")
        return (self.end - self.start) / self.steps


def timed_run(arch: str, *, batch: int, seq_len: int, steps: int, warmup: int, device: str,
              memwatch: bool, tiny: bool = False, workdir: str | None = None) -> float:
    """Seconds per steady-state step of one Trainer run, with or without ``MemWatch()``."""
    model = build_model(arch, tiny=tiny)
    clock = StepClock(warmup)
    callbacks = [clock] + ([MemWatch()] if memwatch else [])
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        args = training_args(tmp, batch=batch, steps=steps, device=device, bf16=device == "cuda")
        trainer = Trainer(model=model, args=args, train_dataset=dataset_for(model, batch, seq_len, steps),
                          callbacks=callbacks)
        trainer.train()
        seconds = clock.seconds_per_step()
    del trainer, model
    free_device_memory()
    return seconds


# -- the CUDA checks ----------------------------------------------------------------------------
class AllocatorReader(TrainerCallback):
    """Reads ``memory_allocated``/``max_memory_allocated`` at MemWatch's instants, just before it.

    Placed before ``MemWatch`` in the callback list (so its handlers, and its forward hook registered
    at train begin, run first), the peak it reads covers the same window MemWatch's snapshot does.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reads: list[dict[str, Any]] = []
        self.step = 0
        self.in_step = False

    def _read(self, phase: str) -> None:
        self.reads.append({"step": self.step, "phase": phase,
                           "allocated": torch.cuda.memory_allocated(self.device),
                           "peak": torch.cuda.max_memory_allocated(self.device)})

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        model.register_forward_hook(self._after_forward)

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        if self.in_step and torch.is_grad_enabled():
            self._read("after_forward")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step, self.in_step = state.global_step + 1, True
        self._read("step_begin")

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._read("after_backward")

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._read("after_backward")

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._read("after_optimizer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._read("step_end")
        self.in_step = False


class StepPeaks(TrainerCallback):
    """The allocator's own step peak without MemWatch: reset at every step begin, read at step end."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peaks: list[int] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.peaks.append(torch.cuda.max_memory_allocated(self.device))


class PeakFromTrainBegin(TrainerCallback):
    """Resets the allocator's peaks once the model is placed and the optimizer built."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)


def check_attribution(device: Any, workdir: str) -> CheckResult:
    """Classes sum to memory_allocated at every snapshot; step peaks equal max_memory_allocated."""
    arch, batch, seq_len, steps = "gpt2", 8, 512, 4
    details: dict[str, Any] = {"arch": arch, "batch": batch, "seq_len": seq_len, "steps": steps,
                               "gradient_accumulation_steps": 2}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        model = build_model(arch)
        reader = AllocatorReader(device)
        args = training_args(tmp, batch=batch, steps=steps, device="cuda", bf16=True, gradient_accumulation_steps=2)
        trainer = Trainer(model=model, args=args, train_dataset=dataset_for(model, batch, seq_len, 2 * steps),
                          callbacks=[reader, MemWatch(detail="full", report=False, summary=False)])
        trainer.train()
        records = list(read_timeline(Path(tmp) / "memwatch" / "timeline.jsonl"))
        del trainer, model
        free_device_memory()
        snapshots = [r for r in records if r["event"] == "snapshot"]
        verdict = attribution_verdict(snapshots, reader.reads)
        # An unmonitored twin: the allocator's own per-step peak, reset at every step begin.
        model = build_model(arch)
        reference = StepPeaks(device)
        args = training_args(tmp + "/twin", batch=batch, steps=steps, device="cuda", bf16=True,
                             gradient_accumulation_steps=2)
        trainer = Trainer(model=model, args=args, train_dataset=dataset_for(model, batch, seq_len, 2 * steps),
                          callbacks=[reference])
        trainer.train()
        del trainer, model
        free_device_memory()
    ours = [r["peak"] for r in records if r["event"] == "step"]
    twin_errors = [relative_error(a, b) for a, b in zip(ours, reference.peaks)]
    details.update(verdict, memwatch_step_peaks=ours, unmonitored_step_peaks=reference.peaks,
                   unmonitored_errors=twin_errors)
    problems = list(verdict["mismatches"])
    if len(ours) != len(reference.peaks) or any(abs(e) > GOALS["step_peak_rel"] for e in twin_errors):
        problems.append(f"step peaks {ours} vs unmonitored twin {reference.peaks}")
    summary = (f"{verdict['snapshots']} snapshots: classes sum to memory_allocated() and step peaks equal "
               f"max_memory_allocated; unmonitored twin within {max(map(abs, twin_errors), default=0):.2%}")
    if problems:
        summary = f"{len(problems)} mismatch(es): " + "; ".join(problems[:3])
    return CheckResult("attribution", not problems, summary, details)


def measure_peak(config: Config, device: Any, workdir: str) -> dict[str, Any]:
    """Estimate, then train 3 steps and read the allocator's peaks (reset once the model is placed)."""
    row: dict[str, Any] = asdict(config)
    model = build_model(config.arch)
    row["predicted"] = estimate(model, batch_size=config.batch, seq_len=config.seq_len, precision=config.precision,
                                optim=config.optim, checkpointing=config.checkpointing, device="cuda").peak_bytes
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        args = training_args(tmp, batch=config.batch, steps=3, device="cuda", bf16=config.precision == "bf16",
                             fp16=config.precision == "fp16", optim=config.optim, checkpointing=config.checkpointing)
        trainer = Trainer(model=model, args=args, train_dataset=dataset_for(model, config.batch, config.seq_len, 3),
                          callbacks=[PeakFromTrainBegin(device)])
        trainer.train()
        torch.cuda.synchronize(device)
        row["max_allocated"] = torch.cuda.max_memory_allocated(device)
        row["max_reserved"] = torch.cuda.max_memory_reserved(device)
        del trainer
    del model
    free_device_memory()
    row["error_allocated"] = relative_error(row["predicted"], row["max_allocated"])
    row["error_reserved"] = relative_error(row["predicted"], row["max_reserved"])
    return row


def check_prediction(device: Any, workdir: str) -> CheckResult:
    """The estimator against 12 measured configurations."""
    rows: list[dict[str, Any]] = []
    for config in configurations():
        try:
            rows.append(measure_peak(config, device, workdir))
        except Exception as exc:  # noqa: BLE001 - one configuration failing is reported, the rest still run
            rows.append({**asdict(config), "error": f"{type(exc).__name__}: {exc}"})
            free_device_memory()
    measured = [r for r in rows if "error_allocated" in r]
    failed = [r for r in rows if "error" in r]
    if not measured:
        return CheckResult("prediction", False, "no configuration could be measured", {"configurations": rows})
    allocated = error_stats([r["error_allocated"] for r in measured])
    reserved = error_stats([r["error_reserved"] for r in measured])
    passed = (not failed and len(measured) >= 12 and allocated["median"] <= GOALS["prediction_median"]
              and allocated["worst"] <= GOALS["prediction_worst"])
    summary = (f"{len(measured)} configurations; vs allocated: median {allocated['median']:.2%}, worst "
               f"{allocated['worst_signed']:+.2%}; vs reserved: median {reserved['median']:.2%}, worst "
               f"{reserved['worst_signed']:+.2%}" + (f"; {len(failed)} failed to run" if failed else ""))
    return CheckResult("prediction", passed, summary,
                       {"configurations": rows, "allocated": allocated, "reserved": reserved})


def _guarded_run(run: Callable[[], Any], device: Any) -> dict[str, Any]:
    """Run a training, recording completion, allocator OOMs and peaks (never raising)."""
    free_device_memory()
    torch.cuda.reset_peak_memory_stats(device)
    ooms_before = torch.cuda.memory_stats(device).get("num_ooms", 0)
    started = time.perf_counter()
    outcome: dict[str, Any] = {}
    try:
        outcome.update(run() or {})
        outcome["completed"] = True
    except Exception as exc:  # noqa: BLE001 - the verdict records it
        outcome.update(completed=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    outcome["seconds"] = time.perf_counter() - started
    outcome["num_ooms"] = torch.cuda.memory_stats(device).get("num_ooms", 0) - ooms_before
    # A MemWatch run resets the peaks at every snapshot; it reports the peaks its snapshots saw.
    outcome["max_allocated"] = max(torch.cuda.max_memory_allocated(device), outcome.get("peak_allocated_seen", 0))
    outcome["max_reserved"] = max(torch.cuda.max_memory_reserved(device), outcome.get("peak_reserved_seen", 0))
    free_device_memory()
    return outcome


def check_prevention(device: Any, workdir: str) -> CheckResult:
    """A per-process fraction below the configured batch's need: auto mode vs auto_find_batch_size."""
    arch, batch, seq_len, steps = "gpt2", 32, 1024, 4
    total = torch.cuda.get_device_properties(device).total_memory
    predicted = estimate(build_model(arch), batch_size=batch, seq_len=seq_len, precision="bf16",
                         device="cuda").peak_bytes
    fraction = min(1.0, 0.5 * predicted / total)  # half of what the configured batch needs
    allowed = int(fraction * total)
    details: dict[str, Any] = {"arch": arch, "batch": batch, "seq_len": seq_len, "predicted_configured": predicted,
                               "fraction": fraction, "allowed": allowed}

    def train(callbacks: list[Any], **overrides: Any) -> Callable[[], dict[str, Any]]:
        def run() -> dict[str, Any]:
            model = build_model(arch)
            with tempfile.TemporaryDirectory(dir=workdir) as tmp:
                args = training_args(tmp, batch=batch, steps=steps, device="cuda", bf16=True, **overrides)
                trainer = Trainer(model=model, args=args, train_dataset=dataset_for(model, batch, seq_len, 4 * steps),
                                  callbacks=callbacks)
                trainer.train()
                result = {"final_micro_batch": trainer._train_batch_size,
                          "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
                          "global_steps": trainer.state.global_step}
                plan = getattr(callbacks[0], "auto_plan", None) if callbacks else None
                if plan:
                    result["plan"] = plan
                timeline = Path(tmp) / "memwatch" / "timeline.jsonl"
                if timeline.exists():
                    # MemWatch resets the allocator's peaks at every snapshot: the run's peaks are the
                    # largest its snapshots saw (reserved only shrinks on empty_cache).
                    snaps = [r for r in read_timeline(timeline) if r["event"] == "snapshot"]
                    result["peak_allocated_seen"] = max((r["peak"] or 0 for r in snaps), default=0)
                    result["peak_reserved_seen"] = max((r["reserved"] or 0 for r in snaps), default=0)
            return result

        return run

    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        auto = _guarded_run(train([MemWatch(auto=True, report=False, summary=False)]), device)
        details["memwatch_auto"] = auto
        if not auto.get("completed"):
            # Tell apart a planning failure from a budget the auto mode could not see.
            details["memwatch_auto_explicit_budget"] = _guarded_run(
                train([MemWatch(auto=True, budget=allowed, report=False, summary=False)]), device)
        details["auto_find_batch_size"] = _guarded_run(train([], auto_find_batch_size=True), device)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    passed, why = prevention_verdict(auto, allowed)
    hf = details["auto_find_batch_size"]
    summary = (f"MemWatch(auto=True) in {fraction:.1%} of the device: {why}. auto_find_batch_size: "
               + (f"completed at micro-batch {hf.get('final_micro_batch')} after {hf['num_ooms']} OOM(s)"
                  if hf.get("completed") else f"failed ({hf.get('error')})"))
    return CheckResult("prevention", passed, summary, details)


def check_overhead(device: Any, workdir: str, rounds: int = 3) -> CheckResult:
    """MemWatch() default settings vs none: interleaved runs, ratio of median seconds per step."""
    shape = {"arch": "gpt2", "batch": 8, "seq_len": 512, "steps": 40, "warmup": 10}

    def measure(memwatch: bool) -> Callable[[], float]:
        return lambda: timed_run(shape["arch"], batch=shape["batch"], seq_len=shape["seq_len"], steps=shape["steps"],
                                 warmup=shape["warmup"], device="cuda", memwatch=memwatch, workdir=workdir)

    without, with_memwatch = interleaved(measure(False), measure(True), rounds)
    ratio = overhead_ratio(without, with_memwatch)
    details = {**shape, "rounds": rounds, "seconds_without": without, "seconds_with": with_memwatch, "ratio": ratio}
    summary = (f"{ratio:.4f}x step time with MemWatch() (median of {rounds} interleaved runs of "
               f"{shape['steps'] - shape['warmup']} steady steps; goal <= {GOALS['overhead_ratio']})")
    return CheckResult("overhead", ratio <= GOALS["overhead_ratio"], summary, details)


CHECKS: dict[str, Callable[[Any, str], CheckResult]] = {
    "attribution": check_attribution,
    "prediction": check_prediction,
    "prevention": check_prevention,
    "overhead": check_overhead,
}


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory=f"{props.total_memory / 2**30:.0f} GiB", cuda=torch.version.cuda)
    return info


def run_checks(names: Sequence[str], time_budget_s: float, workdir: str) -> list[CheckResult]:
    """Run the named checks in order; a check that raises, or starts past the budget, fails."""
    device = torch.device("cuda", torch.cuda.current_device())
    started = time.perf_counter()
    results: list[CheckResult] = []
    for name in names:
        elapsed = time.perf_counter() - started
        if elapsed > time_budget_s:
            results.append(CheckResult(name, None, f"not run: the {time_budget_s:.0f} s budget was spent"))
            continue
        check_started = time.perf_counter()
        try:
            result = CHECKS[name](device, workdir)
        except Exception as exc:  # noqa: BLE001 - a crashed check is a failed check, the others still run
            result = CheckResult(name, False, f"crashed: {type(exc).__name__}: {exc}",
                                 {"traceback": traceback.format_exc()})
            free_device_memory()
        result.seconds = time.perf_counter() - check_started
        print(f"gpu-check: {name}: {'pass' if result.passed else 'FAIL'} - {result.summary}", flush=True)
        results.append(result)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        results = run_checks(args.checks, args.time_budget_s, workdir)
    json_path, md_path = write_results(args.out, results, environment())
    print(f"gpu-check: wrote {json_path} and {md_path}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
