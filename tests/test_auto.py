"""MemWatch(auto=True): plans checked against PyTorch's own CPU accounting on real Trainer runs."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpt2_model, hand_configured, loss_history, read_records, token_dataset, training_args
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Trainer, TrainerCallback

from hf_memwatch import MemWatch, MemWatchConfigError, PlanError
from hf_memwatch.core.run_config import RunConfig, optim_name
from hf_memwatch.planning.chooser import THROUGHPUT_TIE, PeakParts, candidates, plan_run
from hf_memwatch.planning.plan import Plan
from hf_memwatch.testing.truth import StepMarker, cpu_memory_profile, step_peaks

SEQ = 64
LIGHT = {"detail": "light", "report": False, "summary": False}


def model_bytes(model: torch.nn.Module) -> int:
    """Live CPU bytes of the model before the profiled window (the truth's baseline)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def run(out: Path, callbacks: list[Any], *, model_kw: dict[str, Any] | None = None, data_kw: dict[str, Any] | None = None,
        optimizers: Any = (None, None), profiled: bool = True, **args: Any) -> tuple[Trainer, list[int]]:
    """A Trainer run; returns the trainer and the truth peak of each optimizer step (when profiled)."""
    model = gpt2_model(**(model_kw or {}))
    data = token_dataset(**{"n": 64, "seq_len": SEQ, "vocab": 1000, **(data_kw or {})})
    trainer = Trainer(model=model, args=training_args(out, **args), train_dataset=data,
                      callbacks=[StepMarker(), *callbacks], optimizers=optimizers)
    baseline = model_bytes(model)
    if not profiled:
        trainer.train()
        return trainer, []
    with cpu_memory_profile() as prof:
        trainer.train()
    return trainer, step_peaks(prof, baseline)


def plan_records(out: Path) -> list[dict[str, Any]]:
    return [r for r in read_records(out) if r["event"] == "plan"]


def test_over_budget_run_fits_and_equals_the_hand_configured_plan(tmp_path: Path) -> None:
    config = {"per_device_train_batch_size": 8, "max_steps": 2}
    _, unassisted = run(tmp_path / "given", [], **config)
    budget = max(unassisted) // 2

    auto, peaks = run(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **LIGHT)], **config)
    [plan] = plan_records(tmp_path / "auto")
    assert max(peaks) <= budget < max(unassisted)
    assert plan["budget"] == budget and plan["predicted_peak"] <= budget
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] == 8  # effective batch kept
    assert (plan["micro_batch_size"], plan["activation_checkpointing"]) != (8, False)  # a remedy was needed
    assert auto.state.stateful_callbacks["MemWatch"]["attributes"]["auto_plan"] == plan

    hand, _ = run(tmp_path / "hand", [], profiled=False, max_steps=2, **hand_configured(plan))
    assert loss_history(auto) == pytest.approx(loss_history(hand), abs=1e-6)
    assert auto.state.global_step == hand.state.global_step == 2
    lr = [[e["learning_rate"] for e in t.state.log_history if "learning_rate" in e] for t in (auto, hand)]
    assert lr[0] == lr[1]


def test_optimizer_dominated_run_needs_8bit_adamw(tmp_path: Path) -> None:
    # Four wide layers, two short sequences per step: weights, gradients and Adam states dominate.
    big = {"model_kw": {"n_layer": 4, "n_embd": 256}, "data_kw": {"seq_len": 16, "n": 16},
           "per_device_train_batch_size": 2, "max_steps": 2}  # from step 2 on, Adam states are resident
    _, unassisted = run(tmp_path / "given", [], **big)
    # fp32 Adam states are 2x the weights, 8-bit ones about a half (embeddings keep 32-bit states):
    # 15% off the peak needs them.
    budget = int(0.85 * max(unassisted))

    auto, peaks = run(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **LIGHT)], **big)
    [plan] = plan_records(tmp_path / "auto")
    assert plan["optim"] == "adamw_bnb_8bit" and optim_name(auto.args) == "adamw_bnb_8bit"
    assert max(peaks) <= budget

    # The same budget with a custom optimizer: 8-bit AdamW is unavailable, nothing else helps.
    model = gpt2_model(n_layer=4, n_embd=256)
    data = token_dataset(16, 16, 1000)
    trainer = Trainer(model=model, args=training_args(tmp_path / "custom", per_device_train_batch_size=2),
                      train_dataset=data, optimizers=(torch.optim.AdamW(model.parameters()), None),
                      callbacks=[MemWatch(auto=True, budget=budget, **LIGHT)])
    with pytest.raises(PlanError, match=r"(?s)no plan fits .*smallest plan .*- 8-bit AdamW: a custom optimizer.*"
                                        r"advice .*- LoRA \(peft_config=LoraConfig\(r=8\)\): saves up to"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_budget_below_the_weights_is_refused_before_training(tmp_path: Path) -> None:
    model = gpt2_model()
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=token_dataset(8, 16, 1000),
                      callbacks=[MemWatch(auto=True, budget=model_bytes(model) // 2, **LIGHT)])
    with pytest.raises(PlanError, match=r"weights alone need .* missing\. No remedy here"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize(
    "kwargs", [{"auto": "yes"}, {"budget": "lots"}, {"budget": 1.5}, {"budget": -3}, {"budget": True}]
)
def test_bad_arguments_fail_fast(kwargs: dict[str, Any]) -> None:
    with pytest.raises(MemWatchConfigError):
        MemWatch(**kwargs)


class StopAfter(TrainerCallback):
    """Interrupts a run after ``steps`` optimizer steps (its schedule stays that of the whole run)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        control.should_training_stop = state.global_step >= self.steps


def trainer_state(checkpoint: Path) -> dict[str, Any]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    for entry in state["log_history"]:  # wall-clock figures differ between any two runs; memory keys may
        for key in [k for k in entry if k.endswith(("_runtime", "_per_second")) or k.startswith("memory/")]:
            del entry[key]
    return state


RESUMED = {"per_device_train_batch_size": 8, "save_strategy": "steps", "save_steps": 1, "max_steps": 2,
           "auto_find_batch_size": True}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The auto run that the resumed runs must equal, run once (the flag below acts only on a resume)."""
    whole = tmp_path_factory.mktemp("whole")
    run(whole, [MemWatch(auto=True, budget="12MiB", **LIGHT)], profiled=False, **RESUMED)
    return whole


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run stopped after step 1 (its checkpoint-1), run once: each resume below starts from a copy."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    run(out, [MemWatch(auto=True, budget="12MiB", **LIGHT), StopAfter(1)], profiled=False, **RESUMED)
    return out



def without_clock(value):
    """``value`` without the plan's ``planning_seconds`` (each run's own planning time, a clock figure)."""
    if isinstance(value, dict):
        return {k: without_clock(v) for k, v in value.items() if k != "planning_seconds"}
    if isinstance(value, list):
        return [without_clock(v) for v in value]
    return value

@pytest.mark.parametrize("restore_callback", [False, True])
def test_resume_keeps_the_plan_and_the_trainer_state(tmp_path: Path, caplog: Any, restore_callback: bool,
                                                     uninterrupted: Path, stopped: Path) -> None:
    import shutil

    config = {**RESUMED, "restore_callback_states_from_checkpoint": restore_callback}
    whole = uninterrupted
    [plan] = plan_records(whole)
    assert plan["micro_batch_size"] < 8 and plan["configured"]["micro_batch_size"] == 8

    # The same run stopped after step 1, then resumed with the configuration as first given: the
    # saved plan is kept, nothing in the state differs from the uninterrupted run's.
    out = tmp_path / "resumed"
    shutil.copytree(stopped, out)
    watch = MemWatch(auto=True, budget="12MiB", **LIGHT)
    trainer = Trainer(model=gpt2_model(), args=training_args(out, **config), train_dataset=token_dataset(64, SEQ, 1000),
                      callbacks=[watch])
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    resumed = plan_records(out)[-1]
    assert resumed["resumed"] is True and "resumed from checkpoint, kept" in caplog.text
    clock = ("resumed", "planning_seconds")  # the resumed run's own planning time, a clock figure
    assert {k: v for k, v in resumed.items() if k not in clock} == {k: v for k, v in plan.items() if k not in clock}
    assert trainer.args.per_device_train_batch_size == plan["micro_batch_size"]
    assert trainer.args.auto_find_batch_size is True  # kept as the last resort
    assert without_clock(trainer_state(out / "checkpoint-2")) == without_clock(trainer_state(whole / "checkpoint-2"))
    # With restore_callback_states_from_checkpoint the Trainer rebuilt the callback from its state.
    [rebuilt] = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MemWatch)]
    assert (rebuilt is not watch) == restore_callback
    assert without_clock(rebuilt.auto_plan) == without_clock(plan) and rebuilt.auto is True


def test_resume_with_another_batch_configuration_plans_anew(tmp_path: Path, caplog: Any) -> None:
    out = tmp_path / "run"
    config = {"save_strategy": "steps", "save_steps": 1}
    run(out, [MemWatch(auto=True, budget="12MiB", **LIGHT)], profiled=False, max_steps=1,
        per_device_train_batch_size=8, **config)
    [plan] = plan_records(out)
    # Resumed asking for 4 x 4: the saved plan (for 8 x 1) must not replace it.
    trainer = Trainer(model=gpt2_model(), train_dataset=token_dataset(64, SEQ, 1000),
                      args=training_args(out, max_steps=2, per_device_train_batch_size=4,
                                         gradient_accumulation_steps=4, **config),
                      callbacks=[MemWatch(auto=True, budget="12MiB", **LIGHT)])
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    new = plan_records(out)[-1]
    assert "resumed with another configuration" in caplog.text and "resumed" not in new
    assert new["configured"]["micro_batch_size"] == 4 and new["configured"]["gradient_accumulation_steps"] == 4
    assert new["micro_batch_size"] * new["gradient_accumulation_steps"] == 16 != plan["micro_batch_size"] * 1 * 8 // 8
    assert trainer.state.global_step == 2


# -- planner properties (the chooser over any monotone peak model) -------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    micro=st.integers(1, 16), accum=st.integers(1, 8), weights=st.integers(1, 10**6),
    per_sample=st.integers(0, 10**6), ckpt_saving=st.floats(0.05, 0.95), budget=st.integers(1, 4 * 10**7),
    bnb=st.booleans(), with_parts=st.booleans(),
)
def test_chosen_plan_fits_and_keeps_the_effective_batch(micro: int, accum: int, weights: int, per_sample: int,
                                                        ckpt_saving: float, budget: int, bnb: bool,
                                                        with_parts: bool) -> None:
    run_config = RunConfig(micro, accum, seq_len=128, optim="adamw_torch" if bnb else "sgd")

    class Toy:
        calls = 0

        def peak(self, plan: Plan) -> int:
            self.calls += 1
            optimizer_step = 3 * weights + self.states(plan)  # weights, gradients, states and a temporary
            return max(self.forward_backward(plan) + self.states(plan), optimizer_step)

        @staticmethod
        def states(plan: Plan) -> int:
            return weights // 2 if "8bit" in plan.optim else 2 * weights  # fp32 AdamW: 8 B per element

        @staticmethod
        def forward_backward(plan: Plan) -> int:  # without the optimizer states
            saving = (1 - ckpt_saving) if plan.activation_checkpointing else 1
            return int(2 * weights + per_sample * plan.micro_batch_size * saving)

    class ToyWithParts(Toy):
        """The same peaks, and floors: the chooser may rule plans out without predicting them."""

        def parts(self, plan: Plan) -> PeakParts:
            return PeakParts(self.forward_backward(plan), weights // 4)

        floor_parts = parts

    toy = ToyWithParts() if with_parts else Toy()
    result = plan_run(run_config, toy, budget)
    predictions = toy.calls
    everything = candidates(run_config)
    assert {p.key() for p in result.candidates} == {p.key() for p in everything}
    assert all(p.effective_batch == micro * accum for p in everything)  # exactly, never rounded
    assert all(p.optim == "sgd" for p in everything) or bnb  # SGD is never replaced
    chosen = result.chosen
    if chosen is None:
        assert all(toy.peak(p) > budget for p in everything)
    else:
        assert toy.peak(chosen) == chosen.predicted_peak <= budget and chosen.verified
        fitting = [p for p in everything if toy.peak(p) <= budget]
        if toy.peak(Plan.of(run_config)) > budget:  # over budget: the fastest plan that fits
            assert chosen.relative_throughput >= max(p.relative_throughput for p in fitting) - THROUGHPUT_TIE
    # bisection spares predictions: about log2 of the micro-batch options a line, plus the given plan
    lines = len({(p.activation_checkpointing, p.optim) for p in everything})
    options = len({p.micro_batch_size for p in everything})
    assert predictions == result.predictions <= 1 + lines * (2 + math.ceil(math.log2(options)))


class ShortThenLong(torch.utils.data.IterableDataset):
    """Short sequences first, longer ones later: what planning from the first samples cannot foresee."""

    def __init__(self, short: int, n_short: int, long: int, n_long: int) -> None:
        self.lengths = [short] * n_short + [long] * n_long

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for length in self.lengths:
            ids = torch.randint(0, 1000, (length,), generator=generator)
            yield {"input_ids": ids, "labels": ids.clone()}


def test_checkpointing_is_turned_on_between_steps_when_peaks_near_the_budget(tmp_path: Path) -> None:
    data = ShortThenLong(short=16, n_short=8, long=128, n_long=16)
    config = {"per_device_train_batch_size": 4, "max_steps": 4}

    def train(out: Path, watch: MemWatch) -> tuple[Trainer, list[int]]:
        model = gpt2_model()
        args = training_args(out, **config)
        # A one-pass dataset is never read by the planner: it plans for the run's max_length, here
        # (as a user may claim) shorter than what arrives from step 3 on.
        args.max_length = 16
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[StepMarker(), watch])
        with cpu_memory_profile() as prof:
            trainer.train()
        return trainer, step_peaks(prof, model_bytes(model))

    _, unassisted = train(tmp_path / "given", MemWatch(detail="full", report=False, summary=False))
    long_peak = max(unassisted[2:])
    budget = int(long_peak / 0.97)  # the long steps come within 3% of it
    assert max(unassisted[:2]) < 0.8 * budget

    trainer, peaks = train(tmp_path / "auto", MemWatch(auto=True, budget=budget, detail="full", report=False,
                                                       summary=False))
    first, remedy = plan_records(tmp_path / "auto")
    assert first["activation_checkpointing"] is False and first["micro_batch_size"] == 4
    assert remedy["activation_checkpointing"] is True and "between steps" in remedy["reason"]
    assert remedy["micro_batch_size"] == 4 and remedy["budget"] == budget
    assert trainer.model.is_activation_checkpointing
    # Within this run (truth offsets differ between runs by a few MB of unrelated allocations): the
    # step after the remedy needs less, and fits.
    assert peaks[3] < peaks[2] and peaks[3] <= budget


def test_planning_leaves_no_memory_rng_or_gradient_behind(tmp_path: Path) -> None:
    import gc

    from hf_memwatch.integration.auto import AutoMode
    from hf_memwatch.testing.truth import cpu_memory_deltas

    model = gpt2_model()
    trainer = Trainer(model=model, args=training_args(tmp_path, per_device_train_batch_size=4),
                      train_dataset=token_dataset(16, SEQ, 1000))
    records: list[dict[str, Any]] = []
    rng = torch.get_rng_state()
    gc.disable()  # what planning leaves must be freed by itself, not by a lucky collection
    try:
        with cpu_memory_profile() as prof:
            AutoMode("1GiB", lambda record: records.append(record.to_dict())).before_train(trainer)
    finally:
        gc.enable()
    assert sum(delta for _, delta in cpu_memory_deltas(prof)) < 4096
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert not model.is_activation_checkpointing and records[0]["event"] == "plan"
