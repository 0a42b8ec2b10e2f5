"""DeepSpeed ZeRO-1/2/3 and ZeRO-Offload through the Trainer on 2 CPU gloo ranks (DeepSpeed's CPU accelerator).

One torchrun launch (``dist_scripts/deepspeed_zero.py``, a module-scoped fixture) records facts: what
DeepSpeed holds by its own attributes, MemWatch's timelines, the reconciled profiler's step peaks, the
predictions made before ``train()`` (no engine yet), the auto mode's plans and their hand-configured runs.
The assertions are here. Unit tests of the ZeRO replays: ``test_zero_backward.py``, ``test_zero_step.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpt2_model, torchrun
from conftest import rank_step_peaks as step_peaks
from conftest import rank_timeline as timeline

from hf_memwatch.testing.truth import within_bounds

SCRIPTS = Path(__file__).parents[1] / "dist_scripts"
PLAN_KEYS = ("micro_batch_size", "gradient_accumulation_steps", "activation_checkpointing", "optim")


def snapshots(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["event"] == "snapshot"]


# -- DeepSpeed ZeRO 1/2/3 through the Trainer, on gloo (DeepSpeed's CPU accelerator) -------------

# ZeRO tensors the timeline cannot name are a few bytes (scalars such as the loss); more is a miss.
SMALL = 1024
LOOKAHEAD_BATCH = 2 * 4 * 32 * 8  # deepspeed_zero.py's micro-batch: input_ids + labels, int64


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    out = tmp_path_factory.mktemp("deepspeed")
    torchrun(SCRIPTS / "deepspeed_zero.py", out, timeout_s=600)
    return out, [json.loads((out / f"deepspeed.rank{rank}.json").read_text()) for rank in (0, 1)]


def _first_step(records: list[dict[str, Any]], phase: str, micro_step: int = 0) -> dict[str, Any]:
    return next(r for r in snapshots(records) if r["step"] == 1 and r["phase"] == phase
                and r["micro_step"] == micro_step)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_rank_split_matches_what_deepspeed_holds(zero_runs, stage):
    """Weights, gradients and optimizer states per rank are DeepSpeed's own partitions on that rank.

    The fp32 master partition (allocated at engine start, before any tracked step) counts as an
    optimizer state from the first step on; gradients between micro-steps (accumulation 2) are where
    ZeRO keeps them (whole ``.grad`` for ZeRO-1, the rank's partition for ZeRO-2/3).
    """
    out, facts = zero_runs
    for rank, fact in enumerate(facts):
        held = fact[f"zero{stage}"]["deepspeed"]
        records = timeline(out / f"zero{stage}", rank)
        begin, micro0, end = (_first_step(records, "step_begin"), _first_step(records, "after_backward"),
                              _first_step(records, "step_end", 1))
        assert begin["live"]["weights"] == held["step_begin"]["weight_bytes"]
        assert begin["live"]["optimizer_states"] == held["step_begin"]["master_bytes"] > 0
        assert begin["live"]["gradients"] == held["step_begin"]["gradient_bytes"]
        assert begin["allocated"] >= sum(begin["live"].values())  # registered: the tracker counts them
        assert micro0["live"]["gradients"] == held["after_backward_micro0"]["gradient_bytes"] > 0
        assert micro0["live"]["weights"] == held["after_backward_micro0"]["weight_bytes"]
        assert end["live"]["optimizer_states"] == held["step_end"]["master_bytes"] + held["step_end"]["adam_state_bytes"]
        assert end["live"]["gradients"] == held["step_end"]["gradient_bytes"]
        # The rest is the batches already formed (measure/batches.py: input_ids and labels, 4 x 32 int64
        # each): the step's two micro-batches, which the Trainer's loop holds until it fetches the next
        # step's, and the one the dataloader formed ahead; plus the loss divisor. Nothing of the engine's.
        formed = (2 + 1) * LOOKAHEAD_BATCH
        assert formed <= end["live"]["other"] <= SMALL + formed, end["live"]


def test_zero_partitions_are_the_rank_share_of_the_model(zero_runs):
    """Per rank (2 ranks): ZeRO-1/2 hold the whole fp32 model, ZeRO-3 half; master, m and v are half."""
    out, facts = zero_runs
    for rank, fact in enumerate(facts):
        full_bytes = 4 * fact["zero3"]["full_param_numel"]
        for stage in (1, 2, 3):
            end = _first_step(timeline(out / f"zero{stage}", rank), "step_end", 1)["live"]
            whole = full_bytes if stage < 3 else full_bytes / 2
            assert abs(end["weights"] - whole) <= SMALL, (stage, end)
            assert abs(end["optimizer_states"] - 3 * full_bytes / 2) <= SMALL, (stage, end)  # master, m, v
        zero1, zero2 = (_first_step(timeline(out / f"zero{s}", rank), "after_backward")["live"] for s in (1, 2))
        assert zero1["gradients"] >= full_bytes > zero2["gradients"]  # ZeRO-2 partitions gradients


# deepspeed_zero.AUTO_RUNS: the planned runs, each against a configured run, all profiled in the suite.
AUTO_RUNS = {"zero2_long_auto": "zero2_long", "zero3_long_auto": "zero3_long",
             "zero3_offload_long_auto": "zero3_offload_long", "zero3_offload_auto": "zero3_offload"}


@pytest.mark.parametrize("name", AUTO_RUNS)
def test_zero_step_peaks_per_rank_match_the_profiler(zero_runs, name):
    """MemWatch's step peaks of the planned ZeRO runs within 2% of the profiler's on each rank and step
    (issue 19, point 5), the profiler's frees on gloo's threads reconciled (testing/truth.py: the raw sum
    kept DeepSpeed's all-gather buffers and reduce-scatter clones that gloo's threads free, -6...-26% off);
    ``zero3_offload_auto`` is checkpointing + 8-bit AdamW on the host partitions
    (``deepspeed_zero.SUITE_TRUTH``; ``benchmarks/engines_accuracy.py`` profiles every run). Against the
    interval of ``step_peak_bounds``, as FSDP2's test is: flaky against the point figure (the earliest
    placement of each unreported free) on 2026-12-06, rank 1 step 1 of ``zero3_offload_auto`` 12,104,528 B
    against 11,604,709 B (+4.3%), where gloo's worker dropped a collective's tensors late; 4 of 4 on a rerun."""
    out, facts = zero_runs
    for rank, fact in enumerate(facts):
        ours = step_peaks(out / name, rank)
        bounds = fact["auto"][name]["truth_step_bounds"]
        assert len(ours) == len(bounds) == 2
        for measured, reference in zip(ours, bounds):
            assert within_bounds(measured, reference, 0.02), (rank, ours, bounds)


ZERO_ENGINES = {"zero2": ("zero2", "none"), "zero2_offload": ("zero2", "optimizer"), "zero3": ("zero3", "none"),
                "zero3_offload": ("zero3", "optimizer"),
                "zero3_offload_param": ("zero3", "params")}
LONG_RUNS = ["zero2_long", "zero3_long", "zero3_offload_long"]  # deepspeed_zero.LONG_SEQ tokens


@pytest.mark.parametrize("name", ZERO_ENGINES)
def test_the_engine_is_read_before_deepspeed_builds_it(zero_runs, name):
    """RunConfig before train(): the ZeRO stage and offload of the JSON, as the accelerator will build them,
    and which optimizer DeepSpeed will step: the Trainer's, with ``zero_force_ds_cpu_optimizer: false``
    (DeepSpeed's default, true, makes accelerate step ``DeepSpeedCPUAdam``: tests/engines/test_engine.py)."""
    _, facts = zero_runs
    for fact in facts:
        assert (fact[name]["shard"], fact[name]["offload"]) == ZERO_ENGINES[name], fact[name]["engine"]
        assert not fact[name]["cpu_optimizer"] and fact[name]["optimizer_class"] == "AdamW", fact[name]


@pytest.mark.parametrize("name", ["zero1", *ZERO_ENGINES, *LONG_RUNS])
def test_zero_prediction_before_the_engine_exists_matches_the_measured_peak(zero_runs, name):
    """``estimate(trainer)`` before train() (the replay calls no DeepSpeed engine) against each rank's
    measured step peak, within 1%, at 32 tokens (model states dominate) and at 128 (activations do): the
    fp32 master partition, ZeRO-1/2's buckets and gradient partitions as they flow
    (engines/zero/backward.py), ZeRO-3's resident gradient partition and gathered set, the offload
    gradient partition. Before the flow: ZeRO-1 -2.7% (its bucket), ZeRO-2 +2.1% (a bucket counted
    outside the backward). ZeRO-2 + offload replays its host path (the fp64 norm of each kept slice, the
    16-bit host buffer, no ``grads_in_partition``; engines/zero/backward.py).

    Where the replay meets gloo's race (a reduction's flat copy or bucket held by a worker thread:
    ``ZeroGradientFlow._issued``), the branch that frees first is the one held to 1% and the estimate, its
    worst branch, must cover the measured peak (:func:`held_covers`)."""
    out, facts = zero_runs
    for rank, fact in enumerate(facts):
        measured = max(step_peaks(out / name, rank))
        freed = fact[name]["branches"].get("freed first", fact[name]["predicted_peak"])
        error = freed / measured - 1
        assert abs(error) <= 0.01, (name, rank, freed, measured)
        held_covers(fact[name], measured)


def held_covers(fact: dict[str, Any], measured: int) -> None:
    """The estimate (the race's worst branch) at or above ``measured`` within ``FLAT_COPY_SLACK``, and over the
    branch that frees first by no more than the blocks gloo's two workers may hold: two collectives' tensors, each
    at most a bucket or its flat copy (up to a bucket plus a slice), so under 4 buckets of fp32 elements."""
    predicted, freed = fact["predicted_peak"], fact["branches"].get("freed first", fact["predicted_peak"])
    assert predicted >= measured * (1 - FLAT_COPY_SLACK), (predicted, measured)
    assert 0 <= predicted - freed <= 4 * 4 * BUCKET, (predicted, freed)


@pytest.mark.parametrize("name", AUTO_RUNS)
def test_auto_mode_plans_every_zero_engine_and_fits(zero_runs, name):
    """ZeRO-2, ZeRO-3 and ZeRO-3 + offload at 0.7 x the configured per-rank peak (at 128 tokens, where
    activations dominate; at 32 the model states do and no ZeRO-2 plan reaches 0.7 x, below), and
    ZeRO-3 + offload at 0.76 x of the 32-token run (checkpointing and 8-bit AdamW): a plan on every rank
    (none failed), the same on all ranks, each rank's profiler step peaks within the budget, the
    effective batch kept. Failed before ZeRO-2's gradient flow was replayed (engines/zero/backward.py)
    and ZeRO-3's gradient partition counted resident: 4 x 2 + checkpointing predicted 11,171,708 B,
    measured 12,188,580 B (the second micro-step's backward holds the kept partition and a new one);
    ZeRO-3 8 x 1 predicted 12,215,436, measured 12,946,288."""
    _, facts = zero_runs
    runs = [fact["auto"][name] for fact in facts]
    plans = [[{k: p.get(k) for k in ("status", *PLAN_KEYS)} for p in run["plans"]] for run in runs]
    assert plans[0] and plans[0] == plans[1], plans
    for run in runs:
        assert run["configured"] == AUTO_RUNS[name]
        assert run["fraction"] == (0.76 if name == "zero3_offload_auto" else 0.7)
        assert all(p.get("status") != "failed" for p in run["plans"]), run["plans"]
        first = run["plans"][0]
        assert first["micro_batch_size"] * first["gradient_accumulation_steps"] == 8  # 4 x 2 configured
        peaks = run["truth_step_peaks"]  # every planned run is profiled (deepspeed_zero.SUITE_TRUTH)
        assert len(peaks) == len(run["step_peaks"]) == 2 and max(peaks) <= run["budget"], (peaks, run["budget"])
    if name == "zero3_offload_auto":
        assert plans[0][0]["optim"] == "adamw_bnb_8bit" and plans[0][0]["activation_checkpointing"], plans


FLAT_COPY_SLACK = 0.0005
BUCKET = 100_000  # tests/dist_scripts/deepspeed_zero.py's reduce buckets (elements)


def test_zero2_plan_covers_the_flat_copy_gloo_may_still_hold(zero_runs):
    """ZeRO-2's planned run (checkpointing, a micro-batch above 1) peaks in a backward; the flat copy of a
    bucket reduction (``torch.cat``, freed by gloo's worker thread when it drops its reference) is still
    held there in some launches and not in others: on 2 x 4 + checkpointing at 32 tokens rank 0's step 2
    measured 10,809,764 and 11,007,908 B (198,144 B, one 49,536-element ``aten.cat`` among MemWatch's peak
    tensors). The plan's prediction without the planner's margin covers every measured step peak on every
    rank (engines/zero/backward.py keeps the largest flat copy until the next reduction); before, it
    was 10,997,656 B, under both launches' highest peaks (11,007,908 and 11,032,484).

    At 128 tokens (this run) the held copy is ~183 kB of a ~23 MB peak (MemWatch 23,031,972 B against the
    reconciled profiler's 22,849,020 on rank 0). One whole-suite launch read 23,056,548 B on rank 1 against
    23,051,417 predicted without margin: 5,131 B (0.02%) unexplained, inside the planner's 1.5% margin. So
    the prediction must cover every peak within ``FLAT_COPY_SLACK`` (0.05%, ~12 kB): far under the copy
    left out (0.8%), so the test still fails if the flat copy is not replayed."""
    from hf_memwatch.planning.predict import ESTIMATE_MARGIN

    _, facts = zero_runs
    for fact in facts:
        run = fact["auto"]["zero2_long_auto"]
        plan = run["plans"][0]
        predicted = plan["predicted_peak"] / (1 + ESTIMATE_MARGIN)
        assert plan["activation_checkpointing"] and plan["micro_batch_size"] > 1, plan  # a backward-bound peak
        assert predicted >= max(run["step_peaks"] + run["truth_step_peaks"]) * (1 - FLAT_COPY_SLACK), (predicted, run)


@pytest.mark.parametrize("name", AUTO_RUNS)
def test_planned_zero_run_equals_the_hand_configured_run_of_its_plan(zero_runs, name):
    """Losses and gradient norms of the planned run (MemWatch on) equal the plan configured by hand (off)."""
    _, facts = zero_runs
    for fact in facts:
        run = fact["auto"][name]
        assert len(run["losses"]) == 2 and run["hand_losses"] is not None
        assert run["losses"] == pytest.approx(run["hand_losses"], rel=1e-6)
        assert run["grad_norms"] == pytest.approx(run["hand_grad_norms"], rel=1e-6)


def test_zero2_budget_no_plan_reaches_stops_every_rank_before_training(zero_runs):
    """ZeRO-2 at ``deepspeed_zero.NO_FIT_FRACTION`` (0.7) x the configured peak: the smallest plan
    (micro-batch 1, its peak the optimizer step on the flat partitions) measured 0.81 x, so no plan fits.
    Every rank stops with a ``PlanError`` before a step runs (the launch finishing is the no-hang check),
    whose message gives the smallest plan's need against the rank's budget, what it holds at its peak,
    and the engine remedies — here why none applies (CPU ranks: no offload saving; the bucket is released
    before an optimizer-step peak)."""
    from hf_memwatch.core.units import format_bytes

    _, facts = zero_runs
    for fact in facts:
        tight = fact["no_fit"]
        raised = tight["raised"]
        assert raised is not None and raised["plan_error"], tight
        assert tight["global_step"] == 0  # stopped before training
        assert raised["budget"] <= tight["budget"] < raised["need"], raised  # usable budget, the need above it
        message = raised["message"]
        assert "no plan fits" in message and format_bytes(raised["need"]) in message, message
        assert format_bytes(tight["budget"]) in message, message
        assert "at its peak (the optimizer step)" in message, message
        assert "- engine: " in message and "offload" in message and "reduce bucket" in message, message
    assert facts[0]["no_fit"]["raised"]["type"] == facts[1]["no_fit"]["raised"]["type"] == "PlanError"


def test_reconciling_a_profile_of_tensors_without_storage_keeps_none_alive():
    """The reconciled truth reads each operator input's ``storage_data_ptr``; torch 2.13 returns ``None``
    for a tensor without storage without owning the reference, so the profiled planning of a run (fake
    tensors) took one from ``None`` per read and the benchmark's launch aborted ("deallocating None")."""
    from torch.profiler import ProfilerActivity, profile

    from hf_memwatch.testing.truth import cpu_memory_deltas

    reads = 2000  # storage-less inputs: two per linear on meta tensors
    meta = torch.randn(4, 8, device="meta")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        for _ in range(reads // 2):
            torch.nn.functional.linear(meta, torch.randn(3, 8, device="meta"))
            torch.nn.functional.linear(torch.randn(4, 8), torch.randn(3, 8))
    before = sys.getrefcount(None)
    deltas = cpu_memory_deltas(prof, reconcile=True)
    # Other objects of the walk come and go (tens of references); the defect took one per read.
    assert sys.getrefcount(None) - before > -reads // 4 and deltas, sys.getrefcount(None) - before


@pytest.mark.parametrize("name, shard, offload", [("zero2", "zero2", "none"), ("zero3", "zero3", "none"),
                                                  ("zero3_offload", "zero3", "optimizer"),
                                                  ("zero3_offload_long", "zero3", "optimizer"),
                                                  ("zero3_offload_param", "zero3", "params")])
def test_cli_estimate_agrees_with_the_auto_modes_prediction(zero_runs, tmp_path, capsys, name, shard, offload):
    """``hf-memwatch estimate --world-size 2 --shard ... --offload ...`` with the run's bucket settings against
    the prediction the auto mode made for the same run (``estimate(trainer)`` before train()) and against
    each rank's measured peak."""
    from hf_memwatch.cli.main import main

    out, facts = zero_runs
    gpt2_model().config.save_pretrained(tmp_path)
    argv = ["estimate", str(tmp_path), "--micro-batch-size", "4", "--gradient-accumulation-steps", "2", "--seq-len", str(facts[0][name]["seq_len"]), "--world-size", "2",
            "--shard", shard, "--offload", offload, "--reduce-bucket-size", "1e5", "--json"]
    if shard == "zero3":
        argv += ["--prefetch-bucket-size", "1e5"]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    predicted = payload["peak_bytes"]
    auto = facts[0][name]["predicted_peak"]
    assert abs(predicted / auto - 1) <= 0.01, (predicted, auto)
    freed = payload.get("branches", {}).get("freed first", predicted)  # gloo's race: the branch that frees first
    for rank in (0, 1):
        measured = max(step_peaks(out / name, rank))
        assert -0.01 <= freed / measured - 1 <= 0.03, (freed, measured)
        assert predicted >= measured * (1 - FLAT_COPY_SLACK), (predicted, measured)


def test_zero3_gathering_replay_issues_the_all_gathers_deepspeed_issued(zero_runs):
    """The replay of DeepSpeed's coordinator (``engines/zero/gather.py``) over the test GPT-2's module calls
    issues, bucket for bucket, the all-gathers DeepSpeed issued in a forward of a complete trace (step 2's first
    micro-step; the backward gathers nothing: every parameter stays gathered), on both ranks."""
    import torch
    from conftest import module_calls

    from hf_memwatch.engines.engine import Engine
    from hf_memwatch.engines.zero.gather import forward_gathering

    _, facts = zero_runs
    model = gpt2_model()
    _, trace = module_calls(model, input_ids=torch.ones(4, 32, dtype=torch.long))
    engine = Engine(kind="deepspeed", world_size=2, zero_stage=3, prefetch_bucket_size=100_000,
                    param_persistence_threshold=0)
    gathering, _ = forward_gathering(model, engine, "cpu")
    expected = gathering.buckets(trace)
    assert len(expected) > 2
    for rank in (0, 1):
        assert facts[rank]["zero3"]["gathers"] == expected, (rank, facts[rank]["zero3"]["gathers"], expected)
