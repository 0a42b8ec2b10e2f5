"""hf_memwatch.core.advice: a saving a planner shows and never applies, as the plan record carries it."""

from __future__ import annotations

import dataclasses

import pytest

from hf_memwatch.core.advice import Advice


def test_advice_is_a_frozen_record_written_with_its_three_fields() -> None:
    advice = Advice("shorter sequences", saving=3 << 30, how="truncate to 1024 tokens: the model sees less")
    assert advice.as_dict() == {"name": "shorter sequences", "saving": 3 << 30,
                                "how": "truncate to 1024 tokens: the model sees less"}
    assert list(advice.as_dict()) == [f.name for f in dataclasses.fields(Advice)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        advice.saving = 0  # type: ignore[misc]
