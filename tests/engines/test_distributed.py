"""Distributed runs (issue 7): real 2-process gloo runs launched with torchrun, and sharded estimates.

The torchrun launch is a module-scoped fixture: DDP (``ddp_trainer.py``, which also runs
``agreement.py``'s scenarios, ``fsdp2_shards.py``'s step and ``fsdp2_trainer.py``'s FSDP2 runs through the
Trainer on its process group); DeepSpeed ZeRO's launch is ``tests/engines/test_deepspeed_zero.py``'s. The scripts
under ``tests/dist_scripts/`` only record facts, the assertions are here. A launch that does not finish in
time is killed (its whole process group) and the test fails with what it printed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpt2_model, torchrun
from conftest import rank_step_peaks as step_peaks
from conftest import rank_timeline as timeline

from hf_memwatch.engines.ddp.split import ddp_split
from hf_memwatch.engines.registry import rules_for
from hf_memwatch.engines.shard import largest_layer_bytes
from hf_memwatch.estimation.estimate import estimate
from hf_memwatch.measure.ranks import (
    agree_plan,
    agree_unavailable,
    decide_across_ranks,
    gather_ints,
    max_over_ranks,
    share_failure,
    world,
)
from hf_memwatch.testing.truth import within_bounds

SCRIPTS = Path(__file__).parents[1] / "dist_scripts"
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


@pytest.fixture(scope="module")
def stream(ddp_runs) -> list[dict[str, Any]]:
    """``stream_ranks.py``'s runs of a token stream read ahead on both ranks, at the end of the DDP launch."""
    out, _ = ddp_runs
    return [json.loads((out / f"stream.rank{rank}.json").read_text()) for rank in (0, 1)]


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
        ours = step_peaks(out / "watch", rank)
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
        ours = step_peaks(out / run, rank)
        truth = facts[rank][run]["truth_step_peaks"]
        assert len(ours) == len(truth) == 3
        for measured, reference in zip(ours, truth):
            assert abs(measured - reference) / reference <= 0.02, (rank, ours, truth)


def test_scalars_figure_is_the_maximum_over_ranks(ddp_runs):
    out, facts = ddp_runs
    peaks = [max(step_peaks(out / "watch", rank)) for rank in (0, 1)]
    assert facts[0]["max_peak_over_ranks"] == facts[1]["max_peak_over_ranks"] == max(peaks)


def test_ddp_estimate_matches_the_measured_rank_peak(ddp_runs):
    """``estimate(world_size=2)`` (DDP, no sharding) against the peak each rank measured."""
    out, facts = ddp_runs
    predicted = estimate(gpt2_model().config, micro_batch_size=8, seq_len=32, world_size=2, shard="none",
                         optim="adamw_torch_fused").peak_bytes
    for rank in (0, 1):
        measured = max(step_peaks(out / "watch", rank))
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
    rank1_peak = max(step_peaks(out / "auto", 1))
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


def test_a_stream_over_its_bound_is_read_ahead_on_every_rank_and_trains_as_without_memwatch(stream):
    """Planned for GPT-2's 2,048 positions nothing fits: each rank reads its copy's first samples ahead, both
    plan on 16 tokens, and the run trains the same batches with the same losses as without MemWatch (was:
    PlanError on every rank, the read-ahead being for one process only)."""
    for rank_facts in stream:
        short, checkpointed, plain = rank_facts["budgets"]
        assert short < checkpointed < plain
        for case in ("checkpointing", "stop"):
            run = rank_facts[case]
            assert run["raised"] is None and run["dataset"] == "ReadAhead", run["raised"]
            first = run["plans"][0]
            assert first["sample"]["seq_len"] == 16 and not first["activation_checkpointing"]
            assert run["losses"] == rank_facts["plain"]["losses"][:len(run["losses"])]
        assert rank_facts["checkpointing"]["lengths"] == rank_facts["plain"]["lengths"]


def test_a_longer_sample_one_rank_reads_switches_every_rank_before_its_step(stream):
    """Rank 0 alone reads the stream while training (accelerate's dispatcher): the ranks agree on its 256-token
    sample at their next agreement and both turn checkpointing on, the same plan, before the first step that
    trains on it."""
    switched = []
    for rank_facts in stream:
        run = rank_facts["checkpointing"]
        assert run["global_step"] == 12
        [_, later] = run["plans"]
        assert later["activation_checkpointing"] and later["predicted_peak"] <= run["budget"]
        assert "a sample of 256 tokens read ahead (rank 0; agreed by all ranks)" in later["reason"]
        assert all(on for on, lengths in zip(run["checkpointing"], run["lengths"], strict=True) if 256 in lengths)
        switched.append(run["checkpointing"].index(True))
    # agreed every 6th step (32 samples read ahead over the 4 a step takes, two in hand): at the end of step 6
    assert switched[0] == switched[1] == 6


def test_a_stream_read_by_dataloader_workers_is_planned_and_agreed_on_every_rank(stream):
    """Read by a dataloader worker: each rank plans on a copy's first samples (nothing of the run's stream read
    here), and the 256-token micro-batches fetched for step 11 are agreed on by both ranks before that step:
    checkpointing on both from step 11, the same losses as without MemWatch (was: PlanError on every rank)."""
    for rank_facts in stream:
        run = rank_facts["workers"]
        assert run["raised"] is None and run["dataset"] == "Tokens" and run["global_step"] == 12, run["raised"]
        first, later = run["plans"]
        assert first["sample"]["seq_len"] == 16 and not first["activation_checkpointing"]
        assert later["activation_checkpointing"] and later["predicted_peak"] <= run["budget"]
        assert "a sample of 256 tokens fetched by the dataloader workers (rank 0; agreed by all ranks)" in later["reason"]
        assert run["checkpointing"] == [False] * 10 + [True] * 2
        assert run["losses"] == rank_facts["plain"]["losses"] and run["lengths"] == rank_facts["plain"]["lengths"]


def test_a_longer_sample_no_plan_fits_stops_every_rank_before_its_step(stream):
    """The 256-token sample fits no plan: both ranks stop after step 10 (its index 40 over the 4 samples every
    step takes from rank 0's copy: 2 ranks x 2), with the same over-budget record, and change nothing before."""
    for rank_facts in stream:
        run = rank_facts["stop"]
        assert run["global_step"] == 10 and all(lengths == [16] for lengths in run["lengths"])
        assert not any(run["checkpointing"])
        [_, later] = run["plans"]
        assert later["status"] == "over_budget" and "training stops before the step" in later["reason"]


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
    zero1 = rules_for("zero1", world_size).split(full, model, world_size, "zero1", [])
    assert (zero1["weights"], zero1["gradients"], zero1["optimizer_states"]) == (
        4 * P, 4 * P, ceil(8 * P + 4 * TENSORS))
    zero2 = rules_for("zero2", world_size).split(full, model, world_size, "zero2", [])
    assert (zero2["weights"], zero2["gradients"], zero2["optimizer_states"]) == (
        4 * P, ceil(4 * P), ceil(8 * P + 4 * TENSORS))
    zero3 = rules_for("zero3", world_size).split(full, model, world_size, "zero3", [])
    assert (zero3["weights"], zero3["gradients"], zero3["optimizer_states"]) == (
        ceil(4 * P) + 2 * BLOCK_BYTES, ceil(4 * P), ceil(8 * P + 4 * TENSORS))
    for sharded in (zero1, zero2, zero3):  # per-rank work is not sharded
        assert (sharded["activations"], sharded["temporaries"], sharded["other"]) == (1000, 10, 5)
    ddp = rules_for("none", world_size).split(full, model, world_size, "none", [])
    assert ddp["gradients"] == 4 * P + 4 * P  # .grad + DDP's buckets
    assert ddp == ddp_split(full, model, world_size, [])  # the registry hands DDP's split to engines/ddp


def test_estimate_divides_the_model_states_per_rank():
    """End to end through ``estimate``: the peak-phase classes, single process vs 4 ranks."""
    config = gpt2_model().config
    single = estimate(config, micro_batch_size=8, seq_len=32, optim="adamw_torch")
    zero1 = estimate(config, micro_batch_size=8, seq_len=32, optim="adamw_torch", world_size=4, shard="zero1")
    zero3 = estimate(config, micro_batch_size=8, seq_len=32, optim="adamw_torch", world_size=4, shard="zero3")
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
    bf16 estimate's classes with every gradient resident, divided by the engine's ``split``.
    """
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: its estimators cannot be compared")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    model = gpt2_model()
    single = estimate(model.config, micro_batch_size=1, seq_len=8, precision="bf16")
    full = dict.fromkeys(single.classes, 0)
    full.update(weights=single.classes["weights"], gradients=4 * P,
                optimizer_states=single.classes["optimizer_states"])
    for world_size in (2, 4):
        _, gpu2 = estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=world_size, cpu_offload=False)
        _, gpu3, _ = estimate_zero3_model_states_mem_needs(
            P, BLOCK_BYTES // 4, num_gpus_per_node=world_size, cpu_offload=False, cpu_offload_params=False)
        for shard, theirs in (("zero2", gpu2), ("zero3", gpu3)):
            ours = rules_for(shard, world_size).split(full, model, world_size, shard, [], precision="bf16")
            states = ours["weights"] + ours["gradients"] + ours["optimizer_states"]
            assert abs(states - theirs) / theirs <= 0.05, (shard, world_size, states, theirs)


def test_deepspeed_storages_without_deepspeed_is_empty():
    from hf_memwatch.engines.zero.live import deepspeed_storages

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    assert deepspeed_storages(model, optimizer, None) == {"weights": {}, "gradients": {}, "optimizer_states": {}}


# -- FSDP2 through the Trainer on gloo (issue 19) --------------------------------------------------
# accelerate builds FSDP for accelerator device types only; ``hf_memwatch.testing.fsdp_cpu`` flips that one
# switch in the launched script, so the Trainer really runs ``fully_shard`` (every ``GPT2Block`` and the
# root), FSDP2's all-gathers, ``resize_(0)`` frees and reduce-scatters. ``dist_scripts/fsdp2_trainer.py``
# (run at the end of the DDP launch) records what FSDP2 holds by its own attributes, the reconciled
# profiler's step peaks, the prediction made before ``train()``, the auto mode's plan and its
# hand-configured run.
PHASES = ("step_begin", "after_forward", "after_backward", "after_optimizer", "step_end")


@pytest.fixture(scope="module")
def fsdp2_runs(ddp_runs) -> tuple[Path, list[dict[str, Any]]]:
    """``fsdp2_trainer.py``'s runs, the last of the DDP launch (in its ``fsdp2_trainer`` folder)."""
    out = ddp_runs[0] / "fsdp2_trainer"
    return out, [json.loads((out / f"fsdp2.rank{rank}.json").read_text()) for rank in (0, 1)]


def test_fsdp2_runs_through_the_trainer_and_is_planned_as_fsdp(fsdp2_runs):
    """The accelerator reports FSDP; the run is read as the FSDP2 it is, with nothing listed as ignored."""
    _, facts = fsdp2_runs
    for rank, fact in enumerate(facts):
        assert fact["world"] == [rank, 2]
        watch = fact["watch"]
        assert watch["distributed_type"] == "DistributedType.FSDP"
        assert watch["engine"].startswith("FSDP2") and watch["shard"] == "fsdp", watch
        assert watch["ignored"] == [], watch["ignored"]
        sharded = watch["holdings"]["1:step_begin"]["sharded"]
        assert 0 < sharded < watch["full_param_bytes"]  # the rank holds its shard, not the model


def test_monitoring_changes_nothing_under_fsdp2(fsdp2_runs):
    _, facts = fsdp2_runs
    for fact in facts:
        assert len(fact["plain"]["losses"]) == 2
        assert fact["watch"]["losses"] == pytest.approx(fact["plain"]["losses"], rel=1e-6)
        assert fact["watch"]["grad_norms"] == pytest.approx(fact["plain"]["grad_norms"], rel=1e-6)
    assert facts[0]["watch"]["losses"] == pytest.approx(facts[1]["watch"]["losses"], rel=1e-6)


@pytest.mark.parametrize("run", ["watch", "no_reshard"])
def test_each_rank_s_classes_equal_what_fsdp2_holds(fsdp2_runs, run):
    """Weights = the rank's shards + the all-gathered unsharded parameters alive (the root's, after the
    forward; every unit's without resharding after it) + FSDP2's kept all-gather result; gradients and
    optimizer states = the local shards. Failed before: the shards of an unsharded module (not in
    ``model.parameters()`` while it is unsharded) were ``other``. Flaky before the ``let_go`` figure (CI
    runs: 803,332 B of all-gather outputs still held by gloo's worker in ``other`` after the forward,
    513,024 B after the backward), which reads what FSDP2 handed off by C++ reference counts."""
    out, facts = fsdp2_runs
    for rank, fact in enumerate(facts):
        holdings = fact[run]["holdings"]
        snapshots = [r for r in timeline(out / run, rank) if r["event"] == "snapshot"]
        assert {r["phase"] for r in snapshots} == set(PHASES)
        for record in snapshots:
            held = holdings[f"{record['step']}:{record['phase']}"]
            live, where = record["live"], (rank, record["step"], record["phase"], record["live"], held)
            weights = held["sharded"] + held["unsharded"] + held["all_gather_buffer"] + held["buffers"]
            assert live["weights"] == weights, where
            assert live["gradients"] == held["gradients"], where
            assert live["optimizer_states"] == held["optimizer_states"], where
            # Left in ``other``: the forward's outputs (logits), the batch and what FSDP2 handed off that
            # was still alive (``let_go``: before and after the snapshot; the live bytes lie between), no
            # engine storage.
            before, after = held["let_go"]
            left = live["other"] - held.get("outputs", 0)
            assert left - after >= 0 and left - before <= 0.01 * record["allocated"], where
        assert holdings["1:after_forward"]["unsharded"] > 0  # the root stays unsharded after the forward
        # the observers saw FSDP2 hand off: every unit's all-gather output, each unit's gradients and input
        assert holdings["1:after_backward"]["handed_off"] > holdings["1:after_forward"]["handed_off"] > 0
        # ... and FSDP2's collectives made storages: the forward's all-gathers, then the backward's reduce-scatters
        assert holdings["1:after_backward"]["made_inside"] > holdings["1:after_forward"]["made_inside"] > 0


def test_the_tracker_sees_fsdp2_s_resize_to_zero_frees(fsdp2_runs):
    """FSDP2 frees its all-gathered parameters with ``UntypedStorage.resize_(0)`` (no operator): the
    tracker knows those storages (it saw them allocated) and counts them at their current size at
    every phase — 0 once resharded after the backward — not at the size they were allocated at."""
    _, facts = fsdp2_runs
    for fact in facts:
        holdings = fact["watch"]["holdings"]
        for key, held in holdings.items():
            assert held["tracked_unsharded"] == held["unsharded"], (key, held)
        after_backward = holdings["2:after_backward"]
        assert after_backward["unsharded"] == 0 and after_backward["tracked_unsharded_storages"] > 0
        assert after_backward["tracked_unsharded_storages"] == after_backward["unsharded_storages"]


@pytest.mark.parametrize("run", ["watch", "no_reshard"])
def test_fsdp2_step_peaks_per_rank_match_the_profiler(fsdp2_runs, run):
    """MemWatch's step peaks against the reconciled profiler (from the model's construction on), within 2%
    of its bounds (each free gloo's worker made unreported, at its earliest and latest possible time:
    ``step_peak_bounds``). Failed before (+3.2% / +2.8%): the blocks' weights saved for backward were
    counted at their gathered size after FSDP2 had resized them to 0. Flaky under CPU load against the
    point figure (the earliest placement): gloo's worker dropped an all-gather output (793,088 B) late,
    after waiting for the GIL, and the truth read under the live bytes MemWatch saw."""
    out, facts = fsdp2_runs
    for rank, fact in enumerate(facts):
        ours, bounds = step_peaks(out / run, rank), fact[run]["truth_step_bounds"]
        assert len(ours) == len(bounds) == 2
        for measured, reference in zip(ours, bounds):
            assert within_bounds(measured, reference, 0.02), (rank, ours, bounds)


def test_fsdp2_prediction_before_the_engine_exists_matches_the_profiler(fsdp2_runs):
    """The prediction made on the Trainer before ``train()`` (no FSDP module yet: the estimator's FSDP2
    replay, ``engines/fsdp2/replay.py``), per rank, against the reconciled profiler: the branch of gloo's
    race that frees each collective's buffers when FSDP drops them (the reconciled truth's placement) within
    3% of every steady step (from step 2 on), and above step 1, whose peak (the backward) comes before its
    optimizer step creates the AdamW states; the estimate itself, the race's worst branch (gloo's two
    workers still holding the last two collectives' buffers: ``Fsdp2Flow._issued``), at or above every
    step's high bound. Failed with the rule before the replay (shards + 2 x the largest layer): 18,049,612 B
    against 17,315,036 B profiled at step 2, +4.2%; the estimate under the high bound where a launch met the
    race before it was replayed (the two-rank sweep's seed 6: -4.26%)."""
    from hf_memwatch.estimation.branches import RACE_FREED, RACE_HELD

    _, facts = fsdp2_runs
    for rank, fact in enumerate(facts):
        watch = fact["watch"]
        predicted, branches, truth = watch["predicted_peak"], watch["branches"], watch["truth_step_bounds"]
        assert branches[RACE_HELD] == predicted and branches[RACE_FREED] < predicted, branches
        freed = branches[RACE_FREED]
        assert truth[0][0] <= freed, (rank, freed, truth)
        for reference in truth[1:]:
            assert within_bounds(freed, reference, 0.03), (rank, freed, truth)
        assert all(high <= predicted for _, high in truth), (rank, predicted, truth)


def test_auto_mode_plans_fsdp2_and_fits(fsdp2_runs):
    """Budget 0.7 x the configured run's step peak on each rank: a plan on every rank (none failed), the
    same on both, each rank's profiler step peaks within the budget, the effective batch kept."""
    out, facts = fsdp2_runs
    plans = []
    for rank, fact in enumerate(facts):
        auto = fact["auto"]
        assert auto["plans"] and all(p.get("status") != "failed" for p in auto["plans"]), auto["plans"]
        assert auto["plan"] is not None
        plans.append(auto["plan"])
        # The profiler's point figure (each late free at its earliest time) and MemWatch's peaks, which see
        # when gloo's worker frees: the high bound keeps a free the worker's idle thread never dates
        # (measured up to one unit's all-gather output, 793,088 B, +6.8%), so it cannot decide the fit.
        lows = [low for low, _ in auto["truth_step_bounds"]]
        assert max(lows) <= auto["budget"], (auto["truth_step_bounds"], auto["budget"], auto["plan"])
        assert max(step_peaks(out / "auto", rank)) <= auto["budget"], (auto["budget"], auto["plan"])
        assert auto["plan"]["micro_batch_size"] * auto["plan"]["gradient_accumulation_steps"] == 4
    assert plans[0] == plans[1]


def test_planned_fsdp2_run_equals_the_hand_configured_run_of_its_plan(fsdp2_runs):
    _, facts = fsdp2_runs
    for fact in facts:
        assert fact["hand"] is not None and len(fact["auto"]["losses"]) == 2
        assert fact["auto"]["losses"] == pytest.approx(fact["hand"]["losses"], rel=1e-6)
        assert fact["auto"]["grad_norms"] == pytest.approx(fact["hand"]["grad_norms"], rel=1e-6)


def test_planned_fsdp2_step_peaks_per_rank_match_the_profiler(fsdp2_runs):
    out, facts = fsdp2_runs
    for rank, fact in enumerate(facts):
        ours, bounds = step_peaks(out / "auto", rank), fact["auto"]["truth_step_bounds"]
        assert len(ours) == len(bounds) == 2
        for measured, reference in zip(ours, bounds):
            assert within_bounds(measured, reference, 0.02), (rank, ours, bounds)


def test_the_fsdp2_plan_s_prediction_matches_its_profiled_run(fsdp2_runs):
    """The agreed plan's predicted peak (the FSDP2 replay of the planned run, the worst branch of gloo's
    race, with the planner's margin) against the profiler's steady step of that run, per rank: at or above
    its high bound; the plan's run configured by hand and estimated directly gives that worst branch, and its other branch (each
    collective's buffers freed when FSDP drops them, as the reconciled truth places those frees) is within
    3% of the reconciled truth."""
    from hf_memwatch.estimation.branches import RACE_FREED, RACE_HELD
    from hf_memwatch.planning.predict import with_margin

    _, facts = fsdp2_runs
    for rank, fact in enumerate(facts):
        auto, hand = fact["auto"], fact["hand"]
        predicted, truth = auto["plans"][-1]["predicted_peak"], auto["truth_step_bounds"]
        assert predicted >= truth[-1][1], (rank, predicted, truth)
        held = hand["branches"][RACE_HELD]
        assert with_margin(held) >= predicted >= held, (rank, hand["branches"], predicted)
        assert within_bounds(hand["branches"][RACE_FREED], truth[-1], 0.03), (rank, hand["branches"], truth)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_reduce_bucket_is_deepspeed_s_whole_bucket_whatever_the_model(stage):
    """DeepSpeed allocates ``torch.empty(int(reduce_bucket_size))`` (stage_1_and_2.py ``setup_buckets``),
    not the gradients' size: its default of 5e8 elements is 2 GB in fp32 on the test GPT-2 of 2.25 MiB.
    Profiled on 2 gloo ranks (2 x 16, no bucket in the JSON): ZeRO-1 2,009,306,148 B (the estimate, the
    replayed flow: 2,009,289,752), and with the optimizer offloaded (no flow: engine_classes' rule)
    ZeRO-1 2,010,330,132 B / ZeRO-2 2,009,306,128 B, where a bucket capped at the trainable parameters
    predicted 11,494,424 / 12,831,248 B."""
    from hf_memwatch.engines.engine import engine_from_deepspeed_config

    model = gpt2_model()
    bucket = 500_000_000 * 4
    for offload in (False, True):
        zero: dict = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
        engine = engine_from_deepspeed_config({"zero_optimization": zero, "zero_force_ds_cpu_optimizer": False}, 2)
        predicted = estimate(model, micro_batch_size=2, seq_len=16, optim="adamw_torch", world_size=2,
                             shard=f"zero{stage}", engine=engine)
        assert bucket <= predicted.classes["gradients"] < bucket + 8 * P, (offload, predicted.classes)
