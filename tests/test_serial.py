"""``core/serial``: the dataclass machinery every timeline record is written and read back with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from hf_memwatch.core.serial import Serial, optional


@dataclass(kw_only=True)
class Inner(Serial):
    n: int


@dataclass(kw_only=True)
class Outer(Serial):
    KEYS: ClassVar[dict[str, str]] = {"klass": "class"}
    NESTED: ClassVar[dict[str, type[Serial]]] = {"inner": Inner}
    klass: str
    sizes: list[int]
    inner: Inner | None = optional()
    note: str | None = optional()


def test_fields_are_written_in_order_optional_ones_only_when_known_and_read_back() -> None:
    record = Outer(klass="other", sizes=[1, 2], inner=Inner(n=3), extra={"later": True})
    data = record.to_dict()
    assert list(data) == ["class", "sizes", "inner", "later"] and data["inner"] == {"n": 3}  # note: None, left out
    assert Outer.from_dict(data) == record  # the nested object and the unknown key come back
    assert [slot.key for slot in Outer.slots()] == ["class", "sizes", "inner", "note"]
    assert [slot.required for slot in Outer.slots()] == [True, True, False, False]


def test_a_missing_required_key_fails_unless_read_leniently() -> None:
    with pytest.raises(ValueError, match="missing 'sizes'"):
        Outer.from_dict({"class": "x"})
    old = Outer.from_dict({"class": "x"}, lenient=True)  # an older timeline: its type's absent value
    assert (old.sizes, old.inner, old.replace(note="n").note) == ([], None, "n")
