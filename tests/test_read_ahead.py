"""A stream's first micro-batches read ahead (issue 37, point 4): ``hf_memwatch.estimation.read_ahead``.

A token stream on GPT-2 (512 positions) whose samples carry 16 tokens: planned for the 512 positions the
run can feed, the step needs ~150 MiB, so a 12 MiB budget stopped with ``PlanError``. Read ahead, its
first 8 micro-batches are planned on (4.13 MiB predicted) and the run trains on the same samples, in the
same order, with the same losses as without MemWatch. A later longer sample is predicted before the step
that trains on it: checkpointing is turned on, or the run stops before that step.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpt2_model, loss_history, read_records, token_dataset, training_args
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainerCallback

from hf_memwatch import MemWatch, PlanError, estimate
from hf_memwatch.estimation.read_ahead import READ_AHEAD_BATCHES, ReadAhead

QUIET = {"report": False, "summary": False}
BATCH = 4


class Tokens(torch.utils.data.IterableDataset):
    """Token samples of the given lengths, drawn from the stream's own generator; every iterator counted."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths, self.iterators, self.read = lengths, 0, 0

    def __iter__(self):
        self.iterators += 1
        generator = torch.Generator().manual_seed(0)
        for length in self.lengths:
            self.read += 1
            ids = torch.randint(0, 1000, (length,), generator=generator)
            yield {"input_ids": ids, "labels": ids.clone()}


class Seen(TrainerCallback):
    """Each step's batches as the Trainer trained on them (their lengths and first tokens), and whether
    activation checkpointing was on when the step began."""

    def __init__(self, trainer_ref: list[Any]) -> None:
        self.trainer_ref, self.checkpointing = trainer_ref, []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.checkpointing.append(bool(self.trainer_ref[0].model.is_activation_checkpointing))


def _model(positions: int) -> Any:
    model = gpt2_model(n_embd=64)
    if positions != model.config.n_positions:  # a longer context: the bound the stream is first planned for
        from transformers import GPT2LMHeadModel

        model.config.n_positions = positions
        torch.manual_seed(0)
        model = GPT2LMHeadModel(model.config)
    return model


def _trainer(out: Path, data: Tokens, callbacks: list[Any], max_steps: int = 4,
             positions: int = 512) -> tuple[Trainer, list[list[int]]]:
    batches: list[list[int]] = []
    training = Training()

    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
        if training.began and _from_the_dataloader():  # the batches the Trainer draws (not the estimates')
            batches.append(batch["input_ids"][:, :4].flatten().tolist() + [batch["input_ids"].shape[1]])
        return batch

    trainer = Trainer(model=_model(positions), args=training_args(out, max_steps=max_steps,
                                                                       per_device_train_batch_size=BATCH),
                      train_dataset=data, data_collator=collate, callbacks=[training, *callbacks])
    return trainer, batches


def _from_the_dataloader() -> bool:
    frame = sys._getframe(1)
    for _ in range(6):
        frame = frame.f_back
        if frame is None or frame.f_code.co_name == "fetch":  # torch's dataset fetcher collates its batches
            return frame is not None
    return False


class Training(TrainerCallback):
    began = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.began = True


def test_the_samples_read_ahead_are_handed_on_in_order_once() -> None:
    data = Tokens([16, 40, 8, 24, 16])
    ahead = ReadAhead(data, ahead_items=3)
    state = torch.get_rng_state()
    assert ahead.read() == 3 and ahead.longest == 40 and ahead.items_read == 3
    assert torch.equal(torch.get_rng_state(), state)
    assert [len(item["input_ids"]) for item in ahead] == [16, 40, 8, 24, 16]
    assert data.iterators == 1 and data.read == 5  # the read-ahead's iterator is the one trained on
    assert [len(item["input_ids"]) for item in ahead] == [16, 40, 8, 24, 16] and data.iterators == 2  # an epoch


def test_a_stream_over_its_bound_trains_on_its_first_batches_as_without_memwatch(tmp_path: Path,
                                                                               caplog: Any) -> None:
    plain_data = Tokens([16] * 64)
    plain, plain_batches = _trainer(tmp_path / "plain", plain_data, [])
    at_bound = estimate(plain).peak_bytes  # planned for GPT-2's 512 positions
    assert at_bound > 12 * 2**20
    plain.train()
    data = Tokens([16] * 64)
    watched, batches = _trainer(tmp_path / "auto", data, [MemWatch(auto=True, budget="12MiB", **QUIET)])
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        watched.train()  # was: PlanError ("no plan fits the budget 12.00 MiB")
    assert "planning on its first 32 samples, read ahead" in caplog.text
    assert watched.state.global_step == 4 and isinstance(watched.train_dataset, ReadAhead)
    assert batches == plain_batches  # the same samples, in the same order
    assert loss_history(watched) == loss_history(plain)
    assert data.iterators == 1 and data.read == plain_data.read + READ_AHEAD_BATCHES * BATCH - 1  # kept ahead
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert plan["source"] == "predicted" and plan["sample"]["seq_len"] == 16
    assert plan["predicted_peak"] < 12 * 2**20 and plan["micro_batch_size"] == BATCH
    assert any("read ahead" in note for note in plan["sample"]["notes"])
    assert not any("not read" in note for note in plan["sample"]["notes"]), plan["sample"]["notes"]


def test_a_stream_whose_bound_fits_is_not_read_ahead(tmp_path: Path) -> None:
    data = Tokens([16] * 64)
    trainer, _ = _trainer(tmp_path, data, [MemWatch(auto=True, budget="1GiB", **QUIET)])
    trainer.train()
    assert trainer.state.global_step == 4 and trainer.train_dataset is data and data.iterators == 1
    [plan] = [r for r in read_records(tmp_path) if r["event"] == "plan"]
    assert plan["sample"]["seq_len"] == 512  # the model's positions: the bound fits


def test_a_budget_not_even_the_first_batches_fit_still_stops(tmp_path: Path) -> None:
    trainer, _ = _trainer(tmp_path, Tokens([16] * 64), [MemWatch(auto=True, budget="2MiB", **QUIET)])
    with pytest.raises(PlanError, match="no plan fits the budget 2.00 MiB"):
        trainer.train()


def _long_sample_budgets(tmp_path: Path, long: int) -> tuple[int, int, int]:
    """(the short stream's predicted peak, the long batch's with and without checkpointing), margin included."""
    from hf_memwatch.planning.predict import ESTIMATE_MARGIN

    def peak(length: int, checkpointing: bool) -> int:
        trainer = Trainer(model=gpt2_model(n_embd=64), train_dataset=token_dataset(8, length, 1000),
                          args=training_args(tmp_path / "est", per_device_train_batch_size=BATCH))
        return int(estimate(trainer, activation_checkpointing=checkpointing).peak_bytes * (1 + ESTIMATE_MARGIN)) + 1

    return peak(16, False), peak(long, True), peak(long, False)


@pytest.mark.parametrize("case", ["fits", "checkpointing", "stop"])
def test_a_longer_sample_is_predicted_before_its_step(tmp_path: Path, case: str, caplog: Any) -> None:
    long, short_batches = 256, READ_AHEAD_BATCHES + 2  # the long batches from step 11 on
    short, checkpointed, plain = _long_sample_budgets(tmp_path, long)
    assert short < checkpointed < plain
    budget = {"fits": plain + plain // 10, "checkpointing": (checkpointed + plain) // 2,
              "stop": (short + checkpointed) // 2}[case]
    ref: list[Any] = []
    seen = Seen(ref)
    trainer, batches = _trainer(tmp_path / case, Tokens([16] * (short_batches * BATCH) + [long] * (4 * BATCH)),
                                [seen, MemWatch(auto=True, budget=budget, **QUIET)], max_steps=14, positions=2048)
    ref.append(trainer)
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        trainer.train()
    first, *later = [r for r in read_records(tmp_path / case) if r["event"] == "plan"]
    assert first["sample"]["seq_len"] == 16 and not first["activation_checkpointing"]
    assert any(f"a sample of {long} tokens read ahead" in r["reason"] for r in later), later
    if case == "fits":  # predicted again, the plan stays
        assert trainer.state.global_step == 14 and not any(seen.checkpointing)
        assert "the plan stays" in later[-1]["reason"] and first["predicted_peak"] < later[-1]["predicted_peak"] <= budget
    elif case == "checkpointing":
        assert trainer.state.global_step == 14
        lengths = [batch[-1] for batch in batches[:14]]
        assert all(on for on, length in zip(seen.checkpointing, lengths, strict=True) if length == long)
        assert later[-1]["activation_checkpointing"] and later[-1]["predicted_peak"] <= budget
    else:  # stopped before the first step of long samples, with an ERROR line
        assert trainer.state.global_step == short_batches
        assert all(batch[-1] == 16 for batch in batches[:short_batches])
        assert later[-1]["status"] == "over_budget" and "training stops before the step" in later[-1]["reason"]
        assert any(r.levelno == logging.ERROR for r in caplog.records)



class TokenConfig(PretrainedConfig):
    model_type = "token-lm-test"

    def __init__(self, vocab_size: int = 1000, hidden_size: int = 32, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size


class TokenLM(PreTrainedModel):
    """A language model without positions: nothing in it bounds the length of a sample."""

    config_class = TokenConfig

    def __init__(self, config: TokenConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> tuple:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return (loss, logits)


def test_a_stream_nothing_bounds_is_read_ahead_not_measured(tmp_path: Path) -> None:
    """No ``max_length``, no collator length, no model positions: the estimator cannot pick a length
    (it used to fall back to measuring micro-steps live); the first micro-batches read ahead give it."""
    def train(out: Path, callbacks: list[Any]) -> Trainer:
        torch.manual_seed(0)
        trainer = Trainer(model=TokenLM(TokenConfig()), train_dataset=Tokens([16] * 64), callbacks=callbacks,
                          args=training_args(out, max_steps=4, per_device_train_batch_size=BATCH))
        trainer.train()
        return trainer

    plain = train(tmp_path / "plain", [])
    trainer = train(tmp_path / "auto", [MemWatch(auto=True, budget="1GiB", **QUIET)])
    assert isinstance(trainer.train_dataset, ReadAhead) and loss_history(trainer) == loss_history(plain)
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert plan["source"] == "predicted" and plan["sample"]["seq_len"] == 16


def _workers_trainer(out: Path, data: Tokens, callbacks: list[Any], max_steps: int = 4,
                     positions: int = 512) -> tuple[Trainer, list[int]]:
    """A Trainer whose stream one dataloader worker reads; the sequence length of each training forward (real
    tensors: the estimates' fake copies of the model keep its hooks)."""
    from torch._subclasses.fake_tensor import FakeTensor

    lengths: list[int] = []

    def record(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"]
        if module.training and not isinstance(ids, FakeTensor):
            lengths.append(int(ids.shape[1]))

    model = _model(positions)
    model.register_forward_pre_hook(record, with_kwargs=True)
    trainer = Trainer(model=model, train_dataset=data, callbacks=callbacks,
                      args=training_args(out, max_steps=max_steps, per_device_train_batch_size=BATCH,
                                         dataloader_num_workers=1))
    return trainer, lengths


def test_a_stream_read_by_dataloader_workers_is_planned_on_a_copy_and_trains_as_without_memwatch(
        tmp_path: Path, caplog: Any) -> None:
    """Each worker iterates its own copy of the dataset: nothing is read ahead of the Trainer here. A copy is
    read in this process instead (the run's dataset untouched: nothing read from it in this process), its first
    micro-batches planned on; the run trains as without MemWatch (was: ``PlanError``, the bound's 512 positions
    ~150 MiB over a 12 MiB budget)."""
    from hf_memwatch.estimation.read_ahead import stream_sample

    plain, _ = _workers_trainer(tmp_path / "plain", Tokens([16] * 64), [])
    plain.train()
    data = Tokens([16] * 64)
    trainer, lengths = _workers_trainer(tmp_path / "auto", data, [MemWatch(auto=True, budget="12MiB", **QUIET)])
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        trainer.train()
    assert "read from a copy of the stream" in caplog.text
    assert trainer.train_dataset is data and data.iterators == 0 and data.read == 0  # the workers read the run's
    assert loss_history(trainer) == loss_history(plain) and lengths == [16] * 4
    sample = stream_sample(trainer)
    assert sample is not None and sample.items_read == READ_AHEAD_BATCHES * BATCH and sample.fetched_batches == 4
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert plan["sample"]["seq_len"] == 16 and plan["predicted_peak"] < 12 * 2**20
    assert any("dataloader workers" in note for note in plan["sample"]["notes"]), plan["sample"]["notes"]


@pytest.mark.parametrize("case", ["fits", "checkpointing", "stop"])
def test_a_longer_micro_batch_from_the_workers_is_predicted_before_its_step(tmp_path: Path, case: str,
                                                                           caplog: Any) -> None:
    """The workers' micro-batches are measured as the Trainer takes them (``get_batch_samples``, before the
    step begins): a longer one than planned is predicted on before any step trains on it; checkpointing
    turned on where that fits, else the run stops there with a ``PlanError`` (the step not taken)."""
    long, short_batches = 256, READ_AHEAD_BATCHES + 2  # the long batches from step 11 on
    short, checkpointed, plain = _long_sample_budgets(tmp_path, long)
    budget = {"fits": plain + plain // 10, "checkpointing": (checkpointed + plain) // 2,
              "stop": (short + checkpointed) // 2}[case]
    ref: list[Any] = []
    seen = Seen(ref)
    trainer, lengths = _workers_trainer(tmp_path / case, Tokens([16] * (short_batches * BATCH) + [long] * (4 * BATCH)),
                                        [seen, MemWatch(auto=True, budget=budget, **QUIET)], max_steps=14,
                                        positions=2048)
    ref.append(trainer)
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        if case == "stop":
            with pytest.raises(PlanError, match="training stops before the step that trains on it"):
                trainer.train()
        else:
            trainer.train()
    first, *later = [r for r in read_records(tmp_path / case) if r["event"] == "plan"]
    assert first["sample"]["seq_len"] == 16 and not first["activation_checkpointing"]
    assert any(f"a sample of {long} tokens fetched by the dataloader workers" in r["reason"] for r in later), later
    if case == "fits":
        assert trainer.state.global_step == 14 and not any(seen.checkpointing)
        assert "the plan stays" in later[-1]["reason"] and first["predicted_peak"] < later[-1]["predicted_peak"] <= budget
    elif case == "checkpointing":
        assert trainer.state.global_step == 14 and lengths == [16] * short_batches + [long] * 4
        assert seen.checkpointing == [False] * short_batches + [True] * 4
        assert later[-1]["activation_checkpointing"] and later[-1]["predicted_peak"] <= budget
    else:  # no step trained on a long batch; MemWatch's patches and hooks gone with the error
        assert trainer.state.global_step == short_batches and lengths == [16] * short_batches
        assert later[-1]["status"] == "over_budget"
        assert "get_batch_samples" not in vars(trainer) and len(trainer.model._forward_pre_hooks) == 1
