"""TRL's packing and ``pad_to_multiple_of`` (issue 24, point 5): planned for the batches the collator forms.

``SFTConfig(packing=True)`` packs the samples into rows of up to ``max_length`` tokens (best-fit
decreasing) and its padding-free collator puts a micro-batch's rows in one sequence;
``pad_to_multiple_of=16`` pads each batch up to a multiple of 16 (the longest sample, 45 tokens + EOS,
becomes 48). The micro-batch is the whole (packed) dataset, so every batch the run forms is the worst
one: the batch the estimate plans for has the very shape of the batches the dataloader yields, the
estimate is within 1% of the profiler's peak of the run without MemWatch, and the auto mode's run under
a budget below that peak stays within it (packing: the planner splits the packed rows). With
``pad_to_multiple_of`` the batch planned for half the micro-batch is the largest the collator forms at
that size (a shape check: the auto run's plan, a smaller micro-batch, is the same code path).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import read_records
from test_custom_trainer import resident
from test_equivalence import FULL, llama

from hf_memwatch import MemWatch, estimate
from hf_memwatch.estimation.worst_batch import worst_case_batch
from hf_memwatch.testing.tokenizers import word_tokenizer
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak

LENGTHS = (5, 9, 17, 27, 45, 13, 33, 41)


def sft(out: Path, callbacks: list[Any], case: str, **overrides: Any) -> Any:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    generator = torch.Generator().manual_seed(0)
    data = Dataset.from_list([{"input_ids": torch.randint(0, 1000, (n,), generator=generator).tolist()}
                              for n in LENGTHS])
    option = {"packing": True} if case == "packing" else {"pad_to_multiple_of": 16}
    values = dict(output_dir=str(out), per_device_train_batch_size=len(LENGTHS), max_steps=2, logging_steps=1,
                  report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                  max_length=64, activation_checkpointing=False, seed=0, **option)
    values.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(model=llama(), args=SFTConfig(**values), train_dataset=data,
                             processing_class=word_tokenizer(), callbacks=callbacks)
    if case == "packing":  # one micro-batch: every packed row
        trainer.args.per_device_train_batch_size = len(trainer.train_dataset)
        trainer._train_batch_size = trainer.args.train_batch_size
    return trainer


def shapes(batch: Any) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in batch.items() if key in ("input_ids", "labels", "attention_mask")}


@pytest.mark.parametrize("case", ["packing", "pad_to_multiple_of"])
def test_the_plan_is_for_the_batch_the_collator_forms(tmp_path: Path, case: str) -> None:
    trainer = sft(tmp_path / "given", [], case)
    micro = trainer.args.per_device_train_batch_size
    planned, _, note = worst_case_batch(trainer, micro)
    real = [shapes(batch) for batch in trainer.get_train_dataloader()]
    assert real and all(r == shapes(planned) for r in real), (shapes(planned), real, note)
    if case == "packing":
        assert shapes(planned)["input_ids"][0] == 1 and len(trainer.train_dataset) < len(LENGTHS)  # one packed row
    else:
        assert shapes(planned)["input_ids"] == (len(LENGTHS), 48)  # 45 tokens + EOS, padded to 48

    predicted = estimate(trainer).peak_bytes
    with cpu_memory_profile() as prof:
        trainer.train()
    truth = window_peak(prof, resident(trainer.model))
    assert abs(predicted - truth) <= 0.01 * truth, (case, predicted, truth)

    if case == "pad_to_multiple_of":  # a smaller micro-batch, as a plan configures: still padded to 48
        half = micro // 2
        trainer.args.per_device_train_batch_size = half
        trainer._train_batch_size = trainer.args.train_batch_size
        planned, _, note = worst_case_batch(trainer, half)
        real = [shapes(batch) for batch in trainer.get_train_dataloader()]
        assert shapes(planned) == max(real, key=lambda r: r["input_ids"][1]) == {
            k: (half, 48) for k in shapes(planned)}, (shapes(planned), real, note)
        return
    budget = int(0.8 * truth)
    auto = sft(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **FULL)], case)
    with cpu_memory_profile() as prof:
        auto.train()
    assert window_peak(prof, resident(auto.model)) <= budget
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert plan.get("status") is None and plan["source"] == "predicted", plan
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] == micro
