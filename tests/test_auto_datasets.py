"""The auto mode on any dataset: it never consumes the user's iterator, reads any sample shape, and a
planning failure is said (a WARNING and a ``plan`` record with the reason), never silent."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from conftest import gpt2_model, read_records, training_args
from transformers import Trainer

from hf_memwatch import MemWatch

LIGHT = {"detail": "light", "report": False, "summary": False}


class OnePass(torch.utils.data.IterableDataset):
    """A stream that can be read once (a generator, a socket): every item read is counted."""

    def __init__(self, items: int, length: int) -> None:
        self.items, self.length, self.read = items, length, 0
        self.iterators = 0

    def __iter__(self):
        self.iterators += 1
        if self.iterators > 1:
            raise RuntimeError("a one-pass stream was iterated twice")
        generator = torch.Generator().manual_seed(0)
        for _ in range(self.items):
            self.read += 1
            ids = torch.randint(0, 1000, (self.length,), generator=generator)
            yield {"input_ids": ids, "labels": ids.clone()}


def test_one_pass_dataset_is_never_read_by_the_planner(tmp_path: Path) -> None:
    data = OnePass(items=32, length=16)
    args = training_args(tmp_path, per_device_train_batch_size=4, max_steps=8)
    args.max_length = 16  # the run's declared longest sample: what a stream is planned for
    trainer = Trainer(model=gpt2_model(), args=args, train_dataset=data,
                      callbacks=[MemWatch(auto=True, budget="1GiB", **LIGHT)])
    trainer.train()
    assert trainer.state.global_step == 8 and data.iterators == 1 and data.read == 32
    [plan] = [r for r in read_records(tmp_path) if r["event"] == "plan"]
    assert plan.get("status") != "failed" and plan["sample"]["seq_len"] == 16
    assert any("not read" in note or "iterable" in note.lower() for note in plan["sample"]["notes"])


class Samples(torch.utils.data.Dataset):
    """Map-style samples of one of the shapes users hand the Trainer."""

    def __init__(self, shape: str, rows: int = 32, length: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = []
        for _ in range(rows):
            ids = torch.randint(0, 1000, (length,), generator=generator)
            if shape == "0-d labels":  # a scalar label per sample (sequence classification)
                row: dict[str, Any] = {"input_ids": ids, "labels": torch.tensor(1)}
            elif shape == "numpy":
                row = {"input_ids": ids.numpy(), "labels": ids.numpy().copy()}
            else:  # "lists"
                row = {"input_ids": ids.tolist(), "labels": ids.tolist()}
            self.rows.append(row)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


def bert_classifier() -> Any:
    from conftest import bert_model

    return bert_model(num_layers=1, hidden=64)


def test_every_sample_shape_is_planned(tmp_path: Path, caplog: Any) -> None:
    for shape in ("0-d labels", "numpy", "lists"):
        out = tmp_path / shape.replace(" ", "_")
        model = bert_classifier() if shape == "0-d labels" else gpt2_model()
        trainer = Trainer(model=model, args=training_args(out, per_device_train_batch_size=4, max_steps=2),
                          train_dataset=Samples(shape), callbacks=[MemWatch(auto=True, budget="1GiB", **LIGHT)])
        with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
            trainer.train()
        [plan] = [r for r in read_records(out) if r["event"] == "plan"]
        assert plan.get("status") != "failed", (shape, plan["reason"])
        assert plan["sample"]["seq_len"] == 16 and plan["predicted_peak"] > 0, shape
        assert trainer.state.global_step == 2
    assert "planning failed" not in caplog.text


class NoConfigModel(torch.nn.Module):
    """A model the estimator cannot replay (its forward hands a tensor to numpy)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 16)
        self.head = torch.nn.Linear(16, 1000)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if np.asarray(input_ids.numpy()).max() > 10**6:  # values read through numpy: no fake tensor has them
            raise ValueError("token id out of range")
        logits = self.head(self.embed(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def test_a_model_the_estimator_cannot_replay_is_planned_from_measurements(tmp_path: Path, caplog: Any) -> None:
    data = Samples("lists")
    trainer = Trainer(model=NoConfigModel(), args=training_args(tmp_path, per_device_train_batch_size=4, max_steps=2),
                      train_dataset=data, callbacks=[MemWatch(auto=True, budget="1GiB", **LIGHT)])
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        trainer.train()
    assert trainer.state.global_step == 2  # the run goes on, planned from micro-steps measured live
    [plan] = [r for r in read_records(tmp_path) if r["event"] == "plan"]
    assert plan.get("status") is None and plan["source"] == "measured" and "measured" in plan["reason"]
    assert "training as configured" not in caplog.text and "hf-memwatch plan: measured" in caplog.text
