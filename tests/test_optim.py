"""estimation/optim: the optimizer the Trainer would build, known without importing the Trainer."""

from __future__ import annotations

import pytest
from conftest import bert_model, gpt2_model
from transformers import Trainer

from hf_memwatch.estimation import optim


@pytest.mark.parametrize("name", sorted(optim.TORCH_NATIVE) + sorted(optim.BNB_NATIVE))
def test_optimizer_tables_are_the_trainers_choice(name):
    """TORCH_NATIVE and BNB_NATIVE (the planning shortcut for 8-bit AdamW) give what the Trainer picks."""
    if name in optim.BNB_NATIVE:
        pytest.importorskip("bitsandbytes")
    args = optim._training_arguments(name)
    expected_cls, expected_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, None)
    cls, kwargs = optim.optimizer_class_and_kwargs(name)
    assert cls is expected_cls
    assert kwargs == dict(expected_kwargs)
    assert args.weight_decay == 0.0


@pytest.mark.parametrize("build", [gpt2_model, bert_model])
def test_decay_groups_are_the_trainers(build):
    model = build()
    expected = set(Trainer.get_decay_parameter_names(None, model))
    groups = optim.param_groups(model, weight_decay=0.1)
    expected_ids = {id(p) for n, p in model.named_parameters() if n in expected}
    assert {id(p) for p in groups[0]["params"]} == expected_ids
    assert groups[1]["params"], "norms and biases are left without decay"

