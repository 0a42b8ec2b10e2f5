"""hf_memwatch.integration.options: MemWatch's constructor arguments, the first wrong one a single line."""

from __future__ import annotations

import pytest

from hf_memwatch.core.errors import MemWatchConfigError
from hf_memwatch.integration.options import check_options

GOOD = {"detail": "auto", "full_steps": 2, "output_dir": None, "report": True, "top_tensors": 0, "flags": {"auto": False}}


@pytest.mark.parametrize(("name", "value", "message"), [
    ("detail", "everything", r"detail=\.\.\.\) must be 'auto', 'full' or 'light'"),
    ("full_steps", True, r"full_steps=\.\.\.\) must be an int >= 1"),
    ("full_steps", 0, r"full_steps=\.\.\.\) must be an int >= 1"),
    ("output_dir", 3, r"output_dir=\.\.\.\) must be a path"),
    ("report", "later", r"report=\.\.\.\) must be True or False"),
    ("flags", {"auto": "yes"}, r"MemWatch\(auto=\.\.\.\) must be True or False"),
    ("top_tensors", -1, r"top_tensors=\.\.\.\) must be an int >= 0"),
])
def test_each_wrong_argument_is_named_in_one_line(name: str, value: object, message: str) -> None:
    with pytest.raises(MemWatchConfigError, match=message) as caught:
        check_options(**{**GOOD, name: value})
    assert "\n" not in str(caught.value)


def test_the_defaults_pass() -> None:
    check_options(**GOOD)
    check_options(**{**GOOD, "detail": "light", "report": "sync", "output_dir": "out", "top_tensors": 20})
