"""The worst batch of the whole dataset (planning/lengths.py) on real datasets and real collators."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_memwatch.core.sequence_length import has_image_inputs, sequence_length
from hf_memwatch.planning.lengths import worst_batch
from hf_memwatch.testing.estimate_truth import ListDataset

LONG_INDEX, LONG = 12_345, 300


def short_lengths(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 40, n).tolist()
    lengths[LONG_INDEX] = LONG
    return lengths


def test_a_long_sample_past_index_10000_is_found_in_a_datasets_dataset_from_arrow():
    import datasets

    lengths = short_lengths(20_000)
    ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in lengths], "label": [0] * len(lengths)})
    wb = worst_batch(ds, micro_batch_size=4, pad_to_multiple_of=64, max_length=None)
    assert (wb.index, wb.length, wb.source) == (LONG_INDEX, LONG, "arrow")
    assert wb.batch_length == 320 and wb.batch_tokens == 320 * 4  # 300 rounded up to 64s
    assert wb.scanned == wb.size == 20_000
    # Truncation caps it; the rounding applies after (as the tokenizer's pad does).
    capped = worst_batch(ds, micro_batch_size=4, max_length=200, pad_to_multiple_of=64)
    assert capped.length == LONG and capped.batch_length == 256
    assert any("truncated to max_length 200" in note for note in capped.notes)
    # A shuffled dataset (index mapping over the table) reports the index as the sampler sees it.
    shuffled = ds.shuffle(seed=1)
    found = worst_batch(shuffled, micro_batch_size=4)
    assert found.length == LONG and len(shuffled[found.index]["input_ids"]) == LONG
    # As a torch-formatted dataset too.
    assert worst_batch(ds.with_format("torch")).index == LONG_INDEX


def test_a_long_sample_past_index_10000_is_found_in_a_torch_map_style_dataset():
    lengths = short_lengths(12_500)
    items = [{"input_ids": torch.ones(n, dtype=torch.long), "labels": torch.tensor(i % 2)}
             for i, n in enumerate(lengths)]
    wb = worst_batch(ListDataset(items), micro_batch_size=8, pad_to_multiple_of=8)
    assert (wb.index, wb.length, wb.batch_length, wb.source) == (LONG_INDEX, LONG, 304, "scan")
    assert wb.scanned == 12_500 and not wb.notes


def test_the_scan_stops_at_its_time_budget_and_says_so():
    class SlowDataset(torch.utils.data.Dataset):
        def __len__(self):
            return 1_000_000

        def __getitem__(self, index):
            return {"input_ids": list(range(index % 50 + 1))}

    wb = worst_batch(SlowDataset(), scan_seconds=0.05)
    assert wb.source == "scan-partial" and wb.scanned < 1_000_000
    assert any("stopped after 0.05 s" in note for note in wb.notes)
    assert wb.batch_length == wb.length == 50  # nothing better known
    # With a truncation length, the unread rest is planned for at that length.
    capped = worst_batch(SlowDataset(), scan_seconds=0.05, max_length=128)
    assert capped.length == 50 and capped.batch_length == 128
    assert any("the unread samples may be longer" in note for note in capped.notes)


def test_an_iterable_dataset_is_never_read():
    class Untouchable(torch.utils.data.IterableDataset):
        def __iter__(self):
            raise AssertionError("the user's iterator was consumed")

    wb = worst_batch(Untouchable(), micro_batch_size=2, max_length=512, pad_to_multiple_of=64)
    assert (wb.source, wb.index, wb.length, wb.batch_length, wb.batch_tokens) == ("max_length", None, None, 512, 1024)
    assert any("iterable dataset: not read" in note and "max_length" in note for note in wb.notes)
    fallback = worst_batch(Untouchable(), model_max_length=1024)
    assert fallback.batch_length == 1024 and "model_max_length" in fallback.notes[0]

    def generator():
        raise AssertionError("consumed")
        yield {}

    import datasets

    streamed = datasets.IterableDataset.from_generator(generator)
    assert worst_batch(streamed, max_length=128).batch_length == 128


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ({"input_ids": torch.ones(7), "labels": torch.tensor(1)}, (7, False)),  # 0-d label
        ({"input_ids": np.arange(11), "label": np.int64(1)}, (11, False)),  # numpy
        ({"input_ids": torch.ones(1, 5)}, (5, False)),  # a tokenizer's batch of one
        ({"text": {"input_ids": [1, 2, 3, 4]}, "label": 0}, (4, False)),  # nested dict
        ({"pixel_values": torch.zeros(3, 32, 32), "labels": torch.tensor(3)}, (None, True)),  # image only
        ({"pixel_values": torch.zeros(3, 32, 32), "input_ids": [1] * 9}, (9, True)),  # VLM
        ((torch.ones(6), torch.tensor(0)), (6, False)),  # tuple of fields
        (torch.tensor(3), (None, False)),
        ({"sentence": "not tokenized", "label": 1}, (None, False)),
    ],
)
def test_item_shapes(item, expected):
    assert (sequence_length(item), has_image_inputs(item)) == expected


def test_image_dataset_is_reported_as_such_without_a_sequence_length():
    items = [{"pixel_values": torch.zeros(3, 8, 8), "labels": torch.tensor(i)} for i in range(20)]
    wb = worst_batch(ListDataset(items), micro_batch_size=4)
    assert wb.pixel_values and wb.length is None and wb.source == "unknown"
    assert any("pixel_values" in note for note in wb.notes)


def test_collator_settings_and_padding_free():
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorWithFlattening, DataCollatorWithPadding, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[PAD]": 0, "a": 1}, "[PAD]")),
                                        pad_token="[PAD]")
    items = [{"input_ids": [1] * n} for n in (10, 70, 33, 65)]
    padded = worst_batch(ListDataset(items), DataCollatorWithPadding(tokenizer, pad_to_multiple_of=32),
                         micro_batch_size=2)
    assert (padded.index, padded.batch_length, padded.batch_tokens) == (1, 96, 192)
    fixed = worst_batch(ListDataset(items), DataCollatorWithPadding(tokenizer, padding="max_length", max_length=256),
                        micro_batch_size=2)
    assert (fixed.length, fixed.batch_length) == (70, 256)
    flat = worst_batch(ListDataset(items), DataCollatorWithFlattening(), micro_batch_size=2,
                       group_by_length=True)
    assert (flat.batch_length, flat.batch_tokens) == (135, 135)  # 70 + 65 in one row
    assert any("padding-free" in note for note in flat.notes)
    assert any("group_by_length" in note for note in flat.notes)


def test_datasets_without_token_ids_text_images_or_a_transform():
    import datasets

    text = datasets.Dataset.from_dict({"sentence": ["a b", "c"], "label": [0, 1]})
    wb = worst_batch(text, max_length=64)
    assert (wb.source, wb.length, wb.batch_length) == ("max_length", None, 64)
    assert any("no 'input_ids' column" in note for note in wb.notes)

    # Tokenized on access (set_transform): the items are read, the Arrow column would not tell.
    lengths = [3, 50, 7]
    on_the_fly = datasets.Dataset.from_dict({"n": lengths})
    on_the_fly.set_transform(lambda batch: {"input_ids": [[1] * n for n in batch["n"]]})
    found = worst_batch(on_the_fly)
    assert (found.index, found.length, found.source) == (1, 50, "scan")

    images = datasets.Dataset.from_dict({"pixel_values": [[[0.0] * 4] * 4] * 3, "input_ids": [[1] * 5, [1] * 9, [1]]})
    seen = worst_batch(images)
    assert seen.pixel_values and (seen.index, seen.length) == (1, 9)
    assert any("pixel_values" in note for note in seen.notes)


def test_the_documented_examples_hold():
    import doctest

    from hf_memwatch.measure import footprint, leaks
    from hf_memwatch.planning import budget, lengths

    for module in (footprint, leaks, budget, lengths):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, module.__name__
