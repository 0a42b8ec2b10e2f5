"""MemWatch on real Trainer runs: exact class figures, profiler truth, invariance, robustness."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import (
    ListDataset,
    bert_model,
    gpt2_model,
    loss_history,
    read_records,
    token_dataset,
    training_args,
)
from transformers import Trainer, TrainerCallback

import hf_memwatch.measure.monitor
from hf_memwatch import LIVE_CLASSES, PHASES, MemWatch, MemWatchConfigError
from hf_memwatch.testing.truth import StepMarker, cpu_memory_deltas, cpu_memory_profile, step_peaks


def _unique_bytes(tensors) -> int:
    """Bytes of unique storages, keyed by data pointer (independent of the library's own keying)."""
    storages = {}
    for t in tensors:
        if t is not None:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _snapshots(records, phase=None, step=None):
    return [
        r for r in records
        if r["event"] == "snapshot" and (phase is None or r["phase"] == phase) and (step is None or r["step"] == step)
    ]


def _train(model, out_dir, dataset=None, callbacks=(), **arg_overrides):
    dataset = dataset or token_dataset(32, 64, model.config.vocab_size)
    args = training_args(out_dir, **arg_overrides)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=list(callbacks))
    trainer.train()
    return trainer


# -- exact class figures --------------------------------------------------------------------------


def test_weights_gradients_optimizer_states_are_exact_with_tied_and_frozen_params(out_dir):
    model = gpt2_model()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: must count once
    model.transformer.wpe.weight.requires_grad_(False)  # frozen, PEFT-style
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = _unique_bytes(list(model.parameters()) + list(model.buffers()))
    trainable_bytes = _unique_bytes(trainable)
    _train(model, out_dir, callbacks=[MemWatch(detail="full")], max_steps=2)
    records = read_records(out_dir)

    for snap in _snapshots(records):
        assert snap["live"]["weights"] == weights
        assert sum(snap["live"][k] for k in LIVE_CLASSES) == snap["allocated"]
    for snap in _snapshots(records, "after_backward"):
        assert snap["live"]["gradients"] == trainable_bytes
    first_opt = _snapshots(records, "after_optimizer", step=1)[0]
    step_counters = 4 * len(trainable)  # one fp32 scalar `step` per parameter
    assert first_opt["live"]["optimizer_states"] == 2 * trainable_bytes + step_counters
    assert _snapshots(records, "step_begin", step=1)[0]["live"]["optimizer_states"] == 0
    for snap in _snapshots(records, "step_end"):
        assert snap["live"]["gradients"] == 0  # zero_grad(set_to_none=True)


class _OptimizerStepMarker(TrainerCallback):
    """Brackets ``optimizer.step()`` with a profiler range."""

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.range = torch.profiler.record_function("optimizer_step")
        self.range.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.range.__exit__(None, None, None)


def test_bnb_8bit_optimizer_states_equal_what_bitsandbytes_allocated(out_dir):
    pytest.importorskip("bitsandbytes")
    model = gpt2_model()
    args = training_args(out_dir, max_steps=1, optim="adamw_bnb_8bit")
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(8, 64, 1000),
                      callbacks=[MemWatch(detail="full"), _OptimizerStepMarker()])
    with cpu_memory_profile() as prof:
        trainer.train()
    (start, end), = [(e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "optimizer_step"]
    # What the first (lazily initialising) step left allocated, by PyTorch's own CPU accounting.
    allocated_in_step = sum(delta for t, delta in cpu_memory_deltas(prof) if start <= t <= end)
    optimizer = trainer.optimizer.optimizer
    # bitsandbytes builds its two quantisation maps when the optimizer is constructed and shares them
    # with every parameter's state; everything else is allocated by the first step.
    qmaps = _unique_bytes(optimizer.name2qmap.values())
    snap = _snapshots(read_records(out_dir), "after_optimizer", step=1)[0]
    assert snap["live"]["optimizer_states"] == allocated_in_step + qmaps
    states = optimizer.state.values()
    assert any(v.dtype == torch.uint8 for state in states for v in state.values() if isinstance(v, torch.Tensor))


class MLP(torch.nn.Module):
    """x -> Linear -> ReLU -> Linear, squared-error loss: what autograd saves is easy to work out."""

    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, d_out)

    def forward(self, x, labels):
        out = self.fc2(torch.relu(self.fc1(x)))
        return {"loss": ((out - labels) ** 2).mean()}


def test_mlp_activations_equal_what_autograd_saves(out_dir):
    d_in, hidden, d_out, batch = 48, 96, 8, 4
    torch.manual_seed(0)
    dataset = ListDataset([{"x": torch.randn(d_in), "labels": torch.randn(d_out)} for _ in range(16)])
    _train(MLP(d_in, hidden, d_out), out_dir, dataset=dataset, callbacks=[MemWatch(detail="full")],
           per_device_train_batch_size=batch, max_steps=2)
    # fc1's addmm saves x (the weight is a parameter); relu saves its output, which fc2's addmm saves
    # again (same storage); pow saves (out - labels). Everything fp32.
    expected = 4 * batch * (d_in + hidden + d_out)
    for snap in _snapshots(read_records(out_dir), "after_forward"):
        assert snap["live"]["activations"] == expected
    for snap in _snapshots(read_records(out_dir), "after_backward"):
        assert snap["live"]["activations"] == 0


# -- profiler truth -------------------------------------------------------------------------------


@pytest.mark.parametrize("builder", [gpt2_model, bert_model], ids=["gpt2", "bert"])
def test_step_peaks_within_2_percent_of_profiler_truth(out_dir, builder):
    model = builder()
    labels = "lm" if builder is gpt2_model else "cls"
    dataset = token_dataset(32, 96, model.config.vocab_size, labels=labels)
    args = training_args(out_dir, max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[MemWatch(detail="full"), StepMarker()])
    baseline = _unique_bytes(list(model.parameters()) + list(model.buffers()))
    with cpu_memory_profile() as prof:
        trainer.train()
    truth = step_peaks(prof, baseline)
    ours = [r["peak"] for r in read_records(out_dir) if r["event"] == "step"]
    assert len(ours) == len(truth) == 3
    for measured, reference in zip(ours, truth):
        assert abs(measured - reference) / reference <= 0.02, (ours, truth)


# -- timeline contract ----------------------------------------------------------------------------


def test_timeline_contract_with_accumulation_and_bf16(out_dir):
    model = bert_model()
    dataset = token_dataset(48, 32, model.config.vocab_size, labels="cls")
    _train(model, out_dir, dataset=dataset, callbacks=[MemWatch()], max_steps=5,
           gradient_accumulation_steps=3, bf16=True, logging_steps=4)
    records = read_records(out_dir)
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert [r["detail"] for r in steps] == ["full", "full", "full", "full", "light"]  # 3 first + logging step 4
    for step in range(1, 6):
        snaps = _snapshots(records, step=step)
        assert [s["phase"] for s in snaps] == [
            "step_begin", "after_forward", "after_backward", "after_forward", "after_backward",
            "after_forward", "after_backward", "after_optimizer", "step_end",
        ]
        assert [s["micro_step"] for s in snaps] == [0, 0, 0, 1, 1, 2, 2, 2, 2]
        for snap in snaps:
            assert snap["phase"] in PHASES and snap["device"] == "cpu" and snap["rank"] == 0
            assert set(snap["live"]) == set(LIVE_CLASSES)
            assert sum(snap["live"].values()) == snap["allocated"]
            assert snap["peak"] >= snap["allocated"] and snap["spike"] >= 0
            assert snap["reserved"] is None and snap["allocator_overhead"] is None
        step_record = next(r for r in steps if r["step"] == step)
        peak_snap = max(snaps, key=lambda s: s["peak"])
        assert step_record["peak"] == peak_snap["peak"]
        assert step_record["peak_phase"] == peak_snap["phase"]
    forward = _snapshots(records, "after_forward", step=1)[0]
    assert forward["live"]["activations"] > 0


# -- monitoring does not change training ----------------------------------------------------------


def test_loss_history_identical_with_and_without_memwatch(tmp_path):
    runs = []
    for callbacks in ([], [MemWatch(detail="full")]):
        model = gpt2_model()
        trainer = _train(model, tmp_path / str(len(runs)), callbacks=callbacks, max_steps=4,
                         gradient_accumulation_steps=2)
        runs.append(loss_history(trainer))
    assert len(runs[0]) == 4
    assert runs[0] == runs[1]  # bit for bit


def test_internal_error_leaves_training_intact(tmp_path, monkeypatch, caplog):
    reference = loss_history(_train(gpt2_model(), tmp_path / "ref", max_steps=3))

    def broken(*args, **kwargs):
        raise RuntimeError("injected attribution failure")

    monkeypatch.setattr(hf_memwatch.measure.monitor, "split_live", broken)
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        trainer = _train(gpt2_model(), tmp_path / "broken", callbacks=[MemWatch(detail="full")], max_steps=3)
    assert loss_history(trainer) == reference
    warnings = [r for r in caplog.records if "injected attribution failure" in r.getMessage()]
    assert len(warnings) == 1  # logged once, then monitoring is off
    assert not torch._C._is_torch_function_mode_enabled()
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None  # the tracker left no mode behind


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"detail": "sometimes"}, "detail"),
        ({"full_steps": 0}, "full_steps"),
        ({"full_steps": 2.5}, "full_steps"),
        ({"output_dir": 3}, "output_dir"),
    ],
)
def test_bad_constructor_arguments_fail_fast(kwargs, fragment):
    with pytest.raises(MemWatchConfigError, match=fragment):
        MemWatch(**kwargs)
