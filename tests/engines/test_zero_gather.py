"""ZeRO-3's gathering in the forward (``engines/zero/gather.py``): DeepSpeed's coordinator replayed on sizes over
the forward's module calls, and the estimate's forward split at each call on CPU ranks.

The two-rank launch of ``tests/engines/test_deepspeed_zero.py`` checks the all-gathers the replay issues against
those DeepSpeed issued, and its predictions against the profiler; the seeded sweep's ZeRO-3 draws
(``benchmarks/sweep_ranks.py``) the same on other models.
"""

from __future__ import annotations

import torch
from conftest import module_calls

from hf_memwatch import estimate
from hf_memwatch.core.categories import AFTER_FORWARD
from hf_memwatch.engines.engine import Engine
from hf_memwatch.engines.zero.gather import ForwardGathering, forward_gathering, gathering_replayed
from hf_memwatch.estimation.classify import MODULE_WINDOW

ZERO3 = Engine(kind="deepspeed", world_size=2, zero_stage=3, reduce_bucket_size=100_000, prefetch_bucket_size=100_000,
               param_persistence_threshold=0)


def test_a_bucket_is_prefetched_at_each_module_call_and_held_until_its_last_parameter_is_waited():
    """Two 100-element parameters and one of 300, buckets of 150 elements, 2 ranks, fp32."""
    gathering = ForwardGathering([100, 100, 300], [4, 4, 4], set(), world_size=2, bucket=150, max_live=10**9,
                                 staging_slots=2)
    moments = gathering.moments([[], [0], [1], [2]])
    # the root prefetches parameters 0 and 1 (200 elements: the bucket closes at or past 150); the first
    # module waits them (both copied out), the flat output kept for parameter 1, and prefetches parameter 2
    # alone (its own buffer becomes its data); the second drops the first flat output; the third waits the last
    assert [(m.copies, m.flats, m.staging) for m in moments] == [
        (0, 800, 800), (800, 2000, 1200), (800, 1200, 1200), (2000, 0, 0)]
    without_gloo = ForwardGathering([100, 100, 300], [4, 4, 4], set(), 2, 150, 10**9, staging_slots=0)
    assert [m.staging for m in without_gloo.moments([[], [0], [1], [2]])] == [0, 0, 0, 0]


def test_persistent_parameters_are_held_gathered_and_never_fetched():
    gathering = ForwardGathering([10, 100, 100], [4, 4, 4], {0}, world_size=2, bucket=1000, max_live=10**9,
                                 staging_slots=2)
    moments = gathering.moments([[0], [1], [2]])
    assert gathering.resident() == 40
    # the first call prefetches both others in one bucket; the persistent parameter is never in one
    assert moments[0] == type(moments[0])(40, 800, 800)
    assert moments[1].copies == moments[2].copies == 40 + 800


def test_the_live_limit_caps_the_prefetch():
    gathering = ForwardGathering([100, 100, 100], [4, 4, 4], set(), world_size=2, bucket=1000, max_live=150,
                                 staging_slots=2)
    moments = gathering.moments([[], [0], [1], [2]])
    assert moments[0].flats == 800  # 150 elements at most: the bucket closes past it (two parameters)
    assert moments[1].flats == 800 and moments[1].staging == 0  # nothing more while 200 are available


def test_the_replay_issues_what_deepspeed_issued_on_the_sweeps_stablelm():
    """The sweep's seed 45 (StableLM, 3 layers, bf16, prefetch bucket 100,000 elements, 2 gloo ranks): DeepSpeed
    0.19.8 issued two all-gathers in each forward of a complete trace, 101,120 and 138,368 elements, both before
    ``embed_tokens`` ran, and MemWatch's census at the step's high (layer 0) held the first bucket's copies
    (202,240 B) and flat output, the second's flat output and its staging copy (276,736 B)."""
    from hf_memwatch.testing.sweep import Draw, _model

    model = _model(Draw(seed=45, family="stablelm", layers=3, hidden=None, batch=1, seq_len=32, shape="fixed",
                        precision="bf16", optim="adamw_torch_fused", checkpointing="off", accum=2, lora=False))
    model = model.to(torch.bfloat16)
    ids = torch.randint(1, 1000, (1, 32))
    names, trace = module_calls(model, input_ids=ids)
    gathering, _ = forward_gathering(model, ZERO3, "cpu")
    assert gathering.buckets(trace) == [101_120, 138_368]
    moments = dict(zip(names, gathering.moments(trace)))
    at_attention = moments["model.layers.0.self_attn"]
    assert (at_attention.copies, at_attention.flats, at_attention.staging) == (202_240, 202_240 + 276_736, 276_736)
    # the same bytes before the first wait: both outputs and both staging copies
    assert max(m.total for m in moments.values()) == moments["model"].total == at_attention.total
    assert moments["lm_head"].copies == sum(p.numel() * 2 for p in model.parameters())  # all gathered by then


def test_settings_that_release_in_the_forward_keep_the_bound():
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100))
    assert forward_gathering(model, Engine(kind="deepspeed", world_size=2, zero_stage=3, max_live_parameters=1000),
                             "cpu") is None
    assert forward_gathering(model, ZERO3, "cpu") is not None
    assert gathering_replayed(ZERO3, "cpu") and not gathering_replayed(ZERO3, "cuda")
    assert not gathering_replayed(Engine(kind="deepspeed", world_size=2, zero_stage=2), "cpu")


def test_the_estimate_replays_the_gathering_at_each_module_call(monkeypatch):
    """On CPU ranks the estimate splits its forward at each module call and sets the forward's high from the
    gathering there; a peak census (``top_tensors``) gives the same figure (its listing given up, said)."""
    from conftest import gpt2_model

    seen = {}
    import hf_memwatch.engines.zero.gather as gather

    real = gather.zero3_forward_gathering

    def spy(per_phase, windows, model, engine, device, notes):
        seen["labels"] = [label for label, _ in windows[0]] if windows else None
        return real(per_phase, windows, model, engine, device, notes)

    monkeypatch.setattr("hf_memwatch.engines.zero.rules.zero3_forward_gathering", spy)
    model = gpt2_model()
    kwargs = dict(micro_batch_size=1, seq_len=16, world_size=2, shard="zero3", engine=ZERO3, device="cpu")
    plain = estimate(model, **kwargs)
    assert any("forward's gathering replayed" in note for note in plain.notes), plain.notes
    labels = seen["labels"]
    assert labels[0] == "head" and labels[1] == (MODULE_WINDOW, "")  # the root's call first
    assert [name for _, name in labels[1:]] == module_calls(model, input_ids=torch.ones(1, 16, dtype=torch.long),
                                                             labels=torch.ones(1, 16, dtype=torch.long))[0]
    listed = estimate(model, **kwargs, top_tensors=5)
    assert listed.peak_bytes == plain.peak_bytes and listed.phase_peaks[AFTER_FORWARD] == plain.phase_peaks[AFTER_FORWARD]
    assert any(note.startswith("peak tensors not listed") for note in listed.notes)
