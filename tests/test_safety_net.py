"""The auto mode's safety net: an out-of-memory in the first step, despite the plan, is recovered.

A real CPU out-of-memory: a subprocess under ``RLIMIT_AS`` with a budget larger than the real limit
(the plan "fits" the budget and dies). The run completes — planned again, the step run again from
the same RNG states, the effective batch kept — and the timeline says so; the losses are those of
the hand-configured run of the final plan.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import gpt2_model, loss_history, token_dataset, training_args
from transformers import Trainer

from hf_memwatch.core.records import validate_record

TESTS = Path(__file__).resolve().parent

SCRIPT = r"""
import gc, json, os, resource, sys
sys.path.insert(0, sys.argv[1])
from conftest import freeze_imported_objects, gpt2_model, loss_history, token_dataset, training_args
from transformers import Trainer
from hf_memwatch import MemWatch
freeze_imported_objects()

unlimited = resource.getrlimit(resource.RLIMIT_AS)
for out, budget, detail in json.loads(sys.argv[2]):
    args = training_args(out, per_device_train_batch_size=32, max_steps=2)
    trainer = Trainer(model=gpt2_model(), args=args, train_dataset=token_dataset(64, 256, 1000),
                      callbacks=[MemWatch(auto=True, budget=budget, detail=detail, report=False, summary=False)])
    with open("/proc/self/status") as fh:
        vm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (300 << 20), unlimited[1]))
    trainer.train()
    resource.setrlimit(resource.RLIMIT_AS, unlimited)  # the next run sets its own, 300 MiB above the process then
    print("RESULT " + json.dumps({"out": out, "losses": loss_history(trainer), "steps": trainer.state.global_step,
                                  "micro": trainer.args.per_device_train_batch_size,
                                  "accum": trainer.args.gradient_accumulation_steps,
                                  "ckpt": bool(trainer.args.activation_checkpointing),
                                  "optim": str(trainer.args.optim.value)}), flush=True)
    del trainer
    gc.collect()
"""

# Both runs in one subprocess (one import of torch and transformers, ~10 CPU s, instead of two), each under
# its own limit: the default budget (None: the real limit) in full detail, then a budget above the real limit.
RUNS = {"default": (None, "full"), "4GiB": ("4GiB", "light")}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, list[dict]]]:
    """Train under an address-space limit 300 MiB above the process (the unassisted step needs ~740)."""
    folder = tmp_path_factory.mktemp("limited")
    runs = [(str(folder / name), budget, detail) for name, (budget, detail) in RUNS.items()]
    env_script = folder / "run.py"
    env_script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(env_script), str(TESTS), json.dumps(runs)], capture_output=True, text=True,
                          # the package of this checkout, not the one installed in the environment
                          timeout=600, env={"PYTHONPATH": str(TESTS.parent), "MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "131072",
                                            "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
                                            "PATH": "/usr/bin:/bin"})
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == len(runs), proc.stderr[-3000:]
    return {Path(r["out"]).name: (r, [json.loads(line) for line in (Path(r["out"]) / "memwatch" / "timeline.jsonl").read_text().splitlines()])
            for r in results}


def test_the_default_budget_is_the_real_limit_and_the_run_fits(limited) -> None:
    # Tracked in full: the footprint of each step is measured against its exact allocated peak.
    result, records = limited["default"]
    [plan] = [r for r in records if r["event"] == "plan"]
    assert plan["budget_bound_by"] == "RLIMIT_AS" and "RLIMIT_AS" in plan["budget_source"]
    assert not [r for r in records if r["event"] in ("oom_recovered", "oom")]  # 0 OOMs
    assert result["steps"] == 2 and result["micro"] * result["accum"] == 32  # the effective batch kept
    # The margin: sized before training from the virtual size (what RLIMIT_AS counts), then measured
    # in each step; every record of the subprocess matches its typed definition.
    assert "vms" in plan["margin_source"] and "probe" in plan["margin_source"]
    footprints = [r for r in records if r["event"] == "footprint"]
    assert [r["step"] for r in footprints] == [1, 2] and {r["kind"] for r in footprints} == {"vms"}
    print(footprints)
    for footprint in footprints:
        assert 0 < footprint["allocated_peak"] <= footprint["next_step_need"]
        assert footprint["next_step_need"] >= max(footprint["allocated_peak"] + footprint["states_growth"]
                                                  + footprint["footprint_gap"], plan["predicted_peak"])
    assert not [problem for r in records for problem in validate_record(r)]


def test_an_oom_in_the_first_step_is_recovered_with_the_effective_batch_kept(limited, tmp_path: Path) -> None:
    # A budget above the real limit: the plan "fits" 4 GiB and runs out of memory in its first step.
    result, records = limited["4GiB"]
    recovered = [r for r in records if r["event"] == "oom_recovered"]
    plans = [r for r in records if r["event"] == "plan"]
    assert 1 <= len(recovered) <= 3 and result["steps"] == 2
    assert recovered[0]["failed_plan"]["micro_batch_size"] == 32  # 4 GiB "fitted" the configuration as given
    assert plans[-1]["recovered_from_oom"] == len(recovered)
    assert result["micro"] * result["accum"] == 32  # the effective batch kept
    assert "can't allocate memory" in recovered[0]["error"] or "DefaultCPUAllocator" in recovered[0]["error"]

    # The recovered run is the hand-configured run of its final plan (same samples, same order).
    hand = Trainer(model=gpt2_model(), train_dataset=token_dataset(64, 256, 1000),
                   args=training_args(tmp_path / "hand", per_device_train_batch_size=result["micro"],
                                      gradient_accumulation_steps=result["accum"], max_steps=2,
                                      activation_checkpointing=result["ckpt"], optim=result["optim"]))
    hand.train()
    assert result["losses"] == pytest.approx(loss_history(hand), rel=1e-6)
