"""The one sequence-length rule (hf_memwatch/core/sequence_length.py) and its callers agreeing on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_memwatch.core.sequence_length import IMAGE_KEYS, has_image_inputs, sequence_length, value_length


def test_input_ids_alone():
    assert sequence_length({"input_ids": [1, 2, 3]}) == 3


def test_labels_longer_than_input_ids_count():
    # a seq2seq sample: the decoder runs over the labels, so the sample is as long as they are
    assert sequence_length({"input_ids": [1] * 4, "labels": [1] * 11}) == 11
    assert sequence_length({"input_ids": torch.ones(4), "labels": torch.ones(11)}) == 11


def test_a_scalar_label_has_no_length():
    assert sequence_length({"input_ids": torch.ones(7), "labels": torch.tensor(1)}) == 7
    assert sequence_length({"input_ids": np.arange(5), "label": np.int64(1)}) == 5


def test_the_last_dimension_of_a_tensor_or_array():
    assert sequence_length({"input_ids": torch.ones(1, 5)}) == 5
    assert sequence_length({"input_ids": np.zeros((2, 3, 13))}) == 13


def test_a_nested_list_is_measured_by_its_longest_inner_sequence():
    assert value_length([[1, 2], [1, 2, 3, 4, 5], []]) == 5
    assert sequence_length({"input_ids": [[1, 2], [1, 2, 3]]}) == 3  # not 2, the number of rows


def test_a_nested_dict_by_its_longest_field():
    assert sequence_length({"text": {"input_ids": [1, 2, 3, 4]}, "label": 0}) == 4
    assert sequence_length({"a": {"b": {"input_ids": list(range(6))}}, "c": [1]}) == 6


@pytest.mark.parametrize("key", sorted(IMAGE_KEYS))
def test_image_keys_are_skipped_and_reported(key):
    item = {key: torch.zeros(3, 224, 224), "input_ids": [1] * 9}
    assert sequence_length(item) == 9  # not 224
    assert has_image_inputs(item)


def test_image_inputs_nested_are_reported():
    assert has_image_inputs({"vision": {"pixel_values": torch.zeros(3, 8, 8)}, "input_ids": [1]})
    assert has_image_inputs((torch.ones(2), {"images": None}))
    assert not has_image_inputs({"input_ids": [1, 2]}) and not has_image_inputs(torch.ones(3))


def test_none_when_nothing_has_a_length():
    assert sequence_length({"pixel_values": torch.zeros(3, 8, 8), "labels": torch.tensor(3)}) is None
    assert sequence_length({"sentence": "not tokenized", "label": 1}) is None
    assert sequence_length({}) is None
    assert sequence_length(torch.tensor(3)) is None
    assert sequence_length("text") is None and sequence_length(None) is None


def test_an_empty_sequence_is_zero_not_none():
    assert sequence_length({"input_ids": []}) == 0


def test_text_and_lists_of_strings_have_no_length():
    assert value_length("abc") is None and value_length(b"abc") is None
    assert sequence_length({"words": ["a", "b", "c"], "input_ids": [1]}) == 1


def test_a_tuple_of_fields_and_a_bare_value():
    assert sequence_length((torch.ones(6), torch.tensor(0))) == 6
    assert sequence_length(torch.ones(2, 8)) == 8 and sequence_length([1, 2, 3]) == 3


def test_a_collated_batch_is_measured_like_a_sample():
    batch = {"input_ids": torch.ones(4, 32, dtype=torch.long), "attention_mask": torch.ones(4, 32),
             "labels": torch.ones(4, 40, dtype=torch.long), "pixel_values": torch.zeros(4, 3, 64, 64)}
    assert sequence_length(batch) == 40


def test_the_replay_picks_the_sample_whose_labels_are_longest():
    from hf_memwatch.estimation.trainer_replay import longest_index, longest_indices

    data = [{"input_ids": [1] * 10, "labels": [1] * 10}, {"input_ids": [1] * 8, "labels": [1] * 30},
            {"pixel_values": torch.zeros(3, 99, 99), "label": 0}]
    assert longest_index(data) == (1, 30)
    assert longest_indices(data, 2) == [1, 0]
    assert longest_index([{"label": 1}]) == (0, 0)  # nothing has a length: 0, as before


def test_the_planner_scan_and_the_arrow_reader_agree_with_the_rule():
    import datasets

    from hf_memwatch.planning.lengths import worst_batch

    rows = {"input_ids": [[1] * 5, [1] * 20, [1] * 9], "labels": [[1] * 5, [1] * 6, [1] * 40],
            "words": [["a"] * 99, ["b"], ["c"]]}  # a list of strings: no sequence length
    from_arrow = worst_batch(datasets.Dataset.from_dict(rows), micro_batch_size=1)
    scanned = worst_batch([{k: v[i] for k, v in rows.items()} for i in range(3)], micro_batch_size=1)
    assert (from_arrow.source, from_arrow.index, from_arrow.length) == ("arrow", 2, 40)
    assert (scanned.index, scanned.length) == (2, 40)
