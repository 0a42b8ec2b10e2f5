"""The README lists exactly the timeline events ``core/records.py`` defines.

Every record a test writes is validated where it is written (``conftest.records_match_their_definitions``)
and a whole-suite run checks that every kind was written (``conftest.pytest_sessionfinish``): neither
depends on the order the tests run in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hf_memwatch.core.records import RECORDS, StepRecord, contract_table, optional, validate_record

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_lists_exactly_the_defined_events() -> None:
    line = next(line for line in README.read_text().splitlines() if line.startswith("Events:"))
    listed = set(re.findall(r"`([a-z_]+)`", line))
    assert listed == set(RECORDS)


def test_a_record_unlike_its_definition_is_named() -> None:
    assert validate_record({"event": "step", "peak": "big"})


def test_the_readme_lists_exactly_the_fields_of_each_record() -> None:
    """The README's field table is ``contract_table()``: a field added to a record and not to the
    README (or the other way round) fails here."""
    text = README.read_text()
    block = text.split("<!-- fields: contract_table() -->\n", 1)[1].split("\n<!-- /fields -->", 1)[0]
    assert block == contract_table(), "README's field table is stale: paste contract_table() between the markers"


def test_a_field_added_to_a_record_changes_the_table() -> None:
    @dataclass(kw_only=True)
    class Wider(StepRecord):
        added_later: int | None = optional()

    RECORDS["step"] = Wider
    try:
        assert "`added_later`" in contract_table()
    finally:
        RECORDS["step"] = StepRecord
