"""The seeded sweep's two-rank draws (issue 37, ``benchmarks/sweep_ranks.py``) and what they fixed.

The draws themselves run in ``make bench`` (a torchrun launch, about 5 s a draw); here the draws'
coverage, and FSDP's own activation checkpointing (``fsdp_config["activation_checkpointing"]``) as the
estimate and the auto mode read it: the sweep measured +30.4% and +41.3% on two FSDP2 draws before
(the switch ignored), -0.03% after.
"""

from __future__ import annotations

from conftest import benchmark_script, gpt2_model, training_args

from hf_memwatch.engines.engine import own_checkpointing
from hf_memwatch.estimation.trainer_mirror import disable_checkpointing, enable_checkpointing
from hf_memwatch.integration.apply import apply_plan
from hf_memwatch.planning.plan import Plan


def test_the_draws_cover_every_engine_and_fsdp_own_checkpointing() -> None:
    sweep = benchmark_script("sweep_ranks")
    draws = [sweep.draw_ranks(seed) for seed in range(24)]
    assert draws == [sweep.draw_ranks(seed) for seed in range(24)]
    assert {d.engine for d in draws} == set(sweep.ENGINES)
    assert any(d.checkpointing == "fsdp" for d in draws) and any(d.precision == "bf16" for d in draws)
    assert not any(d.checkpointing == "fsdp" and not d.engine.startswith("fsdp2") for d in draws)


def test_the_stream_draws_are_one_per_engine_from_an_iterable_dataset_without_length() -> None:
    import torch

    sweep = benchmark_script("sweep_ranks")
    streams = [sweep.draw_ranks(seed) for seed in range(sweep.STREAM_FROM, sweep.STREAM_FROM + len(sweep.ENGINES))]
    assert all(d.stream for d in streams) and [d.engine for d in streams] == list(sweep.ENGINES)
    assert not any(sweep.draw_ranks(seed).stream for seed in range(sweep.STREAM_FROM))
    rows = [{"input_ids": torch.arange(4)}] * 3
    data = sweep._stream(rows)
    assert isinstance(data, torch.utils.data.IterableDataset) and not hasattr(data, "__len__")
    assert list(data) == rows and list(data) == rows  # read again each epoch


def _fsdp_args(tmp_path, **more):
    return training_args(tmp_path, fsdp="full_shard", fsdp_config={"fsdp_version": 2, "activation_checkpointing": True},
                         **more)


def test_fsdp_own_checkpointing_is_replayed_as_accelerate_wraps_the_units(tmp_path) -> None:
    """accelerate's ``fsdp2_apply_ac``: ``checkpoint_wrapper(layer, preserve_rng_state=False)``, non-reentrant."""
    args = _fsdp_args(tmp_path)
    assert own_checkpointing(args) and not own_checkpointing(training_args(tmp_path))
    model = gpt2_model()
    assert enable_checkpointing(model, args)
    (layer,) = {m._gradient_checkpointing_func.keywords.get("preserve_rng_state") for m in model.modules()
                if getattr(m, "gradient_checkpointing", False)}
    assert layer is False
    disable_checkpointing(model)
    assert enable_checkpointing(model, training_args(tmp_path))  # the Trainer's own: torch's default RNG state kept
    assert all("preserve_rng_state" not in m._gradient_checkpointing_func.keywords for m in model.modules()
               if getattr(m, "gradient_checkpointing", False))


def test_a_plan_with_checkpointing_leaves_the_trainer_switch_off_under_fsdp_own(tmp_path) -> None:
    """transformers refuses both switches together (ValueError when typed by hand): the auto mode must not set them."""
    from conftest import token_dataset
    from transformers import Trainer

    trainer = Trainer(model=gpt2_model(), args=training_args(tmp_path), train_dataset=token_dataset(8, 16, 1000))
    trainer.args = _fsdp_args(tmp_path)  # one process cannot build FSDP: the arguments a launched rank would hold
    apply_plan(trainer, Plan(2, 2, True, "adamw_torch"))
    assert not trainer.args.activation_checkpointing
    assert trainer.args.per_device_train_batch_size == 2


def test_zero2_offload_counts_deepspeed_staging_buffers_of_the_largest_parameter() -> None:
    """ZeRO-1/2 + offload_optimizer (stage_1_and_2.py ``__init__``): two buffers of the largest parameter's
    numel. Measured by the sweep (2 gloo ranks): MemWatch's step-2 peaks 512,000 B under the profiler on 3
    draws (two 64,000-element embeddings x 4 B x 2 buffers), exact to the byte after; the estimate -22.6%
    -> -5.9% (qwen2), -9.47% -> -0.09% (phi3)."""
    import torch

    from hf_memwatch.engines.engine import Engine
    from hf_memwatch.engines.zero.live import _DEEPSPEED_ATTRIBUTES
    from hf_memwatch.engines.zero.split import engine_classes

    model = torch.nn.Sequential(torch.nn.Linear(100, 10), torch.nn.Linear(10, 10))
    classes = {"weights": 0, "gradients": 0, "optimizer_states": 0, "activations": 0, "temporaries": 0, "other": 0}
    plain = Engine(kind="deepspeed", world_size=2, zero_stage=2, reduce_bucket_size=10)
    offload = Engine(kind="deepspeed", world_size=2, zero_stage=2, reduce_bucket_size=10, offload_optimizer="cpu")
    grads = engine_classes(classes, model, offload, [])[0]["gradients"] - engine_classes(classes, model, plain, [])[0]["gradients"]
    numel = sum(p.numel() for p in model.parameters())
    assert grads == 4 * numel // 2 + 2 * 1000 * 4  # the fp32 gradient partition + 2 x the 1,000-element weight
    assert {"temp_grad_buffer_for_cpu_offload", "temp_grad_buffer_for_gpu_offload"} <= set(_DEEPSPEED_ATTRIBUTES["gradients"])


def test_zero_offload_rank_counts_the_16_bit_partition_buffer() -> None:
    """ZeRO-1/2 + offload_optimizer (stage_1_and_2.py ``__init__``): a host buffer of the rank's 16-bit
    partition per group (``param_buffer_of_bit16_for_cpu_offload_groups``), allocated before tracking starts.
    Measured by the sweep (2 gloo ranks): MemWatch's step peaks 4.75% / 7.40% / 5.82% under the profiler on
    seeds 4 / 20 / 36 without it, 0.00% with it."""
    import torch

    from hf_memwatch.engines.zero.live import deepspeed_storages

    zero_class = type("DeepSpeedZeroOffloadStandIn", (), {"__module__": "deepspeed.runtime.zero.stage_1_and_2"})
    zero = zero_class()
    buffer = torch.zeros(300, dtype=torch.bfloat16)
    zero.bit16_groups_flat = [torch.zeros(600, dtype=torch.bfloat16)]
    zero.param_buffer_of_bit16_for_cpu_offload_groups = [buffer]
    weights = deepspeed_storages(None, zero, None)["weights"]
    assert sum(weights.values()) == 2 * 600 + 2 * 300
