"""The auto mode on TRL's DPOTrainer with a copied reference model.

It plans, the run fits the budget by PyTorch's own accounting, and it is the hand-configured run of
its plan; the reference model's removal (``precompute_ref_log_probs``, a LoRA policy) is advised in
the plan record with the reference's bytes as the saving, never applied; and the picture shows the
reference model as the frozen part of the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import hand_configured, read_records
from test_equivalence import FULL, assert_same_training, llama

from hf_memwatch import MemWatch, estimate
from hf_memwatch.measure.attribution import weight_storages
from hf_memwatch.reporting.report import FROZEN, choose_unit, draw, live_bands, load_run
from hf_memwatch.testing.tokenizers import word_tokenizer
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak


def dpo(out: Path, callbacks: list[Any], **overrides: Any) -> Any:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    generator = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 1000, (n,), generator=generator))

    data = Dataset.from_list([{"prompt": words(12), "chosen": words(12), "rejected": words(12)} for _ in range(4)])
    values = dict(output_dir=str(out), per_device_train_batch_size=2, max_steps=2, logging_steps=1, report_to=[],
                  save_strategy="no", use_cpu=True, disable_tqdm=True, max_length=32, seed=0, dataloader_num_workers=0)
    values.update(overrides)
    return DPOTrainer(model=llama(), ref_model=llama(seed=1), args=DPOConfig(**values), train_dataset=data,
                      processing_class=word_tokenizer(), callbacks=callbacks)


def test_auto_mode_on_dpo_advises_fits_and_is_the_hand_configured_run(tmp_path: Path) -> None:
    probe = dpo(tmp_path / "probe", [])
    given = estimate(probe)
    reference = sum(weight_storages(probe.ref_model, None).values())
    assert given.frozen_models == {"ref_model": reference}
    budget = int(0.85 * given.peak_bytes)
    del probe

    auto = dpo(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **FULL)])
    resident = sum(weight_storages(auto.model, None).values()) + reference
    with cpu_memory_profile() as prof:
        auto.train()
    assert window_peak(prof, resident) <= budget
    records = read_records(tmp_path / "auto")
    [plan] = [r for r in records if r["event"] == "plan"]
    assert (plan["micro_batch_size"], plan["activation_checkpointing"]) != (2, False)  # a plan was needed
    # Advice, with the reference model's bytes as the saving — never applied.
    assert [(a["name"], a["saving"]) for a in plan["advice"]] == [
        ("precompute_ref_log_probs=True, ref_model=None", reference), ("LoRA policy, ref_model=None", reference)]
    assert auto.ref_model is not None and auto.args.precompute_ref_log_probs is False

    hand = dpo(tmp_path / "hand", [], **hand_configured(plan))
    hand.train()
    assert_same_training(auto, hand, steps=2)

    # The picture: the weights split into the reference model (hatched) and the trained model's own.
    [run] = load_run(tmp_path / "auto")
    bands = live_bands(run.snapshots)
    assert [b.name for b in bands[:2]] == [FROZEN, "weights"]
    assert bands[0].values == [reference] * len(run.snapshots)
    assert [f + w for f, w in zip(bands[0].values, bands[1].values)] == [s.live["weights"] for s in run.snapshots]
    fig = draw([run])
    (ax,) = fig.axes
    _, scale = choose_unit(max(budget, *(s["peak"] for s in records if s["event"] == "step")))
    [held] = [c for c in ax.collections if c.get_label() == "weights: frozen models held (ref_model)"]
    assert held.get_hatch() == "//"
    assert held.get_paths()[0].vertices[:, 1].max() == pytest.approx(reference / scale)
    [trained] = [c for c in ax.collections if c.get_label() == "weights (trained model)"]
    assert trained.get_paths()[0].vertices[:, 1].max() == pytest.approx(max(s.live["weights"]
                                                                            for s in run.snapshots) / scale)
