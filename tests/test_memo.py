"""Planning shortcuts change no figure (``estimation/memo.py``): the same bytes and plans, shortcuts on or off.

The accuracy benchmark's zoo (every architecture, its five settings) estimated one after the other on one
shared fake model gives the golden file's bytes (``tests/data/cpu_estimates.json``); a plan of a
Llama-shaped config on a CUDA target (depth extrapolated, 8-bit AdamW among the candidates) chooses the
same plan, with the same estimates of every plan, with the shortcuts on and off. And the estimate
reports what it cost (``MemoryEstimate.seconds``), the auto mode how long its planning took.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cpu_golden  # noqa: E402

from hf_memwatch import estimate  # noqa: E402
from hf_memwatch.core.run_config import RunConfig  # noqa: E402
from hf_memwatch.estimation import memo  # noqa: E402
from hf_memwatch.estimation.fake_model import auto_class  # noqa: E402
from hf_memwatch.planning.chooser import plan_run  # noqa: E402
from hf_memwatch.planning.predict import EstimatorPredictor  # noqa: E402

GOLDEN = json.loads(cpu_golden.GOLDEN.read_text())
# ``details`` included: the tracker names a storage by its reference, not its address (which a later
# storage may take before the phase closes), so they are reproducible (tests/test_optimizer_swap.py).
NOT_FIGURES = ("seconds", "cpu_seconds")


def figures(estimated) -> dict:
    """Every figure of an estimate (not what it cost)."""
    return {k: v for k, v in dataclasses.asdict(estimated).items() if k not in NOT_FIGURES}


@pytest.mark.parametrize("name", list(cpu_golden.ZOO))
def test_one_shared_fake_model_gives_the_golden_bytes_of_every_zoo_case(name):
    task, make_config = cpu_golden.ZOO[name]
    module = auto_class(task).from_config(make_config())
    cases = [case for case in cpu_golden.cases() if case["name"] == name]
    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_golden.THREADS)
    try:
        with memo.sharing() as cache:
            for case in cases:
                e = estimate(module, task=task, seq2seq_target_len=case["target_len"], micro_batch_size=case["batch_size"],
                             seq_len=case["seq_len"], precision=case["precision"],
                             activation_checkpointing=case["checkpointing"], optim=case["optim"], device="cpu")
                got = dict(peak_bytes=e.peak_bytes, peak_phase=e.peak_phase, classes=e.classes,
                           phase_peaks=e.phase_peaks)
                assert got == GOLDEN[cpu_golden.case_key(case)], cpu_golden.case_key(case)
    finally:
        torch.set_num_threads(threads)
    assert len(cache) == 1  # the five settings replayed on one fake model: the shortcut was taken


def deep_llama() -> LlamaConfig:
    """Deep enough for depth extrapolation (8 layers: 2 and 3 replayed), small enough for the suite."""
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)


def planned(on: bool, run: RunConfig, budget: int):
    with memo.shortcuts(on):
        predictor = EstimatorPredictor(deep_llama(), run)
        result = plan_run(run, predictor, budget)
    return result, predictor


@pytest.mark.parametrize("fields", [{}, {"world_size": 4, "shard": "zero3"}], ids=["single", "zero3"])
def test_a_plan_is_byte_identical_with_the_shortcuts_on_and_off(fields):
    run = RunConfig(micro_batch_size=8, seq_len=256, precision="bf16", device="cuda", **fields)
    given = estimate(deep_llama(), **run.estimate_kwargs())
    budget = int(given.peak_bytes * 0.6)
    old, old_predictor = planned(False, run, budget)
    new, new_predictor = planned(True, run, budget)
    assert old.chosen is not None and new.chosen is not None
    assert old.chosen.as_dict() == new.chosen.as_dict()
    old_peaks, new_peaks = ({p.key(): p.predicted_peak for p in result.candidates if p.predicted_peak is not None}
                            for result in (old, new))
    both = set(old_peaks) & set(new_peaks)  # floors rule out different plans (no checkpointed floor replay)
    assert both and {key: old_peaks[key] for key in both} == {key: new_peaks[key] for key in both}
    for key in set(new_predictor.estimates) & set(old_predictor.estimates):
        assert figures(new_predictor.estimates[key]) == figures(old_predictor.estimates[key]), key
    assert set(new_predictor.floors) <= set(old_predictor.floors)  # chooser._Exact.replayed: fewer floors
    for key, estimated in new_predictor.floors.items():
        assert figures(estimated) == figures(old_predictor.floors[key]), key
    assert old_predictor.models == {} and len(new_predictor.models) == 1  # shared only with the shortcuts on
    # 8-bit AdamW was replayed (chosen or weighed) by both paths: bitsandbytes' table agrees with the Trainer
    assert any(key[3] != run.optim for key in new_predictor.estimates) or new.chosen.optim == run.optim


def test_an_estimate_reports_what_it_cost():
    e = estimate(deep_llama(), micro_batch_size=2, seq_len=64)
    assert e.seconds > 0 and e.cpu_seconds > 0
    assert e.to_dict()["seconds"] == e.seconds


def test_the_auto_mode_says_how_long_it_planned(tmp_path, caplog):
    from conftest import gpt2_model, token_dataset, training_args
    from transformers import Trainer

    from hf_memwatch import MemWatch

    watch = MemWatch(auto=True)
    trainer = Trainer(model=gpt2_model(n_embd=32), args=training_args(tmp_path, max_steps=1),
                      train_dataset=token_dataset(8, 16, 1000), callbacks=[watch])
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hf-memwatch plan: ")]
    assert len(lines) == 1 and re.search(r"; planned in \d+\.\d s$", lines[0]), lines
    record = watch.plan_in_force()
    assert record is not None and record["planning_seconds"] > 0
    assert f"planned in {record['planning_seconds']:.1f} s" in lines[0]


class Toy:
    """A predictor whose forward/backward (``floor_parts``) replays are counted."""

    def __init__(self) -> None:
        self.calls, self.floor_replays = 0, []

    def peak(self, plan) -> int:
        self.calls += 1
        return 100 + 10 * plan.micro_batch_size

    def parts(self, plan):
        from hf_memwatch.planning.chooser import PeakParts

        return PeakParts(forward_backward=50 + 10 * plan.micro_batch_size, trainable_params=1)

    def floor_parts(self, plan):
        self.floor_replays.append(plan.key())
        return self.parts(plan)


def test_no_floor_replays_a_micro_step_already_in_hand():
    from hf_memwatch.planning.chooser import Plan, _Exact

    for on, expected in ((True, []), (False, [(4, 2, False, "paged_adamw_8bit")])):
        toy = Toy()
        exact = _Exact(toy)
        exact(Plan(4, 2, False, "adamw_torch"))  # the micro-step's forward and backward: in hand
        with memo.shortcuts(on):
            assert exact.over(Plan(4, 2, False, "paged_adamw_8bit"), limit=1000, cheap=True) is False
        assert toy.floor_replays == expected


class StepToy(Toy):
    """A toy whose every plan holds 600 B at its optimizer step (``step_floor``), whatever its micro-batch."""

    def peak(self, plan) -> int:
        self.calls += 1
        return 600 + 10 * plan.micro_batch_size

    def step_floor(self, plan) -> int:
        return 600


def test_the_optimizer_step_floor_rules_a_plan_out_without_a_replay():
    from hf_memwatch.planning.chooser import Plan, _Exact

    for on, replays in ((True, 0), (False, 1)):
        toy = StepToy()
        with memo.shortcuts(on):
            assert _Exact(toy).over(Plan(1, 8, True, "adamw_torch"), limit=550) is True
        assert toy.calls == replays  # the floor (600 B) settles it: no prediction (610 B) made


def test_no_floor_replay_before_a_checkpointed_estimate():
    from hf_memwatch.planning.chooser import Plan, _Exact

    for on, expected in ((True, []), (False, [(8, 1, True, "adamw_torch")])):
        toy = Toy()
        with memo.shortcuts(on):
            assert _Exact(toy).over(Plan(8, 1, True, "adamw_torch"), limit=1000, cheap=True) is False
        assert toy.floor_replays == expected
