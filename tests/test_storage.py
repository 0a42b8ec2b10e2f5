"""hf_memwatch.measure.storage: every tracked byte is a storage, counted once however many views share it."""

from __future__ import annotations

import torch

from hf_memwatch.measure.storage import collect_storages, nested_tensors, same_device, storage_key, total


def test_views_of_one_storage_count_once_and_none_is_skipped() -> None:
    weight = torch.zeros(16)  # 64 B
    other = torch.ones(4, dtype=torch.float64)  # 32 B
    storages = collect_storages([weight, weight[2:5], weight.view(4, 4).t(), None, other])
    assert total(storages) == 96 and len(storages) == 2
    assert storage_key(weight[3:])[0] == storage_key(weight)[0] and storage_key(weight[3:])[1] == 64


def test_a_device_filter_keeps_that_device_only_and_an_index_less_device_matches_any_index() -> None:
    assert collect_storages([torch.zeros(4)], device=torch.device("meta")) == {}
    assert total(collect_storages([torch.zeros(4)], device=torch.device("cpu"))) == 16
    assert same_device(torch.device("cuda"), torch.device("cuda", 1))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not same_device(torch.device("cpu"), torch.device("cuda"))


def test_nested_tensors_reach_optimizer_state_shapes() -> None:
    state = {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(1.0)}, 1: {"exp_avg": torch.zeros(2)}}
    assert sorted(t.numel() for t in nested_tensors([state, (torch.zeros(5), "text", 3)])) == [1, 2, 3, 5]
