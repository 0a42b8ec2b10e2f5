"""Batches as the sampler and collator form them (issue 24, point 5).

A padding-free collator puts the micro-batch's samples in one row: the worst micro-batch is the k
longest samples together, not k copies of the longest (which no batch holds). The length-grouped
sampler batches the longest samples together, padded to the longest. One batch of the whole dataset
per step makes the profiler's peak that very batch's: the estimate is held to it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_equivalence import llama
from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening, Trainer

from hf_memwatch import estimate
from hf_memwatch.testing.estimate_truth import ListDataset
from hf_memwatch.testing.tokenizers import word_tokenizer
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak

LENGTHS = (8, 16, 24, 32, 40, 48, 56, 64)


def dataset() -> ListDataset:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for n in LENGTHS:
        ids = torch.randint(0, 1000, (n,), generator=generator).tolist()
        rows.append({"input_ids": ids})  # both collators make the labels
    return ListDataset(rows)


def model_bytes(model: Any) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def build(out: Path, collator: Any, **args: Any) -> Trainer:
    from conftest import training_args

    return Trainer(model=llama(), args=training_args(out, per_device_train_batch_size=len(LENGTHS), max_steps=2,
                                                     remove_unused_columns=False, **args),
                   train_dataset=dataset(), data_collator=collator)


def truth(trainer: Trainer) -> int:
    baseline = model_bytes(trainer.model)
    with cpu_memory_profile() as prof:
        trainer.train()
    return window_peak(prof, baseline)


def lm_collator() -> Any:
    return DataCollatorForLanguageModeling(tokenizer=word_tokenizer(), mlm=False)


CASES = {
    "DataCollatorWithFlattening": (DataCollatorWithFlattening, {}),
    "group_by_length, padded": (lm_collator, {"train_sampling_strategy": "group_by_length"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_worst_batch_is_one_the_sampler_and_collator_form(tmp_path: Path, case: str) -> None:
    make_collator, args = CASES[case]
    trainer = build(tmp_path, make_collator(), **args)
    predicted = estimate(trainer)
    measured = truth(trainer)
    assert 0.99 * measured <= predicted.peak_bytes <= 1.03 * measured, (case, predicted.peak_bytes, measured)
    assert any(f"the {len(LENGTHS)} longest samples" in note for note in predicted.notes), predicted.notes
