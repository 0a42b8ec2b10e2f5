"""A user's own optimizer instance (``Trainer(..., optimizers=(opt, None))``) is what the estimate replays.

Before, every instance was estimated as the Trainer's default AdamW (2-layer BERT, batch 4 x 64 tokens:
4,859,060 B of states and a peak of 14,718,232 B for all of them): SGD +49.3% over the profiler's peak,
SGD with momentum +19.8%, ``bnb.optim.Adam8bit`` +32.4%. The replay of the instance's class and options
(:mod:`hf_memwatch.estimation.user_optimizer`) is within bytes of the profiler for each, and the auto mode
plans from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import bert_model, gpt2_model, read_records, token_dataset, training_args
from transformers import Trainer

from hf_memwatch import MemWatch, estimate
from hf_memwatch.core.run_config import optim_name
from hf_memwatch.estimation.user_optimizer import rebuild, uniform_over_layers, user_optimizer
from hf_memwatch.measure.attribution import weight_storages
from hf_memwatch.testing.estimate_truth import _fresh_bitsandbytes_overrides
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak


def _adam8bit(params: Any) -> Any:
    import bitsandbytes as bnb

    return bnb.optim.Adam8bit(params, lr=1e-3)


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw_foreach_false": lambda params: torch.optim.AdamW(params, foreach=False),
    "adam8bit": _adam8bit,
}


def _trainer(out: Path, make: Any, callbacks: list[Any] = (), **args: Any) -> Trainer:
    model = bert_model(num_layers=2, hidden=128, vocab=1000)
    values = {"per_device_train_batch_size": 4, "max_steps": 2, **args}
    return Trainer(model=model, args=training_args(out, **values), train_dataset=token_dataset(16, 64, 1000, labels="cls"),
                   optimizers=(make(model.parameters()), None), callbacks=list(callbacks))


def _truth(trainer: Trainer) -> int:
    _fresh_bitsandbytes_overrides()
    baseline = sum(weight_storages(trainer.model, None).values())
    with cpu_memory_profile() as prof:
        trainer.train()
    return window_peak(prof, baseline)


@pytest.fixture(scope="module")
def default_adamw(tmp_path_factory: pytest.TempPathFactory) -> int:
    """The estimate of the same run without an optimizer handed in (the Trainer's AdamW)."""
    model = bert_model(num_layers=2, hidden=128, vocab=1000)
    trainer = Trainer(model=model, args=training_args(tmp_path_factory.mktemp("default"), per_device_train_batch_size=4,
                                                      max_steps=2),
                      train_dataset=token_dataset(16, 64, 1000, labels="cls"))
    return estimate(trainer).peak_bytes


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_instance_is_estimated_not_the_default(name: str, tmp_path: Path, default_adamw: int) -> None:
    trainer = _trainer(tmp_path, OPTIMIZERS[name])
    est = estimate(trainer)
    truth = _truth(trainer)
    assert abs(est.peak_bytes - truth) <= 0.001 * truth, (name, est.peak_bytes, truth)
    assert any(note.startswith("optimizer: the Trainer's own") for note in est.notes), est.notes
    if name != "adamw_foreach_false":  # the default's figure is far from these runs
        assert abs(default_adamw - truth) > 0.1 * truth, (name, default_adamw, truth)


def test_rebuild_carries_bitsandbytes_rules_to_the_twins() -> None:
    """``min_8bit_size``/``optim_bits`` from ``args``, a per-parameter override from the manager."""
    import bitsandbytes as bnb

    real, twin = torch.nn.Linear(128, 64), torch.nn.Linear(128, 64)
    opt = bnb.optim.Adam8bit(real.parameters(), lr=1e-3, min_8bit_size=16)
    bnb.optim.GlobalOptimManager.get_instance().pid2config[id(real.weight)] = {"optim_bits": 32}
    try:
        copy = rebuild(opt, {id(p): q for p, q in zip(real.parameters(), twin.parameters(), strict=True)}, "cpu")
    finally:
        bnb.optim.GlobalOptimManager.get_instance().initialize()
    assert type(copy) is type(opt) and copy.args.optim_bits == 8 and copy.args.min_8bit_size == 16
    assert copy.mng is not opt.mng and copy.mng.index2config == {(0, 0): {"optim_bits": 32}}


def test_another_optim_asked_for_or_a_foreign_instance_is_not_replayed(tmp_path: Path) -> None:
    model = gpt2_model(n_layer=2, n_embd=64)
    other = torch.nn.Linear(4, 4)
    args = training_args(tmp_path, per_device_train_batch_size=2, max_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(4, 16, 1000),
                      optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    own = optim_name(trainer.args)
    assert user_optimizer(trainer, own) is not None  # args.optim: the run's own
    assert user_optimizer(trainer, "adamw_bnb_8bit") is None  # a plan's other optimizer
    assert user_optimizer(trainer, own, "zero2") is None  # the engine's optimizer
    trainer.optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    assert user_optimizer(trainer, own) is None


def test_an_optimizer_over_some_layers_is_replayed_at_full_depth(tmp_path: Path) -> None:
    model = gpt2_model(n_layer=6, n_embd=64)
    last = torch.optim.AdamW(model.transformer.h[5].parameters())
    trainer = Trainer(model=model, args=training_args(tmp_path, per_device_train_batch_size=2, max_steps=1),
                      train_dataset=token_dataset(4, 16, 1000), optimizers=(last, None))
    spec = user_optimizer(trainer, None)
    assert spec is not None and not uniform_over_layers(spec, model)
    est = estimate(trainer)
    assert not any(note.startswith("depth extrapolated") for note in est.notes), est.notes
    layer = sum(p.numel() for p in model.transformer.h[5].parameters())
    assert est.classes["optimizer_states"] == 8 * layer + 4 * len(list(model.transformer.h[5].parameters()))


def test_auto_mode_plans_the_instance(tmp_path: Path) -> None:
    """A budget above SGD's peak but under the default AdamW's: the run is kept as configured (the
    default's figure would have had it shrink its micro-batch or checkpoint)."""
    truth = _truth(_trainer(tmp_path / "plain", OPTIMIZERS["sgd"]))
    budget = int(1.08 * truth)
    auto = _trainer(tmp_path / "auto", OPTIMIZERS["sgd"], [MemWatch(auto=True, budget=budget, report=False,
                                                                   summary=False)])
    assert estimate(auto).peak_bytes <= truth * 1.001
    assert _truth(auto) <= budget
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert plan["source"] == "predicted" and plan["micro_batch_size"] == 4, plan
    assert not plan["activation_checkpointing"], plan
