"""Distributed runs (issue 7): real 2-process gloo runs launched with torchrun, and sharded estimates.

The torchrun launches are module-scoped fixtures: DDP (``ddp_trainer.py``, which also runs
``agreement.py``'s scenarios and ``fsdp2_shards.py``'s step on its process group) and DeepSpeed ZeRO
(``deepspeed_zero.py``); the scripts under ``tests/dist_scripts/`` only record facts, the assertions are here. A launch that does
not finish in time is killed (its whole process group) and the test fails with what it printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpt2_model, torchrun
from conftest import rank_timeline as timeline

from hf_memwatch.estimation.estimate import estimate
from hf_memwatch.estimation.shard import largest_layer_bytes, shard_classes
from hf_memwatch.measure.distributed import (
    agree_plan,
    agree_unavailable,
    decide_across_ranks,
    gather_ints,
    max_over_ranks,
    share_failure,
    world,
)

SCRIPTS = Path(__file__).parent / "dist_scripts"
PLAN_KEYS = ("micro_batch_size", "gradient_accumulation_steps", "activation_checkpointing", "optim")


def snapshots(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["event"] == "snapshot"]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("ddp")
    torchrun(SCRIPTS / "ddp_trainer.py", out)
    facts = [json.loads((out / f"facts.rank{rank}.json").read_text()) for rank in (0, 1)]
    return out, facts


@pytest.fixture(scope="module")
def agreement(ddp_runs) -> list[dict[str, Any]]:
    """``agreement.py``'s scenarios, run at the end of the DDP launch on its process group."""
    out, _ = ddp_runs
    return [json.loads((out / f"agreement.rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def fsdp2(ddp_runs) -> list[dict[str, Any]]:
    """``fsdp2_shards.py``'s FSDP2 step, run at the end of the DDP launch on its process group."""
    out, _ = ddp_runs
    return [json.loads((out / f"fsdp2.rank{rank}.json").read_text()) for rank in (0, 1)]


# -- without a process group ------------------------------------------------------------------


def test_helpers_without_a_process_group_are_the_single_process_answer():
    assert world() == (0, 1)
    assert gather_ints(7) == [7]
    assert max_over_ranks(5) == 5 and max_over_ranks(None) is None
    assert agree_plan({"micro_batch_size": 4}, need_bytes=-1) == {"micro_batch_size": 4}
    assert decide_across_ranks({"a": 1}, need_bytes=3).decider == 0
    assert agree_unavailable({"8-bit AdamW": "no bitsandbytes"}) == {"8-bit AdamW": "no bitsandbytes"}
    share_failure(RuntimeError("x"), fatal=True)  # nothing to tell: must not raise nor block


# -- agreement over gloo -----------------------------------------------------------------------


def test_small_collectives_on_two_ranks(agreement):
    for rank, result in enumerate(agreement):
        assert result["world"] == [rank, 2]
        assert result["gather_ints"] == [10, 20]
        assert result["max_over_ranks"] == 100
        assert result["max_with_none"] == 7  # a rank without a figure is ignored


def test_the_rank_that_needs_the_most_decides_for_all(agreement):
    rank1_plan = {"micro_batch_size": 4, "activation_checkpointing": True}
    rank0_plan = {"micro_batch_size": 8, "activation_checkpointing": False}
    for result in agreement:
        assert result["agree_rank1_needs_more"] == rank1_plan
        assert result["agree_rank0_needs_more"] == rank0_plan
        assert result["agree_tie"] == {"plan": rank0_plan, "decider": 0, "needs": [3, 3]}


def test_a_remedy_unavailable_on_one_rank_is_unavailable_on_all(agreement):
    for result in agreement:
        assert result["unavailable"] == {"8-bit AdamW": "rank 1: bitsandbytes missing"}


def test_a_rank_failing_while_planning_leaves_no_rank_waiting(agreement):
    assert agreement[1]["failure_rank1"] == {"outcome": "failed here"}
    assert agreement[0]["failure_rank1"] == {
        "outcome": "peer failure", "message": "rank 1: ValueError: weights alone exceed the budget", "fatal": True,
    }
    assert agreement[0]["after_failure"] == agreement[1]["after_failure"] == [0, 1]  # still in step


# -- DDP with the real Trainer -----------------------------------------------------------------


def test_each_rank_writes_its_own_timeline(ddp_runs):
    out, _ = ddp_runs
    for run in ("watch", "bucket_view", "auto"):
        for rank in (0, 1):
            records = timeline(out / run, rank)
            assert records and {r["rank"] for r in records if "rank" in r} == {rank}
            assert [r["step"] for r in records if r["event"] == "step"] == [1, 2, 3]


def test_monitoring_does_not_change_ddp_training(ddp_runs):
    _, facts = ddp_runs
    for rank_facts in facts:
        assert rank_facts["plain"]["ddp"] and len(rank_facts["plain"]["losses"]) == 3
        assert rank_facts["watch"]["losses"] == rank_facts["plain"]["losses"]
        assert rank_facts["bucket_view"]["losses"] == rank_facts["plain"]["losses"]
    assert facts[0]["plain"]["losses"] == facts[1]["plain"]["losses"]  # DDP: one loss history


def test_ddp_gradient_buckets_count_as_gradients(ddp_runs):
    """The Trainer's DDP (``gradient_as_bucket_view=False``): ``.grad`` plus the reducer's buckets."""
    out, facts = ddp_runs
    for rank in (0, 1):
        param_bytes = facts[rank]["watch"]["param_bytes"]
        buckets = sum(facts[rank]["watch"]["bucket_sizes"])
        assert buckets == param_bytes  # DDP's own logging data: one bucket byte per gradient byte
        for snap in snapshots(timeline(out / "watch", rank)):
            assert sum(snap["live"].values()) == snap["allocated"]
            with_grad = snap["phase"] in ("after_backward", "after_optimizer")
            expected = param_bytes + buckets if with_grad else buckets  # .grad set to None at step end
            assert snap["live"]["gradients"] == expected, snap


def test_bucket_view_gradients_equal_local_parameter_bytes(ddp_runs):
    """``gradient_as_bucket_view=True``: the ``.grad`` are the buckets, gradients == parameter bytes."""
    out, facts = ddp_runs
    for rank in (0, 1):
        param_bytes = facts[rank]["bucket_view"]["param_bytes"]
        for snap in snapshots(timeline(out / "bucket_view", rank)):
            assert sum(snap["live"].values()) == snap["allocated"]
            assert snap["live"]["gradients"] == param_bytes, snap


def test_ddp_step_peaks_per_rank_match_the_profiler(ddp_runs):
    out, facts = ddp_runs
    for rank in (0, 1):
        ours = [r["peak"] for r in timeline(out / "watch", rank) if r["event"] == "step"]
        truth = facts[rank]["watch"]["truth_step_peaks"]
        assert len(ours) == len(truth) == 3
        for measured, reference in zip(ours, truth):
            assert abs(measured - reference) / reference <= 0.02, (rank, ours, truth)


@pytest.mark.parametrize("run", ["auto", "ckpt_bnb"])
def test_planned_ddp_step_peaks_per_rank_match_the_profiler(ddp_runs, run):
    """Checkpointing + 8-bit AdamW under DDP (the planned run, and issue 19's accumulation-2 run with
    ranks of 16 and 64 tokens): every step within 2% of the profiler on each rank. Failed before on
    step 1 (the first write into DDP's buckets counted them twice: +4...+17%), on the step DDP
    rebuilds its buckets (the freed initial ones kept as placeholders: +5...+10%) and wherever the
    8-bit step's fp32 temporaries made the peak (unseen inside bitsandbytes' kernel: -5.8%)."""
    out, facts = ddp_runs
    for rank in (0, 1):
        ours = [r["peak"] for r in timeline(out / run, rank) if r["event"] == "step"]
        truth = facts[rank][run]["truth_step_peaks"]
        assert len(ours) == len(truth) == 3
        for measured, reference in zip(ours, truth):
            assert abs(measured - reference) / reference <= 0.02, (rank, ours, truth)


def test_scalars_figure_is_the_maximum_over_ranks(ddp_runs):
    out, facts = ddp_runs
    peaks = [max(r["peak"] for r in timeline(out / "watch", rank) if r["event"] == "step") for rank in (0, 1)]
    assert facts[0]["max_peak_over_ranks"] == facts[1]["max_peak_over_ranks"] == max(peaks)


def test_ddp_estimate_matches_the_measured_rank_peak(ddp_runs):
    """``estimate(world_size=2)`` (DDP, no sharding) against the peak each rank measured."""
    out, facts = ddp_runs
    predicted = estimate(gpt2_model().config, batch_size=8, seq_len=32, world_size=2, shard="none",
                         optim="adamw_torch_fused").peak_bytes
    for rank in (0, 1):
        measured = max(r["peak"] for r in timeline(out / "watch", rank) if r["event"] == "step")
        assert abs(predicted - measured) / measured <= 0.03, (predicted, measured)


def test_auto_mode_agrees_one_plan_when_only_one_rank_must_act(ddp_runs):
    """Rank 0's budget fits the configured run, rank 1's does not: both must run rank 1's plan."""
    out, facts = ddp_runs
    plans = [[r for r in timeline(out / "auto", rank) if r["event"] == "plan"] for rank in (0, 1)]
    assert plans[0] and plans[1]
    first = [{k: p[0][k] for k in PLAN_KEYS} for p in plans]
    last = [{k: p[-1][k] for k in PLAN_KEYS} for p in plans]
    assert first[0] == first[1] and last[0] == last[1], plans
    configured = facts[0]["plain"]["configured"]
    assert configured["micro_batch_size"] == 8
    assert first[0] != configured  # the plan acted, for rank 1's sake
    assert first[0]["micro_batch_size"] * first[0]["gradient_accumulation_steps"] == 8  # effective batch kept
    rank1_peak = max(r["peak"] for r in timeline(out / "auto", 1) if r["event"] == "step")
    assert rank1_peak <= facts[1]["auto_budget"], (rank1_peak, facts[1]["auto_budget"])
    # The prediction the plan was chosen by covers what the rank measured (DDP buckets included),
    # and so does PyTorch's own accounting of the planned run.
    assert rank1_peak <= plans[1][0]["predicted_peak"], (rank1_peak, plans[1][0])
    truth = facts[1]["auto"]["truth_step_peaks"]
    assert len(truth) == 3 and max(truth) <= facts[1]["auto_budget"], (truth, facts[1]["auto_budget"])
    # The engine's own remedy is advice in the record on every rank, never applied (issue 19, point 4).
    for rank_plans in plans:
        assert [a["name"] for a in rank_plans[0].get("advice", []) if a["name"].startswith("DeepSpeed ZeRO-1")]


def test_planned_ddp_run_equals_the_hand_configured_run_of_its_plan(ddp_runs):
    _, facts = ddp_runs
    for fact in facts:
        assert len(fact["auto"]["losses"]) == 3
        assert fact["auto"]["losses"] == pytest.approx(fact["hand"]["losses"], rel=1e-6)
        assert fact["auto"]["grad_norms"] == pytest.approx(fact["hand"]["grad_norms"], rel=1e-6)


def test_one_rank_that_would_not_fit_switches_every_rank_before_the_next_step(ddp_runs):
    """Rank 1 alone holds an extra configured peak in step 1: both ranks turn checkpointing on, the same
    plan, recorded after step 1 and before step 2 (the run finished: no rank waited alone)."""
    out, facts = ddp_runs
    records = [timeline(out / "replan", rank) for rank in (0, 1)]
    plans = [[r for r in recs if r["event"] == "plan"] for recs in records]
    for rank_plans in plans:
        assert len(rank_plans) == 2, rank_plans
        assert not rank_plans[0]["activation_checkpointing"] and rank_plans[1]["activation_checkpointing"]
        assert "rank 1:" in rank_plans[1]["reason"] and "agreed by all ranks" in rank_plans[1]["reason"]
    assert [{k: p[-1][k] for k in PLAN_KEYS} for p in plans][0] == [{k: p[-1][k] for k in PLAN_KEYS} for p in plans][1]
    for recs in records:  # switched between step 1 and step 2
        order = [(r["event"], r.get("step")) for r in recs if r["event"] in ("plan", "step")]
        switch = [i for i, (event, _) in enumerate(order) if event == "plan"][1]
        assert order[switch - 1] == ("step", 1) and order[switch + 1] == ("step", 2), order
    assert len(facts[0]["replan"]["losses"]) == len(facts[1]["replan"]["losses"]) == 3


def test_a_rank_that_cannot_plan_stops_every_rank_without_a_hang(ddp_runs):
    """Rank 1's budget is below the weights: PlanError there, and the same stop on rank 0."""
    _, facts = ddp_runs
    assert facts[1]["auto_fail"]["raised"] == "PlanError"
    assert "below what the weights alone need" in facts[1]["auto_fail"]["message"]
    assert facts[0]["auto_fail"]["raised"] == "PlanError"
    assert "rank 1: PlanError" in facts[0]["auto_fail"]["message"]


# -- FSDP2 (fully_shard) on gloo ----------------------------------------------------------------


def test_fsdp2_rank_holds_its_shard_of_weights_gradients_and_optimizer_states(fsdp2):
    """Weights, gradients and AdamW states are DTensors: each rank counts its local shard, half here."""
    for result in fsdp2:
        assert result["param_type"] == "DTensor"
        shard = result["full_bytes"] // 2
        assert result["local_param_bytes"] == shard
        live = result["after_optimizer"]["live"]
        assert live["weights"] == shard
        assert live["gradients"] == shard
        assert live["optimizer_states"] == 2 * shard + 4 * result["tensors"]  # exp_avg, exp_avg_sq, step


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
    (``deepspeed_zero.SUITE_TRUTH``; ``benchmarks/engines_accuracy.py`` profiles every run)."""
    out, facts = zero_runs
    for rank, fact in enumerate(facts):
        ours = [r["peak"] for r in timeline(out / name, rank) if r["event"] == "step"]
        truth = fact["auto"][name]["truth_step_peaks"]
        assert len(ours) == len(truth) == 2
        for measured, reference in zip(ours, truth):
            assert abs(measured - reference) / reference <= 0.02, (rank, ours, truth)


ZERO_ENGINES = {"zero2": ("zero2", "none"), "zero3": ("zero3", "none"), "zero3_offload": ("zero3", "optimizer"),
                "zero3_offload_param": ("zero3", "params")}
LONG_RUNS = ["zero2_long", "zero3_long", "zero3_offload_long"]  # deepspeed_zero.LONG_SEQ tokens


@pytest.mark.parametrize("name", ZERO_ENGINES)
def test_the_engine_is_read_before_deepspeed_builds_it(zero_runs, name):
    """RunConfig before train(): the ZeRO stage and offload of the JSON, as the accelerator will build them,
    and which optimizer DeepSpeed will step: the Trainer's, with ``zero_force_ds_cpu_optimizer: false``
    (DeepSpeed's default, true, makes accelerate step ``DeepSpeedCPUAdam``: tests/test_engine.py)."""
    _, facts = zero_runs
    for fact in facts:
        assert (fact[name]["shard"], fact[name]["offload"]) == ZERO_ENGINES[name], fact[name]["engine"]
        assert not fact[name]["cpu_optimizer"] and fact[name]["optimizer_class"] == "AdamW", fact[name]


@pytest.mark.parametrize("name", ["zero1", *ZERO_ENGINES, *LONG_RUNS])
def test_zero_prediction_before_the_engine_exists_matches_the_measured_peak(zero_runs, name):
    """``estimate(trainer)`` before train() (the replay calls no DeepSpeed engine) against each rank's
    measured step peak, within 1%, at 32 tokens (model states dominate) and at 128 (activations do): the
    fp32 master partition, ZeRO-1/2's buckets and gradient partitions as they flow
    (estimation/zero_backward.py), ZeRO-3's resident gradient partition and gathered set, the offload
    gradient partition. Before the flow: ZeRO-1 -2.7% (its bucket), ZeRO-2 +2.1% (a bucket counted
    outside the backward)."""
    out, facts = zero_runs
    for rank, fact in enumerate(facts):
        measured = max(r["peak"] for r in timeline(out / name, rank) if r["event"] == "step")
        error = fact[name]["predicted_peak"] / measured - 1
        assert abs(error) <= 0.01, (name, rank, fact[name]["predicted_peak"], measured)


@pytest.mark.parametrize("name", AUTO_RUNS)
def test_auto_mode_plans_every_zero_engine_and_fits(zero_runs, name):
    """ZeRO-2, ZeRO-3 and ZeRO-3 + offload at 0.7 x the configured per-rank peak (at 128 tokens, where
    activations dominate; at 32 the model states do and no ZeRO-2 plan reaches 0.7 x, below), and
    ZeRO-3 + offload at 0.76 x of the 32-token run (checkpointing and 8-bit AdamW): a plan on every rank
    (none failed), the same on all ranks, each rank's profiler step peaks within the budget, the
    effective batch kept. Failed before ZeRO-2's gradient flow was replayed (estimation/zero_backward.py)
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


def test_zero2_plan_covers_the_flat_copy_gloo_may_still_hold(zero_runs):
    """ZeRO-2's planned run (checkpointing, a micro-batch above 1) peaks in a backward; the flat copy of a
    bucket reduction (``torch.cat``, freed by gloo's worker thread when it drops its reference) is still
    held there in some launches and not in others: on 2 x 4 + checkpointing at 32 tokens rank 0's step 2
    measured 10,809,764 and 11,007,908 B (198,144 B, one 49,536-element ``aten.cat`` among MemWatch's peak
    tensors). The plan's prediction without the planner's margin covers every measured step peak on every
    rank (estimation/zero_backward.py keeps the largest flat copy until the next reduction); before, it
    was 10,997,656 B, under both launches' highest peaks (11,007,908 and 11,032,484)."""
    from hf_memwatch.planning.predict import ESTIMATE_MARGIN

    _, facts = zero_runs
    for fact in facts:
        run = fact["auto"]["zero2_long_auto"]
        plan = run["plans"][0]
        predicted = plan["predicted_peak"] / (1 + ESTIMATE_MARGIN)
        assert plan["activation_checkpointing"] and plan["micro_batch_size"] > 1, plan  # a backward-bound peak
        assert predicted >= max(run["step_peaks"] + run["truth_step_peaks"]), (predicted, run)


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
        assert "At its peak (the optimizer step)" in message, message
        assert "No engine remedy applies" in message and "offload" in message and "reduce bucket" in message, message
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


# -- sharded estimates against hand-worked numbers ----------------------------------------------

# GPT-2 of conftest (n_layer=2, n_embd=128, vocab 1000, n_positions 512, tied lm_head), fp32:
#   wte 1000*128 + wpe 512*128 = 193,536; per block: ln 2*(2*128) + attn (128*384+384) + (128*128+128)
#   + mlp (128*512+512) + (512*128+128) = 198,272; ln_f 256  ->  P = 193,536 + 2*198,272 + 256 = 590,336
P = 590_336
TENSORS = 28  # parameter tensors: AdamW keeps one 4-byte fp32 ``step`` per tensor
BLOCK_BYTES = 4 * 198_272  # the largest repeated layer (a GPT-2 block), fp32


def test_hand_worked_model_size():
    model = gpt2_model()
    assert sum(p.numel() for p in model.parameters()) == P
    assert len(list(model.parameters())) == TENSORS
    assert largest_layer_bytes(model) == BLOCK_BYTES


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_zero_sharding_of_model_states_by_hand(world_size):
    full = {"weights": 4 * P, "gradients": 4 * P, "optimizer_states": 8 * P + 4 * TENSORS,
            "activations": 1000, "temporaries": 10, "other": 5}
    model = gpt2_model()
    ceil = lambda n: -(-n // world_size)  # noqa: E731
    zero1 = shard_classes(full, model, world_size, "zero1", [])
    assert (zero1["weights"], zero1["gradients"], zero1["optimizer_states"]) == (
        4 * P, 4 * P, ceil(8 * P + 4 * TENSORS))
    zero2 = shard_classes(full, model, world_size, "zero2", [])
    assert (zero2["weights"], zero2["gradients"], zero2["optimizer_states"]) == (
        4 * P, ceil(4 * P), ceil(8 * P + 4 * TENSORS))
    zero3 = shard_classes(full, model, world_size, "zero3", [])
    assert (zero3["weights"], zero3["gradients"], zero3["optimizer_states"]) == (
        ceil(4 * P) + 2 * BLOCK_BYTES, ceil(4 * P), ceil(8 * P + 4 * TENSORS))
    for sharded in (zero1, zero2, zero3):  # per-rank work is not sharded
        assert (sharded["activations"], sharded["temporaries"], sharded["other"]) == (1000, 10, 5)
    ddp = shard_classes(full, model, world_size, "none", [])
    assert ddp["gradients"] == 4 * P + 4 * P  # .grad + DDP's buckets


def test_estimate_divides_the_model_states_per_rank():
    """End to end through ``estimate``: the peak-phase classes, single process vs 4 ranks."""
    config = gpt2_model().config
    single = estimate(config, batch_size=8, seq_len=32, optim="adamw_torch")
    zero1 = estimate(config, batch_size=8, seq_len=32, optim="adamw_torch", world_size=4, shard="zero1")
    zero3 = estimate(config, batch_size=8, seq_len=32, optim="adamw_torch", world_size=4, shard="zero3")
    assert single.classes["weights"] == 4 * P
    assert single.classes["optimizer_states"] == 8 * P + 4 * TENSORS
    assert zero1.classes["optimizer_states"] == -(-(8 * P + 4 * TENSORS) // 4)
    assert zero1.classes["weights"] == 4 * P
    assert zero3.classes["weights"] == 4 * P // 4 + 2 * BLOCK_BYTES
    assert zero1.peak_bytes == single.peak_bytes - (single.classes["optimizer_states"]
                                                    - zero1.classes["optimizer_states"])


def test_model_states_against_deepspeed_estimators():
    """Per-rank model states (weights + gradients + optimizer states) against DeepSpeed's estimators.

    DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs`` (no offload) assume mixed precision
    with Adam: 16 bytes per parameter in all, sharded as each stage does. Ours: the single-process
    bf16 estimate's classes with every gradient resident, divided by ``shard_classes``.
    """
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: its estimators cannot be compared")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    model = gpt2_model()
    single = estimate(model.config, batch_size=1, seq_len=8, precision="bf16")
    full = dict.fromkeys(single.classes, 0)
    full.update(weights=single.classes["weights"], gradients=4 * P,
                optimizer_states=single.classes["optimizer_states"])
    for world_size in (2, 4):
        _, gpu2 = estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=world_size, cpu_offload=False)
        _, gpu3, _ = estimate_zero3_model_states_mem_needs(
            P, BLOCK_BYTES // 4, num_gpus_per_node=world_size, cpu_offload=False, cpu_offload_params=False)
        for shard, theirs in (("zero2", gpu2), ("zero3", gpu3)):
            ours = shard_classes(full, model, world_size, shard, [], precision="bf16")
            states = ours["weights"] + ours["gradients"] + ours["optimizer_states"]
            assert abs(states - theirs) / theirs <= 0.05, (shard, world_size, states, theirs)


def test_deepspeed_storages_without_deepspeed_is_empty():
    from hf_memwatch.measure.distributed import deepspeed_storages

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    assert deepspeed_storages(model, optimizer, None) == {"weights": {}, "gradients": {}, "optimizer_states": {}}


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
    argv = ["estimate", str(tmp_path), "--batch-size", "4", "--accum", "2", "--seq-len", str(facts[0][name]["seq_len"]), "--world-size", "2",
            "--shard", shard, "--offload", offload, "--reduce-bucket-size", "1e5", "--json"]
    if shard == "zero3":
        argv += ["--prefetch-bucket-size", "1e5"]
    assert main(argv) == 0
    predicted = json.loads(capsys.readouterr().out)["peak_bytes"]
    auto = facts[0][name]["predicted_peak"]
    assert abs(predicted / auto - 1) <= 0.01, (predicted, auto)
    for rank in (0, 1):
        measured = max(r["peak"] for r in timeline(out / name, rank) if r["event"] == "step")
        assert -0.01 <= predicted / measured - 1 <= 0.03, (predicted, measured)
