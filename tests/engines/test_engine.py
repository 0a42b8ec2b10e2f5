"""The engine the run really trains under (issue 19): ``hf_memwatch.engines.engine`` and ``RunConfig``.

Single-process checks of the readers; the engines themselves run on 2 gloo ranks in
``tests/engines/test_deepspeed_zero.py`` (DeepSpeed ZeRO-1/2/3 + offload), ``tests/engines/test_distributed.py`` (DDP, FSDP2). FSDP cannot run through the
Trainer on CPU ranks (accelerate builds FSDP on accelerator devices only), so its planning is
tested against accelerate's own ``FullyShardedDataParallelPlugin`` as the accelerator reports it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import gpt2_model, training_args

from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.engines.engine import (
    engine_from_deepspeed_config,
    engine_of,
    engine_of_accelerator,
    engine_of_environment,
)
from hf_memwatch.estimation.estimate import estimate


def test_fsdp_argument_on_cpu_is_planned_as_the_ddp_the_trainer_runs(tmp_path):
    """``fsdp="full_shard"`` on CPU: accelerate runs DDP, so the plan must not assume half-size ranks."""
    args = training_args(tmp_path, fsdp="full_shard")
    run = RunConfig.from_args(args, gpt2_model())
    assert run.shard == "none" and run.engine.kind in ("single", "ddp")
    assert any(why.startswith("fsdp=") and "CPU ranks run DDP" in why for why in run.engine.ignored), run.engine.ignored


def test_launcher_environment_selects_the_engine_by_accelerates_rules():
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false",
           "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}
    on_gpu = engine_of_environment(env, device="cuda", world_size=4)
    assert (on_gpu.kind, on_gpu.fsdp_version, on_gpu.fsdp_strategy, on_gpu.fsdp_wrap) == (
        "fsdp", 2, "SHARD_GRAD_OP", "TRANSFORMER_BASED_WRAP")
    assert on_gpu.cpu_ram_efficient_loading and on_gpu.shard == "fsdp"
    on_cpu = engine_of_environment(env, device="cpu", world_size=2)
    assert on_cpu.kind == "ddp" and on_cpu.shard == "none" and on_cpu.ignored
    ds = engine_of_environment({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                                "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, device="cpu", world_size=2)
    assert (ds.shard, ds.offload) == ("zero3", "optimizer")
    assert engine_of_environment({"ACCELERATE_USE_DEEPSPEED": "true"}, "cpu", 2, use_cpu=True).kind == "ddp"


def test_deepspeed_json_buckets_auto_resolved_as_the_trainer_resolves_them():
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto", "allgather_bucket_size": 2e8,
                                    "offload_param": {"device": "cpu"}},
              "optimizer": {"type": "AdamW"}}
    engine = engine_from_deepspeed_config(config, world_size=2, hidden_size=128)
    assert (engine.reduce_bucket_size, engine.prefetch_bucket_size, engine.param_persistence_threshold) == (
        128 * 128, int(0.9 * 128 * 128), 1280)
    assert engine.allgather_bucket_size == 200_000_000 and engine.offload == "params" and engine.engine_optimizer
    # the Trainer's optim is not what DeepSpeed steps: 8-bit AdamW is no remedy there
    from hf_memwatch.planning.catalogue import unavailable_remedies

    run = RunConfig(micro_batch_size=4, world_size=2, shard="zero3", engine=engine)
    assert "8-bit AdamW" in unavailable_remedies(run)


def test_offload_with_deepspeeds_default_steps_deepspeed_cpu_adam_and_8bit_adamw_is_no_remedy():
    """``offload_optimizer`` without ``zero_force_ds_cpu_optimizer: false``: accelerate replaces the
    Trainer's optimizer by ``DeepSpeedCPUAdam`` (measured on 2 gloo ranks, ZeRO-3: the class DeepSpeed's
    ZeRO optimizer stepped). The planned 8-bit AdamW of ``deepspeed_zero.py``'s ``zero3_offload_auto``
    without the flag trained those fp32 states over its budget: 13,249,436 B a rank, predicted 11,776,558
    with 8-bit states, budget 12,096,114."""
    from hf_memwatch.planning.catalogue import unavailable_remedies

    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    default = engine_from_deepspeed_config(offload, world_size=2)
    own = engine_from_deepspeed_config({**offload, "zero_force_ds_cpu_optimizer": False}, world_size=2)
    assert default.cpu_optimizer and not own.cpu_optimizer
    assert not engine_from_deepspeed_config({"zero_optimization": {"stage": 3}}, world_size=2).cpu_optimizer
    assert not engine_from_deepspeed_config({**offload, "optimizer": {"type": "AdamW"}}, world_size=2).cpu_optimizer
    env = engine_of_environment({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
                                 "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, device="cpu", world_size=2)
    assert env.cpu_optimizer
    unavailable = unavailable_remedies(RunConfig(micro_batch_size=4, world_size=2, shard="zero3", engine=default))
    assert "DeepSpeedCPUAdam" in unavailable.get("8-bit AdamW", ""), unavailable
    assert "8-bit AdamW" not in unavailable_remedies(RunConfig(micro_batch_size=4, world_size=2, shard="zero3",
                                                               engine=own))


def test_fsdp_planned_from_the_engine_the_accelerator_reports(tmp_path, monkeypatch):
    """accelerate's real FSDP2 plugin, as an accelerator on 2 GPUs would hold it: the run is planned sharded."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    plugin = FullyShardedDataParallelPlugin()
    accelerator = SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.FSDP, fsdp_plugin=plugin))
    engine = engine_of_accelerator(accelerator, world_size=2)
    assert (engine.kind, engine.fsdp_version, engine.shard, engine.source) == ("fsdp", 2, "fsdp", "accelerator")
    assert engine.cpu_ram_efficient_loading and not engine.fsdp_cpu_offload
    # The accelerator wins over arguments that say nothing of FSDP
    args = training_args(tmp_path)
    assert engine_of(args, accelerator).shard == "fsdp"
    # ... and over ``fsdp=`` read on CPU ranks as ignored: where the accelerator builds FSDP (forced on CPU
    # ranks by hf_memwatch.testing.fsdp_cpu, as tests/engines/test_distributed.py runs it), nothing is ignored.
    fsdp_args = training_args(tmp_path, fsdp="full_shard")
    assert engine_of(fsdp_args).ignored  # the arguments alone: CPU ranks run DDP
    forced = engine_of(fsdp_args, accelerator)
    assert (forced.kind, forced.ignored) == ("fsdp", ()), forced.ignored
    # bitsandbytes cannot step FSDP2's DTensors (the real 2-rank run fails: tests/engines/test_distributed.py's
    # planner excludes it); FSDP1's flat parameters are plain tensors
    from hf_memwatch.planning.catalogue import unavailable_remedies

    run = RunConfig(micro_batch_size=4, world_size=2, shard="fsdp", engine=forced)
    assert "DTensor" in unavailable_remedies(run).get("8-bit AdamW", "")
    fsdp1 = run.replace(engine=forced.replace(fsdp_version=1))
    assert "DTensor" not in unavailable_remedies(fsdp1).get("8-bit AdamW", "")
    model = gpt2_model()
    run = RunConfig.from_args(args, model, seq_len=32, accelerator=accelerator).replace(world_size=2)
    sharded = estimate(model, **run.estimate_kwargs())
    whole = estimate(model, **run.replace(world_size=1, shard="none").estimate_kwargs())
    assert sharded.classes["optimizer_states"] == pytest.approx(whole.classes["optimizer_states"] / 2, abs=8)


def test_engine_remedies_join_the_catalogue_as_advice_with_their_per_rank_savings():
    """ZeRO stage, offload and the reduce bucket are advice (the plan record, the log, the CLI, the
    post-mortem read ``advice``); the saving follows the predicted per-rank split."""
    from hf_memwatch.engines.engine import Engine
    from hf_memwatch.planning.catalogue import REMEDIES, advice

    model = gpt2_model()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ddp = RunConfig(micro_batch_size=8, world_size=2, engine=Engine(kind="ddp", world_size=2))
    predicted = estimate(model, micro_batch_size=8, seq_len=32, world_size=2, shard="none")
    found = {a.name.split(" ")[0] + " " + a.name.split(" ")[1]: a for a in advice(
        ddp, predicted.frozen_models, 0, predicted.peak_bytes, classes=predicted.classes)}
    states = predicted.classes["optimizer_states"]
    zero1 = found["DeepSpeed ZeRO-1"]
    assert zero1.saving == weights + states - states // 2 - weights // 2 > 0  # buckets + half the states
    # Without the split (a caller that has none) nothing is invented; a single process has no engine remedy.
    assert not advice(ddp, {}, 0, predicted.peak_bytes)
    single = estimate(model, micro_batch_size=8, seq_len=32)
    assert not advice(RunConfig(micro_batch_size=8), {}, 0, single.peak_bytes, classes=single.classes)
    # ZeRO-1 on an accelerator: ZeRO-2 and the optimizer offload; on CPU ranks no offload (host RAM is the device).
    split = {"weights": 4000, "gradients": 4000, "optimizer_states": 12000}
    zero1_cuda = RunConfig(micro_batch_size=8, world_size=2, device="cuda",
                           engine=Engine(kind="deepspeed", world_size=2, zero_stage=1, reduce_bucket_size=100))
    names = {a.name.split(" ")[0]: a.saving for a in engine_advice_of(zero1_cuda, split)}
    assert names == {"ZeRO-2": 4000 - 2000 - 400, "optimizer": 12000}
    assert not [a for a in engine_advice_of(zero1_cuda.replace(device="cpu"), split) if "offload" in a.name]
    # ZeRO-2 with a reduce bucket that weighs in the peak: a quarter of it advised, 3/4 saved.
    zero2 = RunConfig(micro_batch_size=8, world_size=2,
                      engine=Engine(kind="deepspeed", world_size=2, zero_stage=2, reduce_bucket_size=1000))
    (bucket,) = engine_advice_of(zero2, {"weights": 4000, "gradients": 6000, "optimizer_states": 6000})
    assert bucket.name.startswith("reduce_bucket_size=250") and bucket.saving == 4000 - 1000
    # ... where the peak is the backward: ZeRO-2 releases its bucket at the backward's end, so a peak in the
    # optimizer step holds none (measured: the same step peaks with buckets of 100,000 and 25,000 elements).
    assert advice(zero2, {}, 0, 20000, classes={"gradients": 6000}, peak_phase="after_backward")
    assert not advice(zero2, {}, 0, 20000, classes={"gradients": 6000}, peak_phase="after_optimizer")
    # Never a planner's remedy: no catalogue Remedy sets an engine field.
    assert {r.field for r in REMEDIES} == {"micro_batch_size", "activation_checkpointing", "optim"}


def engine_advice_of(run, split):
    from hf_memwatch.planning.catalogue import advice

    return advice(run, {}, 0, 20000, classes=split)
