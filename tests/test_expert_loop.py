"""hf_memwatch.estimation.expert_loop: an MoE block that loops over its experts with data-dependent
routing (transformers 4.x) makes the estimate an upper bound, and the estimate and the CLI say so;
transformers 5.x's grouped experts give no such note. Runs on both stacks (``make test-stack2``)."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_memwatch import estimate
from hf_memwatch.estimation.expert_loop import expert_loop_notes, expert_loops
from hf_memwatch.testing.families import FAMILIES

FOUR_X = int(transformers.__version__.split(".")[0]) < 5


class _Looping(torch.nn.Module):
    """An MoE block routed by value, as 4.x's are."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = 1
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows = torch.where(choice == index)[0]
            out[rows] = expert(x[rows])
        return out


class _Dense(torch.nn.Module):
    """Every expert on every token: no data-dependent size, an exact replay."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(expert(x) for expert in self.experts)


def test_a_loop_routed_by_value_is_found_and_a_dense_one_is_not() -> None:
    looping = _Looping()
    assert expert_loops(torch.nn.Sequential(looping, _Dense())) == [looping]
    (note,) = expert_loop_notes(torch.nn.Sequential(looping, _Looping()))  # one note per class
    assert note.startswith("upper bound: _Looping loops over its 3 experts") and "top_k=1 of 3" in note


def _mixtral(tmp_path):
    config = FAMILIES["mixtral"][1]()
    config.save_pretrained(tmp_path)
    return config


@pytest.mark.skipif(not FOUR_X, reason="transformers 5.x: grouped experts (the other test)")
def test_a_4x_mixtral_estimate_says_it_is_an_upper_bound_and_the_cli_prints_it(tmp_path, capsys) -> None:
    from hf_memwatch.cli.main import main

    config = _mixtral(tmp_path)
    result = estimate(config, batch_size=2, seq_len=64, optim="adamw_torch")
    bounds = [note for note in result.notes if note.startswith("upper bound: MixtralSparseMoeBlock")]
    assert len(bounds) == 1 and "top_k=2 of 4 experts" in bounds[0]
    assert main(["estimate", str(tmp_path), "--batch-size", "2", "--seq-len", "64", "--optim", "adamw_torch"]) == 0
    assert "note: upper bound: MixtralSparseMoeBlock" in capsys.readouterr().out.replace("\n", " ")


@pytest.mark.skipif(FOUR_X, reason="transformers 4.x loops over its experts (the other test)")
def test_a_5x_mixtral_estimate_has_no_upper_bound_note(tmp_path) -> None:
    result = estimate(_mixtral(tmp_path), batch_size=2, seq_len=64, optim="adamw_torch")
    assert not [note for note in result.notes if note.startswith("upper bound")]
