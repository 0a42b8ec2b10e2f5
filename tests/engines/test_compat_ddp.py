"""hf_memwatch.compat.ddp: DDP's private names the DDP engine relies on, their probes on the installed torch,
and the degradation when one is gone (one WARNING, ``meta.degraded``, only its feature off)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from hf_memwatch.compat import ddp as compat_ddp
from hf_memwatch.compat import probes
from hf_memwatch.engines.ddp.replay import ddp_bucket_bytes


@pytest.fixture(autouse=True)
def fresh_probes():
    probes.forget()
    yield
    probes.forget()


@pytest.mark.parametrize("probe", [compat_ddp._LOGGING, compat_ddp._ASSIGNMENT], ids=lambda p: p.guards)
def test_each_ddp_probe_holds_on_the_installed_torch(probe) -> None:
    assert probes.holds(probe)


def test_the_bucket_grouping_is_torchs() -> None:
    """Three 4,100 KiB layers in ready order: a 1 MiB first bucket closes past its cap, then 25 MiB ones."""
    params = [torch.nn.Parameter(torch.empty(1024 * 1025)) for _ in range(3)]
    assert compat_ddp.bucket_assignment(params, None, 25 << 20) == [[0], [1, 2]]


def test_a_gone_bucket_grouping_leaves_the_cuda_buckets_out_loudly(monkeypatch, caplog) -> None:
    monkeypatch.delattr(dist, "_compute_bucket_assignment_by_size")
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(2)))
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert ddp_bucket_bytes(model) == []
        assert ddp_bucket_bytes(model) == []
    warned = [r.getMessage() for r in caplog.records if "hf-memwatch" in r.getMessage()]
    assert len(warned) == 1 and "_compute_bucket_assignment_by_size" in warned[0]
    assert probes.degraded() == [compat_ddp._ASSIGNMENT.entry()]


def test_a_gone_logging_data_reads_as_no_bucket(monkeypatch, caplog) -> None:
    monkeypatch.delattr(torch.nn.parallel.DistributedDataParallel, "_get_ddp_logging_data")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert compat_ddp.ddp_logging_data(object()) == {}
    assert probes.degraded() == [compat_ddp._LOGGING.entry()]
