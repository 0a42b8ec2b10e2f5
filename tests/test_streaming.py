"""Streaming datasets (issue 37, point 4): an ``IterableDataset`` with no ``max_length`` does not stop the auto mode.

transformers' ``test_training_iterable_dataset`` (a 2-parameter regression model fed scalars by an
``IterableDataset``, with an extra unused column) stopped with ``PlanError`` under
``MemWatch(auto=True, budget="16GiB")``. Its items carry no sequence: the first micro-batch, read from a
copy of the dataset, gives every micro-batch's shapes, and the run trains exactly as without MemWatch.
Items with sequences are bounded by what the run can feed (here GPT-2's ``n_positions``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import gpt2_model, loss_history, read_records, training_args
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer

from hf_memwatch import MemWatch, estimate
from hf_memwatch.estimation.streaming import first_items, longest_fed_length
from hf_memwatch.measure.attribution import weight_storages
from hf_memwatch.testing.estimate_truth import ListDataset
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak


class RegressionConfig(PretrainedConfig):
    def __init__(self, a: float = 0.0, b: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.a, self.b, self.hidden_size = a, b, 1


class Regression(PreTrainedModel):
    """transformers' test ``RegressionPreTrainedModel``: ``y = a * x + b``, MSE loss."""

    config_class = RegressionConfig
    base_model_prefix = "regression"

    def __init__(self, config: RegressionConfig) -> None:
        super().__init__(config)
        self.a = nn.Parameter(torch.tensor(config.a).float())
        self.b = nn.Parameter(torch.tensor(config.b).float())
        self.post_init()

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> tuple:
        y = input_x * self.a + self.b
        return (y,) if labels is None else (nn.functional.mse_loss(y, labels), y)


class Scalars(torch.utils.data.IterableDataset):
    """transformers' test ``SampleIterableDataset`` (``label_names=["labels", "extra"]``)."""

    def __init__(self, length: int = 64) -> None:
        rng = np.random.default_rng(42)
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = (2.0 * self.x + 3.0 + rng.normal(scale=0.1, size=(length,))).astype(np.float32)

    def __iter__(self):
        for i in range(len(self.x)):
            yield {"input_x": self.x[i], "labels": self.y[i], "extra": self.y[i]}


class FiniteScalars(Scalars):
    """transformers' test ``FiniteIterableDataset``: its position lives on the dataset (one pass in all)."""

    def __init__(self, length: int = 64) -> None:
        super().__init__(length)
        self.current_sample = 0

    def __iter__(self):
        while self.current_sample < len(self.x):
            yield {"input_x": self.x[self.current_sample], "labels": self.y[self.current_sample]}
            self.current_sample += 1


def _regression(out: Path, dataset: Any, callbacks: list[Any]) -> Trainer:
    torch.manual_seed(0)
    return Trainer(model=Regression(RegressionConfig()), args=training_args(out, max_steps=4, per_device_train_batch_size=8),
                   train_dataset=dataset, callbacks=callbacks)


def _auto() -> MemWatch:
    return MemWatch(auto=True, budget="16GiB", report=False, summary=False)


@pytest.mark.parametrize("dataset", [Scalars, FiniteScalars])
def test_an_iterable_dataset_of_scalars_trains_as_without_memwatch(dataset: type, tmp_path: Path) -> None:
    plain_data = dataset()
    plain = _regression(tmp_path / "plain", plain_data, [])
    plain.train()
    watched_data = dataset()
    watched = _regression(tmp_path / "auto", watched_data, [_auto()])
    watched.train()  # was: PlanError
    assert watched.state.global_step == 4
    assert loss_history(watched) == loss_history(plain)  # nothing of the stream consumed by the plan
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert plan["source"] == "predicted", plan
    if dataset is FiniteScalars:  # the stream stops where the plain run's does (its look-ahead included)
        assert watched_data.current_sample == plain_data.current_sample


def test_the_stream_is_estimated_as_the_same_items_read_by_index(tmp_path: Path) -> None:
    """The first micro-batch of the stream is the batch the map-style path replays (same figure)."""
    stream = Scalars()
    est = estimate(_regression(tmp_path / "stream", stream, []))
    assert any("carry no sequence" in note for note in est.notes), est.notes
    items = ListDataset([{"input_x": x, "labels": y} for x, y in zip(stream.x, stream.y, strict=True)])
    assert est.peak_bytes == estimate(_regression(tmp_path / "map", items, [])).peak_bytes


class Tokens(torch.utils.data.IterableDataset):
    def __init__(self, n: int, seq_len: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(0, 1000, (seq_len,), generator=gen) for _ in range(n)]

    def __iter__(self):
        for ids in self.rows:
            yield {"input_ids": ids, "labels": ids.clone()}


def test_token_streams_are_bounded_by_the_models_positions(tmp_path: Path) -> None:
    model = gpt2_model(n_layer=2, n_embd=64)
    model.config.n_positions = 128
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=2, per_device_train_batch_size=2),
                      train_dataset=Tokens(8, 32), callbacks=[_auto()])
    assert longest_fed_length(trainer)[0] == 128
    est = estimate(trainer)
    assert est.config["seq_len"] == 128, est.config
    baseline = sum(weight_storages(trainer.model, None).values())
    with cpu_memory_profile() as prof:
        trainer.train()
    assert trainer.state.global_step == 2
    assert window_peak(prof, baseline) <= est.peak_bytes  # a bound: the stream's 32 tokens under 128


def test_a_dataset_sharing_an_iterator_is_not_read() -> None:
    class Shared(torch.utils.data.IterableDataset):
        def __init__(self) -> None:
            self.source = iter(range(10))

        def __iter__(self):
            return ({"x": torch.tensor(float(i))} for i in self.source)

    data = Shared()
    assert first_items(data, 2) is None
    assert next(data.source) == 0
