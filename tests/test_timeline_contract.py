"""The README lists exactly the timeline events ``core/records.py`` defines.

Every record a test writes is validated where it is written (``conftest.records_match_their_definitions``)
and a whole-suite run checks that every kind was written (``conftest.pytest_sessionfinish``): neither
depends on the order the tests run in.
"""

from __future__ import annotations

import re
from pathlib import Path

from hf_memwatch.core.records import RECORDS, validate_record

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_lists_exactly_the_defined_events() -> None:
    line = next(line for line in README.read_text().splitlines() if line.startswith("Events:"))
    listed = set(re.findall(r"`([a-z_]+)`", line))
    assert listed == set(RECORDS)


def test_a_record_unlike_its_definition_is_named() -> None:
    assert validate_record({"event": "step", "peak": "big"})
