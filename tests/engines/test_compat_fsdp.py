"""hf_memwatch.compat.fsdp and the autograd engine's probe (compat.torch_internals.AUTOGRAD_ENGINE): the
private names the FSDP2 and ZeRO-1/2 engines rely on, their probes on the installed stack, and the
degradation when one is gone (one WARNING, ``meta.degraded``, only its feature off)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import gpt2_model

from hf_memwatch.compat import fsdp as compat_fsdp
from hf_memwatch.compat import probes, torch_internals
from hf_memwatch.engines.engine import Engine
from hf_memwatch.engines.fsdp2.live import fsdp2_param_groups
from hf_memwatch.engines.fsdp2.replay import fsdp_applies
from hf_memwatch.engines.fsdp2.units import build_units, wrap_policy
from hf_memwatch.engines.zero.backward import flow_applies

FSDP2 = Engine(kind="fsdp", world_size=2, fsdp_version=2, fsdp_strategy="FULL_SHARD")
ZERO2 = Engine(kind="deepspeed", world_size=2, zero_stage=2)
PROBES = [compat_fsdp.PARAM_GROUP, compat_fsdp.UNSHARDED_PARAM, compat_fsdp.MODULE_PARAMETERS,
          compat_fsdp.FINAL_NORM, compat_fsdp.NO_SPLIT, torch_internals.AUTOGRAD_ENGINE]


@pytest.fixture(autouse=True)
def fresh_probes():
    probes.forget()
    yield
    probes.forget()


def _warned(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "hf-memwatch" in r.getMessage()]


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.guards)
def test_each_probe_holds_on_the_installed_stack(probe) -> None:
    assert probes.holds(probe)
    assert probes.degraded() == []


def test_the_replays_apply_on_the_installed_stack() -> None:
    model = gpt2_model()
    assert fsdp_applies(FSDP2, model) and flow_applies(ZERO2, model)


def test_a_gone_autograd_callback_turns_off_the_zero_and_fsdp2_replays_loudly(monkeypatch, caplog) -> None:
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    model = gpt2_model()
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert not flow_applies(ZERO2, model)
        assert not fsdp_applies(FSDP2, model)
    warned = _warned(caplog)
    assert len(warned) == 1 and "_current_graph_task_id" in warned[0]
    assert probes.degraded() == [torch_internals.AUTOGRAD_ENGINE.entry()]


def test_a_gone_final_norm_turns_off_the_fsdp2_replay_only(monkeypatch, caplog) -> None:
    from accelerate.utils import fsdp_utils

    monkeypatch.delattr(fsdp_utils, "_find_final_norm")
    model = gpt2_model()
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert not fsdp_applies(FSDP2, model)
        assert flow_applies(ZERO2, model)
    assert len(_warned(caplog)) == 1
    assert probes.degraded() == [compat_fsdp.FINAL_NORM.entry()]


def test_a_module_that_no_longer_reads_its_parameters_turns_off_the_fsdp2_replay(monkeypatch, caplog) -> None:
    """A torch whose ``Module`` keeps parameters elsewhere than ``_parameters``: setting one there is not seen."""
    def elsewhere(self, name):
        raise AttributeError(name)

    model = gpt2_model()
    monkeypatch.setattr(torch.nn.Module, "__getattr__", elsewhere)
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert not fsdp_applies(FSDP2, model)
    assert probes.degraded() == [compat_fsdp.MODULE_PARAMETERS.entry()]


def test_no_split_modules_gives_the_layer_units_and_its_absence_says_so(monkeypatch, caplog) -> None:
    model = gpt2_model()
    layered = len(build_units(model, wrap_policy(None, model), True))
    assert compat_fsdp.no_split_modules(model) == {"GPT2Block"}
    for cls in type(model).__mro__:  # a transformers without the attribute: no model class declares it
        if "_no_split_modules" in vars(cls):
            monkeypatch.delattr(cls, "_no_split_modules")
    probes.forget()
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert compat_fsdp.no_split_modules(model) == set()
        assert len(build_units(model, wrap_policy(None, model), True)) < layered
    assert len(_warned(caplog)) == 1
    assert probes.degraded() == [compat_fsdp.NO_SPLIT.entry()]


@pytest.fixture()
def sharded_gpt2():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = gpt2_model()
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        yield model
    finally:
        dist.destroy_process_group()


def test_the_live_param_groups_are_read_and_a_gone_state_reads_as_none_loudly(sharded_gpt2, monkeypatch, caplog) -> None:
    from torch.distributed.fsdp import FSDPModule

    groups = fsdp2_param_groups(sharded_gpt2)
    assert len(groups) == len(sharded_gpt2.transformer.h) + 1
    assert all(compat_fsdp.unsharded_param(p) is None or isinstance(compat_fsdp.unsharded_param(p), torch.Tensor)
               for group in groups for p in group.fsdp_params)
    monkeypatch.delattr(FSDPModule, "_get_fsdp_state")
    probes.forget()
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert fsdp2_param_groups(sharded_gpt2) == []
    assert len(_warned(caplog)) == 1
    assert probes.degraded() == [compat_fsdp.PARAM_GROUP.entry()]


def test_a_param_without_its_unsharded_attribute_reads_as_none_loudly(monkeypatch, caplog) -> None:
    """A release whose ``_fsdp_param.py`` no longer assigns ``self._unsharded_param`` (another FSDP2 module
    stands in for it)."""
    import importlib

    state = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_state")
    monkeypatch.setattr(compat_fsdp, "_fully_shard_module", lambda name: state)
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert compat_fsdp.unsharded_param(torch.nn.Parameter(torch.zeros(1))) is None
    assert probes.degraded() == [compat_fsdp.UNSHARDED_PARAM.entry()]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_the_autograd_probe_holds_whatever_grad_mode_it_is_first_used_under(mode) -> None:
    with mode():
        assert torch_internals.autograd_engine_replayable()


def test_the_probes_draw_nothing_from_the_runs_random_numbers() -> None:
    """A probe runs at first use, inside the user's run: a watched run's first loss is the plain run's
    (tests/engines/test_distributed.py::test_monitoring_changes_nothing_under_fsdp2 caught a probe that
    built a ``Linear``)."""
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    assert all(probes.holds(probe) for probe in PROBES)
    assert torch.equal(torch.rand(4), expected)
