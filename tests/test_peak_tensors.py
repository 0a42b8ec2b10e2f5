"""The tensors alive at a step's peak: live (CPU tracker) against torch's own tensors and the profiler,
and predicted (the estimator's fake step) against live."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import read_records, token_dataset, training_args
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback

from hf_memwatch import MemWatch, MemWatchConfigError
from hf_memwatch.estimation import estimate
from hf_memwatch.testing.truth import StepMarker, cpu_memory_profile, step_peaks

BATCH, SEQ, VOCAB, HEADS = 2, 128, 1000, 4


def llama_eager(seed: int = 0) -> LlamaForCausalLM:
    """Eager attention: the B x H x S x S scores are real tensors (sdpa fuses them away)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=256)
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


class AttentionWeights(TrainerCallback):
    """torch's own attention probabilities: what each self_attn module returns, by module path."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: dict[str, tuple[list[int], int, torch.dtype]] = {}
        for name, module in model.named_modules():
            if name.endswith("self_attn"):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(module, args, output):
            weights = output[1]
            self.seen[name] = (list(weights.shape), weights.untyped_storage().nbytes(), weights.dtype)
        return hook


def _kinds(tensors, n=10):
    return Counter((tuple(t["shape"]), t["dtype"], t["module"]) for t in tensors[:n])


def test_live_top_tensors_are_torchs_own_and_the_prediction_names_the_same(out_dir):
    model = llama_eager()
    args = training_args(out_dir, max_steps=2, per_device_train_batch_size=BATCH)
    watch = AttentionWeights(model)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(8, SEQ, VOCAB),
                      callbacks=[MemWatch(detail="full", report=False, summary=False), StepMarker()])
    predicted = estimate(trainer, micro_batch_size=BATCH, top_tensors=10)
    baseline = sum({p.untyped_storage()._cdata: p.untyped_storage().nbytes()
                    for p in list(model.parameters()) + list(model.buffers())}.values())
    with cpu_memory_profile() as prof:
        trainer.train()
    truth = step_peaks(prof, baseline)
    records = read_records(out_dir)
    steps = [r for r in records if r["event"] == "step"]
    peaks = [r for r in records if r["event"] == "peak_tensors"]
    assert [r["step"] for r in peaks] == [1, 2]
    for step, peak, reference in zip(steps, peaks, truth):
        # every storage alive at the peak is counted: their sum is the step's peak, the profiler's within 2%
        assert peak["peak"] == step["peak"] and peak["phase"] == step["peak_phase"]
        assert abs(peak["peak"] - reference) / reference <= 0.02, (peak["peak"], reference)
        assert sum(peak["by_class"].values()) == peak["peak"]
        assert sum(g["bytes"] for g in peak["by_operator"]) <= peak["peak"]
        top = peak["tensors"]
        assert len(top) == 20 and [t["bytes"] for t in top] == sorted((t["bytes"] for t in top), reverse=True)
        # logits B x S x V fp32: the loss's log-softmax of them, saved for its backward
        logits = [t for t in top if t["operator"] == "aten._log_softmax"]
        assert [(t["shape"], t["dtype"], t["bytes"], t["class"]) for t in logits] == [
            ([BATCH * SEQ, VOCAB], "fp32", BATCH * SEQ * VOCAB * 4, "activations")]
        # attention scores B x H x S x S fp32 of each layer: the very tensors torch's attention returned
        scores = {t["module"]: (t["shape"], t["bytes"]) for t in top if t["operator"] == "aten._softmax"}
        assert scores == {name: (shape, nbytes) for name, (shape, nbytes, _) in watch.seen.items()}
        assert set(scores) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
        assert all(shape == [BATCH, HEADS, SEQ, SEQ] for shape, _ in scores.values())
    # the prediction: the same top ten (shapes, dtypes, modules) as the measured step with optimizer states
    assert predicted.peak_tensors is not None and predicted.peak_phase == steps[1]["peak_phase"]
    live = [dict(t) for t in peaks[1]["tensors"]]
    assert _kinds([t.__dict__ for t in predicted.peak_tensors.tensors]) == _kinds(live)
    assert {g.name for g in predicted.peak_tensors.by_module[:5]} == {g["name"] for g in peaks[1]["by_module"][:5]}


def test_light_steps_keep_no_census_and_run_no_hook(out_dir):
    seen = []

    class Probe(TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            seen.append(len(torch.nn.modules.module._global_forward_hooks))

        on_pre_optimizer_step = on_substep_end

    model = llama_eager()
    args = training_args(out_dir, max_steps=3, per_device_train_batch_size=BATCH, logging_steps=10)
    Trainer(model=model, args=args, train_dataset=token_dataset(8, 32, VOCAB),
            callbacks=[MemWatch(full_steps=1, report=False, summary=False, top_tensors=5), Probe()]).train()
    records = read_records(out_dir)
    assert [r["step"] for r in records if r["event"] == "peak_tensors"] == [1]
    assert [len(r["tensors"]) for r in records if r["event"] == "peak_tensors"] == [5]
    assert seen == [1, 0, 0]  # the module hooks exist in the tracked step only


def test_top_tensors_zero_writes_none_and_bad_values_fail_fast(out_dir):
    model = llama_eager()
    args = training_args(out_dir, max_steps=1, per_device_train_batch_size=BATCH)
    Trainer(model=model, args=args, train_dataset=token_dataset(4, 32, VOCAB),
            callbacks=[MemWatch(report=False, summary=False, top_tensors=0)]).train()
    assert not [r for r in read_records(out_dir) if r["event"] == "peak_tensors"]
    for bad in (-1, 2.5, True):
        with pytest.raises(MemWatchConfigError, match="top_tensors"):
            MemWatch(top_tensors=bad)
