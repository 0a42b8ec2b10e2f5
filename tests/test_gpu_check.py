"""The CPU side of ``benchmarks/gpu_check.py`` (issue 8): everything but the CUDA measurements.

No timing is asserted: the timing helpers run on tiny CPU models only to show they measure.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _run_script(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path, gpu_check):
    out = tmp_path / "gpu"
    proc = _run_script("--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [gpu_check.NO_CUDA_MESSAGE]
    assert not out.exists()  # nothing was checked, nothing written


def test_an_unknown_check_is_a_usage_error(tmp_path):
    proc = _run_script("--out", str(tmp_path), "--checks", "attribution,speed")
    assert proc.returncode == 2
    assert "unknown check(s): speed" in proc.stderr


def test_error_statistics(gpu_check):
    assert gpu_check.relative_error(97, 100) == pytest.approx(-0.03)
    stats = gpu_check.error_stats([0.01, -0.09, 0.02, -0.02, 0.03])
    assert stats == {"n": 5, "median": 0.02, "worst": 0.09, "worst_signed": -0.09}
    with pytest.raises(ValueError):
        gpu_check.error_stats([])


def test_interleaving_alternates_the_order_and_the_ratio_is_of_medians(gpu_check):
    calls: list[str] = []
    times = {"a": iter([1.0, 3.0, 2.0]), "b": iter([1.1, 3.3, 2.2])}

    def measure(name: str):
        def run() -> float:
            calls.append(name)
            return next(times[name])
        return run

    without, with_memwatch = gpu_check.interleaved(measure("a"), measure("b"), rounds=3)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert without == [1.0, 3.0, 2.0] and with_memwatch == [1.1, 3.3, 2.2]
    assert gpu_check.overhead_ratio(without, with_memwatch) == pytest.approx(1.1)


def _snapshot(step: int, phase: str, allocated: int, peak: int, weights: int = 10) -> dict:
    live = {"weights": weights, "gradients": 0, "optimizer_states": 0, "activations": 0, "other": allocated - weights}
    return {"event": "snapshot", "step": step, "phase": phase, "allocated": allocated, "peak": peak, "live": live}


def test_attribution_verdict(gpu_check):
    snaps = [_snapshot(1, "step_begin", 100, 100), _snapshot(1, "after_forward", 300, 350),
             _snapshot(1, "step_end", 120, 300)]
    reads = [{"step": s["step"], "phase": s["phase"], "allocated": s["allocated"], "peak": s["peak"]} for s in snaps]
    verdict = gpu_check.attribution_verdict(snaps, reads)
    assert verdict["mismatches"] == [] and verdict["step_peaks"] == {1: 350}

    reads[1] = dict(reads[1], allocated=301)  # the allocator disagrees at one snapshot
    reads[2] = dict(reads[2], peak=400)  # and saw a higher peak in the last window
    verdict = gpu_check.attribution_verdict(snaps, reads)
    assert len(verdict["mismatches"]) == 2
    assert "memory_allocated() 301" in verdict["mismatches"][0]
    assert "max_memory_allocated 400" in verdict["mismatches"][1]

    assert gpu_check.attribution_verdict(snaps, reads[:2])["mismatches"]  # a missing read is a failure


def test_prevention_verdict(gpu_check):
    ok = {"completed": True, "num_ooms": 0, "max_reserved": 90}
    assert gpu_check.prevention_verdict(ok, allowed=100)[0]
    assert not gpu_check.prevention_verdict(dict(ok, num_ooms=1), allowed=100)[0]
    assert not gpu_check.prevention_verdict(dict(ok, max_reserved=101), allowed=100)[0]
    failed, why = gpu_check.prevention_verdict({"completed": False, "error": "OutOfMemoryError: x"}, allowed=100)
    assert not failed and "OutOfMemoryError" in why


def test_results_are_written_as_json_and_markdown(tmp_path, gpu_check):
    row = {"arch": "gpt2", "batch": 8, "seq_len": 512, "checkpointing": True, "optim": "adamw_bnb_8bit",
           "predicted": 3 * 2**30, "max_allocated": 3 * 2**30 + 2**20, "max_reserved": 4 * 2**30,
           "error_allocated": -0.0003, "error_reserved": -0.25}
    results = [
        gpu_check.CheckResult("prediction", True, "12 configurations", {"configurations": [row]}, 100.0),
        gpu_check.CheckResult("overhead", False, "1.0300x", {"ratio": 1.03}, 30.0),
        gpu_check.CheckResult("prevention", None, "not run: the 450 s budget was spent"),
    ]
    json_path, md_path = gpu_check.write_results(tmp_path / "gpu", results, {"gpu": "test"})
    payload = json.loads(json_path.read_text())
    assert payload["passed"] is False
    assert [c["name"] for c in payload["checks"]] == ["prediction", "overhead", "prevention"]
    assert payload["checks"][0]["details"]["configurations"][0]["error_reserved"] == -0.25
    table = md_path.read_text()
    assert "| prediction | pass |" in table and "| overhead | FAIL |" in table and "| prevention | NOT RUN |" in table
    assert "| gpt2 | 8 x 512 | True | adamw_bnb_8bit | 3,072.0 MiB | 3,073.0 MiB | -0.03% | 4,096.0 MiB | -25.00% |" in table


def test_configurations_cover_the_required_matrix(gpu_check):
    configs = gpu_check.configurations()
    assert len(configs) >= 12
    assert {c.arch for c in configs} == {"gpt2", "bert", "llama"}
    assert {c.checkpointing for c in configs} == {False, True}
    assert {c.optim for c in configs} == {"adamw_torch", "adamw_bnb_8bit"}
    assert {c.precision for c in configs} == {"bf16"}
    assert len({(c.arch, c.checkpointing, c.optim) for c in configs}) == 12
    assert tuple(gpu_check.CHECKS) == gpu_check.CHECK_NAMES


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama"])
def test_models_train_in_a_trainer(arch, gpu_check):
    """The builders and datasets the checks use, tiny, on the CPU: one real Trainer run each."""
    seconds = gpu_check.timed_run(arch, batch=2, seq_len=16, steps=3, warmup=1, device="cpu", memwatch=False,
                                  tiny=True)
    assert seconds > 0


def test_interleaved_timing_of_tiny_cpu_runs(gpu_check):
    """The overhead measurement end to end on CPU; the ratio is printed, not asserted (machine noise)."""
    def measure(memwatch: bool):
        return lambda: gpu_check.timed_run("gpt2", batch=2, seq_len=16, steps=4, warmup=1, device="cpu",
                                           memwatch=memwatch, tiny=True)

    without, with_memwatch = gpu_check.interleaved(measure(False), measure(True), rounds=1)
    ratio = gpu_check.overhead_ratio(without, with_memwatch)
    assert len(without) == len(with_memwatch) == 1 and math.isfinite(ratio) and ratio > 0
    print(f"tiny CPU overhead ratio: {ratio:.3f}")


def test_the_estimate_call_of_the_prediction_check(gpu_check):
    """``measure_peak``'s estimate arguments, on a tiny Llama (the CPU stands in for CUDA)."""
    from hf_memwatch.estimation.estimate import estimate

    config = gpu_check.Config("llama", 2, 16, checkpointing=True, optim="adamw_bnb_8bit")
    model = gpu_check.build_model(config.arch, tiny=True)
    predicted = estimate(model, batch_size=config.batch, seq_len=config.seq_len, precision=config.precision,
                         optim=config.optim, checkpointing=config.checkpointing, device="cpu")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert predicted.peak_bytes > weights
    assert torch.isfinite(torch.tensor(float(predicted.peak_bytes)))
