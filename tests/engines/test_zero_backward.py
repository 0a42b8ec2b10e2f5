"""ZeRO-1/2's gradient flow in the replay (engines/zero/backward.py), without a launch: the partition
against DeepSpeed's own rule, and the buffers the replayed backward holds at its high. The figures
against measured runs are in tests/engines/test_deepspeed_zero.py (the ZeRO module fixture)."""

from __future__ import annotations

import pytest
from conftest import gpt2_model

from hf_memwatch import estimate
from hf_memwatch.engines.engine import Engine
from hf_memwatch.engines.zero.backward import planned_partition, rank_partition, widest_partition
from hf_memwatch.estimation.optim import param_groups

BUCKET = 100_000


@pytest.mark.parametrize("world_size", [2, 4])
def test_kept_parameters_are_deepspeeds_params_in_partition(world_size):
    """Our ``params_in_partition`` per rank against DeepSpeed's ``get_partition_info`` (the padded flat
    group cut in equal partitions), on the Trainer's decay / no-decay groups of the test GPT-2."""
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    groups = [g["params"] for g in param_groups(gpt2_model()) if g["params"]]
    for rank in range(world_size):
        ours = rank_partition(groups, world_size, rank)
        theirs = []
        for group in groups:
            align = 2 * world_size
            size = -(-sum(p.numel() for p in group) // align) * align // world_size
            kept, _, _ = stage_1_and_2.DeepSpeedZeroOptimizer.get_partition_info(None, group, size, rank)
            theirs.extend(kept)
        assert [id(p) for p in ours.kept] == [id(p) for p in theirs], rank
        assert ours.numel == sum(p.numel() for p in theirs)


def test_without_live_ranks_the_widest_partition_is_replayed_and_ranks_differ():
    """No process group (the CLI, a layout asked for): the rank that keeps most. On live ranks each rank's
    estimate keeps its own (the two-rank sweep's seed 2: rank 1 read +3.13% on rank 0's partition, -0.03% on
    its own; exercised on 2 gloo ranks by tests/engines/test_deepspeed_zero.py)."""
    import torch.distributed as dist

    model = gpt2_model()
    assert not dist.is_initialized()
    assert planned_partition(model, 2) == widest_partition(model, 2)
    groups = [g["params"] for g in param_groups(model) if g["params"]]
    assert len({rank_partition(groups, 2, rank).numel for rank in range(2)}) == 2  # the ranks keep different counts


def test_second_micro_step_backward_holds_two_gradient_partitions_and_the_bucket():
    """ZeRO-2, accumulation 2, checkpointing (the plan that missed by -8.3%): at the backward's high the
    replay holds the earlier micro-step's kept partition, this one's ``grads_in_partition`` (both the
    widest rank's kept elements) and the reduce bucket — what MemWatch recorded on the real run's peak
    (``peak_tensors``: two 1,305,600 B ``aten.empty`` and a 400,000 B one on rank 0). Without the flow
    the replay held the single-process ``.grad`` divided by 2 and no such buffer."""
    model = gpt2_model()
    engine = Engine(kind="deepspeed", world_size=2, zero_stage=2, reduce_bucket_size=BUCKET)
    result = estimate(model.config, micro_batch_size=4, gradient_accumulation_steps=2, seq_len=32, activation_checkpointing=True, optim="adamw_torch",
                      world_size=2, shard="zero2", engine=engine, top_tensors=12)
    kept = widest_partition(model, 2).numel
    assert result.peak_phase == "after_backward"
    shapes = [t.shape for t in result.peak_tensors.tensors]
    assert shapes.count([kept]) == 2 and [BUCKET] in shapes, shapes
    # ... counted as gradients (the engine holds them outside .grad), never divided again by the ranks
    assert result.classes["gradients"] == 4 * (2 * kept + BUCKET), result.classes
    # and the peak tensors class them so too (they were "temporaries": freed by the epilogue before the
    # phase's census was read), the listed gradients summing to the class
    held = [t for t in result.peak_tensors.tensors if t.shape in ([kept], [BUCKET])]
    assert {t.cls for t in held} == {"gradients"}, [(t.shape, t.cls) for t in held]
    assert result.peak_tensors.by_class["gradients"] == result.classes["gradients"]
    # the states are listed as the replay holds them, whole; the rank holds its partition of them: said
    assert result.peak_tensors.by_class["optimizer_states"] > result.classes["optimizer_states"]
    assert any(note.startswith("peak tensors: the replayed step's") for note in result.notes), result.notes
    single = estimate(model.config, micro_batch_size=4, seq_len=32, optim="adamw_torch", top_tensors=12)
    assert not any(note.startswith("peak tensors") for note in single.notes)
    # ZeRO-1 keeps the whole .grad between micro-steps: no partition before the boundary's reduction.
    zero1 = estimate(model.config, micro_batch_size=4, gradient_accumulation_steps=2, seq_len=32, activation_checkpointing=True, optim="adamw_torch",
                     world_size=2, shard="zero1", engine=engine.replace(zero_stage=1), top_tensors=12)
    assert zero1.peak_phase == "after_backward"
    assert [kept] not in [t.shape for t in zero1.peak_tensors.tensors], [t.shape for t in zero1.peak_tensors.tensors]


@pytest.mark.parametrize(("count", "bucket_numel"), [(4, 200), (6, 150), (6, 100)])
def test_flat_copies_are_deepspeeds_chunks(count, bucket_numel):
    """``flat_copies`` against DeepSpeed's own ``allreduce_and_scatter`` (the default multi-rank all-reduce):
    the chunks it hands to one all-reduce, each flattened by torch's ``_flatten_dense_tensors`` (a copy for
    two slices or more, the slice's own view for one). Before 2026-12-04 the replay copied the largest
    destination's slices alone (seed 12 of the two-rank sweep: 82,560 of the 97,024 elements copied)."""
    import torch
    from torch._utils import _flatten_dense_tensors

    from hf_memwatch.engines.zero.backward import _slices, flat_copies

    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (60, 30, 20, 50, 90, 5)]
    size = 128  # the group's 255 elements padded to 256, 2 partitions
    spans, offset = {}, 0
    for param in params:
        spans[id(param)] = (offset, size)
        offset += param.numel()
    pending = params[:count]  # slices 128 (rank 0) and 32 / 127 (rank 1)
    flat = torch.zeros(sum(p.numel() for p in pending))
    slices, at = [], 0
    for numel, rank in _slices(pending, spans, 2):
        slices.append((rank, flat.narrow(0, at, numel)))
        at += numel
    chunks: list[list[torch.Tensor]] = []

    class Optimizer:  # the one method allreduce_and_scatter calls on its optimizer, recording each chunk
        def allreduce_and_copy_with_multiple_ranks(self, small_bucket, *args, **kwargs):
            chunks.append(list(small_bucket))

    stage_1_and_2.DeepSpeedZeroOptimizer.allreduce_and_scatter(Optimizer(), slices, torch.float32,
                                                               numel_per_bucket=bucket_numel, divide=False)
    theirs = []
    for chunk in chunks:
        flattened = _flatten_dense_tensors(chunk)
        if flattened.data_ptr() != chunk[0].data_ptr() or len(chunk) > 1:
            theirs.append(flattened.numel())
    assert flat_copies(pending, spans, 2, bucket_numel) == theirs
    if bucket_numel > 100:  # one chunk of both destinations' slices: more than either destination's
        assert theirs == [sum(p.numel() for p in pending)]
    else:  # each chunk passes the bucket with its first slice: views, no copy
        assert theirs == []


def test_the_multi_rank_all_reduce_is_deepspeeds_default_and_read_from_the_json():
    """DeepSpeed's default for ``use_multi_rank_bucket_allreduce`` (the flat copy's size depends on it)."""
    config = pytest.importorskip("deepspeed.runtime.zero.config")
    from hf_memwatch.engines.engine import engine_from_deepspeed_config

    assert config.DeepSpeedZeroConfig().use_multi_rank_bucket_allreduce is True
    assert Engine().multi_rank_bucket_allreduce is True
    json = {"zero_optimization": {"stage": 2, "use_multi_rank_bucket_allreduce": False}}
    assert engine_from_deepspeed_config(json, world_size=2).multi_rank_bucket_allreduce is False


def test_a_direct_estimate_gives_both_branches_of_the_flat_copys_race_and_a_plan_the_worst():
    """The reduction's flat copy is let go by gloo's thread after or before the training thread's next
    allocations (``flat_copies``): the estimate is the branch that holds it, ``branches`` gives both peaks.
    Held, the copy alive at the step's high is one of the peak tensors, and the branch that frees it first
    peaks lower, by at most that copy. A plan's estimates (inside
    ``memo.sharing``) replay the worst branch alone: the same peak, no branches. Without a race (ZeRO-3,
    no bucket flow) there are none. (The branches against the profiler's bounds on 2 gloo ranks: the
    two-rank sweep, ``benchmarks/results/sweep.md``.)"""
    from hf_memwatch.estimation.branches import RACE_FREED, RACE_HELD
    from hf_memwatch.estimation.memo import sharing

    model = gpt2_model()
    engine = Engine(kind="deepspeed", world_size=2, zero_stage=2, reduce_bucket_size=BUCKET)
    kwargs = dict(micro_batch_size=4, gradient_accumulation_steps=2, seq_len=32, activation_checkpointing=True,
                  optim="adamw_torch", world_size=2, shard="zero2", engine=engine)
    result = estimate(model.config, top_tensors=60, **kwargs)
    held, freed = result.branches[RACE_HELD], result.branches[RACE_FREED]
    assert held == result.peak_bytes and freed < held, result.branches
    # the copy held at the high: a flat buffer of the flow's smaller than the bucket (49,536 elements here;
    # the others are the bucket and the kept partitions); freed first, the high is another moment's,
    # between the held one less the copy and the held one
    copies = [t for t in result.peak_tensors.tensors
              if t.operator == "aten.empty" and len(t.shape) == 1 and t.shape[0] < BUCKET]
    assert len(copies) == 1 and held - copies[0].bytes <= freed, [(t.shape, t.bytes) for t in copies]
    assert any("race: zero2" in note and f"{freed:,} B" in note for note in result.notes), result.notes
    with sharing():
        planned = estimate(model.config, **kwargs)
    assert planned.peak_bytes == held and planned.branches == {}
    assert any("not replayed for a plan" in note for note in planned.notes)
    zero3 = estimate(model.config, **{**kwargs, "shard": "zero3", "engine": engine.replace(zero_stage=3)})
    assert zero3.branches == {} and not any(note.startswith("race") for note in zero3.notes)


def test_without_live_ranks_each_ranks_partition_is_replayed_and_the_highest_kept(monkeypatch):
    """A layout asked for without its ranks (the CLI): each rank's partition is replayed and the estimate is
    the highest rank's, which need not be the rank that keeps most (its buffer is made when its first kept
    gradient arrives: the two-rank sweep's seed 28 peaks 13% higher on the rank that keeps fewer). On 4
    ranks of the test GPT-2 the widest partition's replay alone is under the highest rank's."""
    from hf_memwatch.engines.zero import backward

    model = gpt2_model()
    engine = Engine(kind="deepspeed", world_size=4, zero_stage=2, reduce_bucket_size=BUCKET)
    kwargs = dict(micro_batch_size=4, gradient_accumulation_steps=2, seq_len=32, activation_checkpointing=True,
                  optim="adamw_torch", world_size=4, shard="zero2", engine=engine,
                  device="cuda")  # NCCL's ranks: no race of gloo's workers, whose held blocks tie ranks 1 and 2
    result = estimate(model.config, **kwargs)
    note = next(note for note in result.notes if "without live ranks" in note)
    ranks = {int(part.split(":")[0].split()[-1]): int(part.split(":")[1].strip().split()[0].replace(",", ""))
             for part in note.split("(")[1].split(")")[0].split(", ")}
    assert sorted(ranks) == [0, 1, 2, 3] and result.peak_bytes == max(ranks.values()), note
    widest = widest_partition(model, 4).rank
    assert ranks[widest] < result.peak_bytes, (widest, ranks)  # the widest is not the highest here
    monkeypatch.setattr(backward, "MAX_RANKS_REPLAYED", 2)  # beyond the cap: the widest partition alone
    alone = estimate(model.config, **kwargs)
    assert alone.peak_bytes == ranks[widest] and not any("partitions replayed" in n for n in alone.notes)
    assert any("replayed alone; another rank may peak higher" in n for n in alone.notes), alone.notes


def test_an_earlier_micro_steps_last_collectives_are_held_into_the_next_forward_on_gloo(monkeypatch):
    """Gloo's race across micro-steps (``ZeroGradientFlow._issued``): the earlier micro-step's backward is
    replayed as it runs and, on its worst branch, its last two collectives' tensors — here the bucket (a
    one-slice chunk's view) and a flat copy — are alive when the next micro-step's forward begins (the
    two-rank sweep's seed 2: the bucket alive into the forward in 1 of 3 launches, -3.50% before). They
    stay until that backward's reductions: the held branch is over the freed-first one by exactly their
    bytes. The branch that frees first holds none; NCCL's ranks (CUDA) meet no race."""
    from hf_memwatch.engines.zero import backward

    held_at_forward: list[list[int]] = []
    on_forward = backward.ZeroGradientFlow._on_forward

    def recording(self, *args):
        held_at_forward.append([t.untyped_storage().nbytes() for t in self.work_held])
        return on_forward(self, *args)

    monkeypatch.setattr(backward.ZeroGradientFlow, "_on_forward", recording)
    engine = Engine(kind="deepspeed", world_size=2, zero_stage=2, reduce_bucket_size=BUCKET)
    kwargs = dict(micro_batch_size=4, seq_len=32, optim="adamw_torch", world_size=2, shard="zero2", engine=engine)
    result = estimate(gpt2_model().config, gradient_accumulation_steps=2, **kwargs)
    first, second, *freed = held_at_forward[:4]  # the held replay's two forwards, then the freed-first replay's
    assert first == [] and len(second) == 2 and 4 * BUCKET in second, held_at_forward
    assert all(held == [] for held in freed), held_at_forward
    assert result.branches["held"] - result.branches["freed first"] == sum(second), (result.branches, second)
    held_at_forward.clear()
    estimate(gpt2_model().config, gradient_accumulation_steps=1, **kwargs)
    assert held_at_forward and all(held == [] for held in held_at_forward)  # one micro-step: none carried
    held_at_forward.clear()
    nccl = estimate(gpt2_model().config, gradient_accumulation_steps=2, device="cuda", **kwargs)
    assert not nccl.branches and all(held == [] for held in held_at_forward), nccl.branches
