"""A stop says what to try (issue #37, point 5; :mod:`hf_memwatch.planning.no_fit`).

Real (tiny) runs that no plan fits: the stop names the remedies unavailable and why, and advice whose
figure is the estimator's — checked here by building the run with that advice applied by hand and
estimating it again: its predicted peak (margin included) is the one the message gives, and fits.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpt2_model, token_dataset, training_args
from test_equivalence import FULL
from test_kto_auto import kto
from transformers import Trainer

from hf_memwatch import MemWatch, PlanError, estimate
from hf_memwatch.core.units import format_bytes
from hf_memwatch.planning.no_fit import Truncating, fused_head_of
from hf_memwatch.planning.predict import ESTIMATE_MARGIN

ADVISED_LENGTH = re.compile(r"- max_length=(\d+) \(the longest batch is (\d+) tokens now\): predicted "
                            r"([\d.]+ [KMG]?i?B), fits")


def stop_message(trainer: Any) -> str:
    with pytest.raises(PlanError) as raised:
        trainer.train()
    assert trainer.state.global_step == 0
    message = str(raised.value)
    assert all(len(line) <= 100 for line in message.splitlines()), message  # readable in a terminal
    return message


def with_margin(peak: int) -> int:
    return int(-(-peak * (1.0 + ESTIMATE_MARGIN) // 1))


def advised_length(message: str) -> tuple[int, int, str]:
    flat = " ".join(message.split())  # lines are wrapped
    found = ADVISED_LENGTH.search(flat)
    assert found, message
    return int(found[1]), int(found[2]), found[3]


def test_kto_at_07x_its_peak_names_the_fixed_micro_batch_and_a_length_that_fits(tmp_path: Path) -> None:
    """The issue's case: KTO at 0.7x its configured peak; its micro-batch is fixed at ``__init__`` and its
    loss's temporaries are TRL's chunked log-prob tile (no fused route left to advise): a shorter
    ``max_length``, re-estimated on a KTO run built with it, fits."""
    probe = kto(tmp_path / "probe", [])
    assert fused_head_of(probe) == "KTOTrainer"
    budget = int(0.7 * estimate(probe).peak_bytes)
    del probe
    message = stop_message(kto(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **FULL)]))
    flat = " ".join(message.split())
    assert "- gradient accumulation: KTOTrainer paired its KL completions" in flat
    assert "- fused/chunked loss: KTOTrainer computes the loss's log-probs in chunks already" in flat
    length, longest, figure = advised_length(message)
    assert length < longest

    # The advice applied by hand: KTO truncating to that length, the smallest plan (checkpointing on).
    advised = kto(tmp_path / "advised", [], max_length=length, activation_checkpointing=True)
    peak = with_margin(estimate(advised).peak_bytes)
    assert format_bytes(peak) == figure and peak <= budget


def plain(out: Path, seq_len: int, callbacks: list[Any]) -> Trainer:
    """A plain causal LM (GPT-2 shape) with SGD: 8-bit AdamW is not a remedy for it."""
    return Trainer(model=gpt2_model(), args=training_args(out, per_device_train_batch_size=4, max_steps=1,
                                                           optim="sgd"),
                   train_dataset=token_dataset(16, seq_len, 1000), callbacks=callbacks)


def test_plain_causal_lm_below_its_smallest_plan_gets_a_length_and_lora_re_estimated(tmp_path: Path) -> None:
    probe = plain(tmp_path / "probe", 256, [])
    smallest = with_margin(estimate(probe, batch_size=1, accum=4, checkpointing=True).peak_bytes)
    budget = int(0.85 * smallest)
    message = stop_message(plain(tmp_path / "auto", 256, [MemWatch(auto=True, budget=budget, **FULL)]))
    flat = " ".join(message.split())
    assert "- 8-bit AdamW: optim='sgd' is not AdamW" in flat
    assert f"micro-batch 1 x accumulation 4, activation checkpointing, optim sgd, predicted peak " \
           f"{format_bytes(smallest)}" in flat
    length, longest, figure = advised_length(message)
    assert longest == 256 and length < 256
    advised = plain(tmp_path / "advised", length, [])
    peak = with_margin(estimate(advised, batch_size=1, accum=4, checkpointing=True).peak_bytes)
    assert format_bytes(peak) == figure and peak <= budget
    assert "LoRA (peft_config=LoraConfig(r=8)): predicted" in flat  # re-estimated, with its verdict


def test_truncating_cuts_only_batch_by_sequence_tensors() -> None:
    batch = Truncating(lambda items: {"input_ids": torch.zeros(2, 9), "pixel_values": torch.zeros(2, 3, 4, 4),
                                      "label": torch.zeros(2)}, 5)([{}, {}])
    assert (batch["input_ids"].shape, batch["pixel_values"].shape, batch["label"].shape) == (
        (2, 5), (2, 3, 4, 4), (2,))


def test_cli_budget_stop_gives_the_length_that_fits(tmp_path: Path, capsys: Any) -> None:
    """``hf-memwatch estimate --budget``: the same lines after its one-line verdict; the advised length,
    estimated again from the config, fits."""
    from hf_memwatch.cli.main import main

    gpt2_model().config.save_pretrained(tmp_path)
    budget = 8 << 20
    assert main(["estimate", str(tmp_path), "--batch-size", "8", "--seq-len", "256", "--optim", "sgd",
                 "--budget", "8MiB"]) == 1
    err = capsys.readouterr().err
    assert "- 8-bit AdamW: optim='sgd' is not AdamW" in " ".join(err.split())
    length, longest, figure = advised_length(err)
    assert longest == 256
    peak = with_margin(estimate(str(tmp_path), batch_size=1, accum=8, checkpointing=True, seq_len=length,
                                optim="sgd").peak_bytes)
    assert format_bytes(peak) == figure and peak <= budget


def test_a_figure_is_never_split_from_its_unit() -> None:
    from hf_memwatch.planning.no_fit import WIDTH, _wrap

    line = "x " * (WIDTH // 2 - 3) + "13.48 MiB"  # the unit alone would pass the width
    assert "13.48 MiB" in _wrap(line) and all(len(part) <= WIDTH for part in _wrap(line).splitlines())


def test_logits_dominated_stop_advises_trl_fused_head_and_no_liger_on_cpu(tmp_path: Path) -> None:
    """A 16k vocabulary at 128 tokens: the logit-shaped tensors (logits, upcast, gradients) fill the
    backward peak of the smallest plan; the fused LM head of TRL's SFTTrainer is advised with them as its
    saving, Liger (Triton, CUDA only) is not, on a CPU target."""
    def run(out: Path, callbacks: list[Any]) -> Trainer:
        return Trainer(model=gpt2_model(n_embd=64, vocab=16000), train_dataset=token_dataset(16, 128, 16000),
                       args=training_args(out, per_device_train_batch_size=4, max_steps=1, optim="sgd"),
                       callbacks=callbacks)

    smallest = estimate(run(tmp_path / "probe", []), batch_size=1, accum=4, checkpointing=True)
    budget = int(0.85 * with_margin(smallest.peak_bytes))
    flat = " ".join(stop_message(run(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **FULL)])).split())
    found = re.search(r"- trl\.SFTTrainer \(its fused LM head\): saves up to ([\d.]+) MiB", flat)
    assert found, flat
    held = smallest.classes["temporaries"] + smallest.classes["activations"]
    assert 0.5 * held < float(found[1]) * 2**20 <= held  # most of the peak's transient bytes, never more
    assert "use_liger_kernel" not in flat
