"""``benchmarks/gpu_check.py`` (issues 8 and 23): its pure parts, and the whole script on the CPU.

The dry run (``--device cpu --quick``) runs every check through the code the GPU runs — same Trainer
runs, same comparisons — with the CPU backend's figures for the allocator's. No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
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


def _env() -> dict[str, str]:
    # One thread, as each pytest worker (tests/conftest.py): two workers' subprocesses at two threads each
    # oversubscribe the two cores, and OpenMP's waiting threads spin.
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def _run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=_env(),
                          timeout=timeout)


def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path, gpu_check):
    out = tmp_path / "gpu"
    proc = _run_script("--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [gpu_check.NO_CUDA_MESSAGE]
    assert not out.exists()  # nothing was checked, nothing written


def test_an_unknown_check_is_a_usage_error(tmp_path, gpu_check, capsys):
    with pytest.raises(SystemExit) as exited:  # argparse's usage error, before anything runs
        gpu_check.main(["--out", str(tmp_path), "--checks", "attribution,speed"])
    assert exited.value.code == 2
    assert "unknown check(s): speed" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_error_statistics(gpu_check):
    assert gpu_check.relative_error(97, 100) == pytest.approx(-0.03)
    stats = gpu_check.error_stats([0.01, -0.09, 0.02, -0.02, 0.03])
    assert stats == {"n": 5, "median": 0.02, "worst": 0.09, "worst_signed": -0.09}
    with pytest.raises(ValueError):
        gpu_check.error_stats([])


def test_interleaving_alternates_the_order_and_stops_when_told(gpu_check):
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
    asked = []
    a, b = gpu_check.interleaved(lambda: 1.0, lambda: 2.0, rounds=3, keep_going=lambda: asked.append(1) and False)
    assert (a, b, len(asked)) == ([1.0], [2.0], 1)  # the budget is asked before every round after the first


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


def test_prevention_verdict_compares_the_plan_with_the_measure(gpu_check):
    ok = {"completed": True, "num_ooms": 0, "measured": 95}
    assert gpu_check.prevention_verdict(ok, allowed=100, predicted=100)[0]
    assert not gpu_check.prevention_verdict(dict(ok, num_ooms=1), allowed=100, predicted=100)[0]
    assert not gpu_check.prevention_verdict(dict(ok, measured=101), allowed=100, predicted=100)[0]  # over the limit
    # under the limit but not what the plan predicted: the check that the fraction one could not be
    assert not gpu_check.prevention_verdict(dict(ok, measured=60), allowed=100, predicted=95)[0]
    assert not gpu_check.prevention_verdict(ok, allowed=100, predicted=None)[0]
    failed, why = gpu_check.prevention_verdict({"completed": False, "error": "OutOfMemoryError: x"}, 100, 100)
    assert not failed and "OutOfMemoryError" in why


def test_results_are_written_atomically_as_json_and_markdown(tmp_path, gpu_check):
    row = {"arch": "gpt2", "batch": 8, "seq_len": 512, "checkpointing": True, "optim": "adamw_bnb_8bit",
           "predicted": 3 * 2**30, "max_allocated": 3 * 2**30 + 2**20, "max_reserved": 4 * 2**30,
           "error_allocated": -0.0003, "predicted_reserved": 4 * 2**30 - 2**26, "error_reserved": -0.015625}
    results = [
        gpu_check.CheckResult("prediction", True, "12 configurations", {"configurations": [row]}, 100.0),
        gpu_check.CheckResult("overhead", False, "1.0300x", {"ratio": 1.03}, 30.0),
        gpu_check.CheckResult("prevention", None, "not run: the 450 s budget was spent"),
    ]
    skipped = [{"check": "prediction", "what": "2 configurations", "why": "out of time"}]
    json_path, md_path = gpu_check.write_results(tmp_path / "gpu", results, {"gpu": "test"}, skipped)
    payload = json.loads(json_path.read_text())
    assert payload["passed"] is False and payload["status"] == "finished" and payload["skipped"] == skipped
    assert [c["name"] for c in payload["checks"]] == ["prediction", "overhead", "prevention"]
    assert payload["checks"][0]["details"]["configurations"][0]["error_reserved"] == -0.015625
    table = md_path.read_text()
    assert "| prediction | pass |" in table and "| overhead | FAIL |" in table and "| prevention | NOT RUN |" in table
    assert ("| gpt2 | 8 x 512 | True | adamw_bnb_8bit | 3,072.0 MiB | 3,073.0 MiB | -0.03% | 4,032.0 MiB "
            "| 4,096.0 MiB | -1.56% |") in table
    assert sorted(p.name for p in (tmp_path / "gpu").iterdir()) == ["gpu_check.json", "gpu_check.md"]  # no tmp left
    running = json.loads(gpu_check.write_results(tmp_path / "gpu", results, {}, status="running")[0].read_text())
    assert running["status"] == "running" and running["passed"] is None


def test_the_sweep_has_billion_parameter_shapes_first(gpu_check):
    configs = gpu_check.configurations()
    big = {"llama-1b", "qwen3-1.7b"}
    for arch in big:
        with torch.device("meta"):
            params = sum(p.numel() for p in gpu_check.build_model(arch, device="meta").parameters())
        assert params >= 1.0e9, (arch, params)
    assert configs[0].arch in big and configs[1].arch in big and configs[0].arch != configs[1].arch
    large = [c for c in configs if c.arch in big]
    assert {c.batch * c.seq_len for c in large} >= {2048, 4096, 8192}
    assert min(c.seq_len for c in large) >= 2048 and max(c.seq_len for c in large) == 8192
    assert {c.optim for c in large} == {"adamw_torch_fused", "adamw_bnb_8bit"}
    assert {c.checkpointing for c in large} == {False, True} and {c.precision for c in configs} == {"bf16"}
    assert sum(c.qlora for c in configs) == 1
    assert gpu_check.model_config("qwen3-1.7b")._attn_implementation == "sdpa"
    quick = gpu_check.configurations(quick=True)
    assert [(c.arch, c.optim, c.checkpointing, c.qlora) for c in quick] == [
        (c.arch, c.optim, c.checkpointing, c.qlora) for c in configs]  # the same sweep, tiny
    assert tuple(gpu_check.CHECKS) == gpu_check.CHECK_NAMES


def test_the_cpu_dry_run_passes_every_check_and_keeps_the_json_valid_throughout(tmp_path, gpu_check):
    """The whole script on the CPU: every check runs (a budget no loaded machine spends: dropping
    what does not fit is tested below) and passes.

    The JSON is read while the run writes it: each read must parse (atomic replacement), and a read in
    the middle of the prediction sweep is what a run killed there leaves (a SIGKILL runs no handler:
    the file on disk is the last one replaced): ``status: "running"``, the sweep's rows so far, no
    verdict. What is skipped is only what needs CUDA (or what the CPU backend cannot see), each with
    its reason.
    """
    out = tmp_path / "dry"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out),
                             "--time-budget-s", "3600"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env())
    reads, midway = 0, None
    while proc.poll() is None:
        path = out / "gpu_check.json"
        if path.exists():
            read = json.loads(path.read_text())  # never a half-written file
            reads += 1
            running = [c for c in read["checks"] if c["name"] == "prediction" and c["passed"] is None]
            if midway is None and running and running[0]["details"].get("configurations"):
                midway = read
        time.sleep(0.2)
    output = proc.stdout.read()
    payload = json.loads((out / "gpu_check.json").read_text())
    assert payload["status"] == "finished" and reads > 0, output[-3000:]
    assert midway is not None, "no read fell inside the prediction sweep"
    assert midway["status"] == "running" and midway["passed"] is None
    [prediction] = [c for c in midway["checks"] if c["name"] == "prediction"]
    assert prediction["summary"].startswith("running:")
    assert prediction["details"]["configurations"][0]["max_allocated"] > 0
    checks = {c["name"]: c for c in payload["checks"]}
    assert list(checks) == ["attribution", "prediction", "prevention", "overhead", "published"]
    failed = {name: c["summary"] for name, c in checks.items() if c["passed"] is not True}
    assert not failed, failed  # attribution included: MemWatch's classes sum to the CPU truth's bytes
    assert payload["passed"] is True and proc.returncode == 0, output[-3000:]
    attribution = checks["attribution"]["details"]
    assert attribution["snapshots"] >= 2 * 7 and attribution["hooked_module"] == "GPT2LMHeadModel"
    assert attribution["mismatches"] == [] and "unmonitored_errors" in attribution  # the twin ran
    prediction = checks["prediction"]["details"]
    rows = prediction["configurations"]
    assert len(rows) == prediction["planned"] and not prediction["dropped"]
    assert all("error" not in r for r in rows), rows
    assert all(("excluded" in r) == ("bnb" in r["optim"]) for r in rows)  # only where the CPU cannot see
    plan = checks["prevention"]["details"]["memwatch_auto"]["plan"]
    assert plan["micro_batch_size"] < 8 or plan["activation_checkpointing"]  # the plan changed the run
    allowed = set(gpu_check.CUDA_ONLY.values()) | set(gpu_check.CPU_BLIND.values())
    assert payload["skipped"] and all(s["why"] in allowed for s in payload["skipped"]), payload["skipped"]
    skipped = {(s["check"], s["what"]) for s in payload["skipped"]}
    assert {("prediction", "predicted vs measured reserved"), ("prediction", "predicted vs measured mem_get_info"),
            ("prevention", "auto_find_batch_size"), ("overhead", "the 1.01 goal"),
            ("published", "predicted vs measured reserved")} <= skipped
    # the three published configurations, each run (the Trainer's, the script's loop, LoRA) and compared
    cases = checks["published"]["details"]["cases"]
    assert [c["case"] for c in cases] == ["perf-fp16", "bert-sdpa-sdpa-16x512", "fms-mistral-lora-bs8"], cases
    assert all(c["max_allocated"] > 0 and "error_allocated" in c for c in cases), cases
    report = (out / "gpu_check.md").read_text()
    assert "| prediction |" in report and "| fms-mistral-lora-bs8 |" in report


def test_the_sweep_drops_what_its_budget_cannot_hold_and_lists_it(tmp_path, gpu_check):
    """A prediction check whose time is up when it begins: its first configuration runs (one always does), the
    rest are dropped and named. (Given half a second, a fast machine ran two: the test depended on timing.)"""
    results = gpu_check.ResultsFile(tmp_path / "out", {"device": "cpu"})
    probe = gpu_check.CpuProbe(torch.device("cpu"))
    ctx = gpu_check.Context(probe, str(tmp_path), True, time.perf_counter(), results)
    result = gpu_check.check_prediction(ctx)
    details = result.details
    assert len(details["configurations"]) == 1 and len(details["dropped"]) == details["planned"] - 1
    assert "1 of 12 configurations" in result.summary and "11 dropped (time)" in result.summary
    assert any(s["check"] == "prediction" and s["why"].startswith("out of time") for s in results.skipped)
    written = json.loads((tmp_path / "out" / "gpu_check.json").read_text())  # published as it came
    assert written["status"] == "running" and written["checks"][0]["details"]["configurations"]


def test_the_cpu_reader_counts_what_the_allocator_does_not_a_dataset_reached_through_a_view(gpu_check):
    """``dataset[i]`` is a view: PyTorch's CPU allocator (the profiler) allocates nothing for it, so the
    reader leaves the dataset's storage out; a plain tracker counted it (the attribution gap)."""
    from hf_memwatch.testing.truth import cpu_memory_deltas, cpu_memory_profile

    weights = [torch.zeros(256)]
    table = torch.arange(512).reshape(8, 64)  # the dataset's token table, made before the run
    counted = {}
    for name, before in (("plain", ()), ("reader", [table])):
        tracker = gpu_check.RunTracker(weights, before)
        with cpu_memory_profile() as prof:
            with tracker:
                row = table[3]
                doubled = row * 2
        counted[name] = (tracker.allocated, sum(d for _, d in cpu_memory_deltas(prof)))
        del row, doubled
    weight_bytes = weights[0].untyped_storage().nbytes()
    reader, truth = counted["reader"]
    assert reader == weight_bytes + truth  # the weights and what the run allocated: the profiler's count
    assert counted["plain"][0] == reader + table.untyped_storage().nbytes()  # the defect it guards


def test_the_published_cases_are_scaled_down_to_a_smaller_card_only(gpu_check):
    """The micro-batch times the card's memory over the source card's where that is below 1 (at least 1): a
    16 GiB card runs the V100 page's batch as published, the A100-80GB cases at a fifth; an 80 GiB or larger
    card runs all three as published."""
    import gpu_check_published as published

    small = {c.key: c.batch for c in published.published_cases(16 * 2**30, quick=False)}
    assert small == {"perf-fp16": 4, "bert-sdpa-sdpa-16x512": 3, "fms-mistral-lora-bs8": 1}
    large = {c.key: (c.batch, c.seq) for c in published.published_cases(141 * 2**30, quick=False)}
    assert large == {"perf-fp16": (4, 512), "bert-sdpa-sdpa-16x512": (16, 512), "fms-mistral-lora-bs8": (8, 4096)}


def test_the_published_check_fails_when_a_case_did_not_run_or_misses_the_goals(gpu_check):
    import gpu_check_published as published

    good = {"case": "a", "error_allocated": 0.01, "error_reserved": 0.02}
    assert published.published_result([good, dict(good, case="b")], 2, running=False).passed is True
    assert published.published_result([good, {"case": "b", "error": "OOM"}], 2, running=False).passed is False
    assert published.published_result([good, dict(good, error_allocated=-0.09)], 2, running=False).passed is False
    assert published.published_result([good], 2, running=True).passed is None
