"""TRL's DPOTrainer with a copied reference model: estimated and watched as it really runs.

The reference model is resident weights (``weights``, shown apart as ``frozen_models``), the replay
runs DPO's own loss (reference forward included), and both agree with PyTorch's own accounting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from conftest import read_records
from test_equivalence import llama

from hf_memwatch import MemWatch, estimate
from hf_memwatch.core.records import parse_record
from hf_memwatch.estimation.trainer_replay import plain_counters
from hf_memwatch.measure.attribution import weight_storages
from hf_memwatch.testing.tokenizers import word_tokenizer
from hf_memwatch.testing.truth import StepMarker, cpu_memory_profile, step_peaks


def dpo(out: Path, callbacks: list[Any]) -> Any:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    generator = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 1000, (n,), generator=generator))

    data = Dataset.from_list([{"prompt": words(20), "chosen": words(20), "rejected": words(20)} for _ in range(16)])
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=4, max_steps=2, logging_steps=1, report_to=[],
                     save_strategy="no", use_cpu=True, disable_tqdm=True, max_length=64, seed=0)
    return DPOTrainer(model=llama(), ref_model=llama(seed=1), args=args, train_dataset=data,
                      processing_class=word_tokenizer(), callbacks=callbacks)


def test_dpo_reference_model_is_weights_estimated_and_measured(tmp_path: Path) -> None:
    trainer = dpo(tmp_path, [StepMarker(), MemWatch(detail="full", report=False, summary=False)])
    before = plain_counters(trainer)
    predicted = estimate(trainer)
    after = plain_counters(trainer)
    assert {k: v for k, v in before.items() if k != "_signature_columns"} == \
        {k: v for k, v in after.items() if k != "_signature_columns"}  # no trace in the Trainer
    reference = sum(weight_storages(trainer.ref_model, None).values())
    policy = sum(weight_storages(trainer.model, None).values())
    assert predicted.frozen_models == {"ref_model": reference}

    with cpu_memory_profile() as prof:
        trainer.train()
    truth = step_peaks(prof, policy + reference)
    snapshots = [r for r in read_records(tmp_path) if r["event"] == "snapshot"]
    steps = [r for r in read_records(tmp_path) if r["event"] == "step"]
    assert all(s["live"]["weights"] == policy + reference for s in snapshots)
    assert all(s["frozen_models"] == {"ref_model": reference} for s in snapshots)
    for step, peak in zip(steps, truth):
        assert abs(step["peak"] - peak) <= 0.02 * peak, (step["peak"], peak)
    assert abs(predicted.peak_bytes - max(truth)) <= 0.01 * max(truth), (predicted.peak_bytes, truth)
    # The summary names the frozen model inside the weights.
    from hf_memwatch.reporting.summary import build_table

    [meta] = [r for r in read_records(tmp_path) if r["event"] == "meta"]
    typed = [parse_record(r) for r in (*steps, meta, *snapshots)]
    table = build_table(typed[:len(steps)], typed[len(steps)], None, typed[len(steps) + 1:])
    assert "ref_model" in table.caption
