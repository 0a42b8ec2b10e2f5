"""Every timeline record the suite wrote matches its typed definition; the README lists exactly those events.

Runs last (file order): the records were collected by ``conftest.check_every_timeline_record``.
"""

from __future__ import annotations

import re
from pathlib import Path

from conftest import RECORD_PROBLEMS, WRITTEN_RECORDS

from hf_memwatch.core.records import RECORDS

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_record_written_matches_its_definition() -> None:
    assert not RECORD_PROBLEMS, sorted(set(RECORD_PROBLEMS))[:20]


def test_the_readme_lists_exactly_the_defined_events() -> None:
    line = next(line for line in README.read_text().splitlines() if line.startswith("Events:"))
    listed = set(re.findall(r"`([a-z_]+)`", line))
    assert listed == set(RECORDS)


def test_the_suite_wrote_every_kind_of_record_it_could() -> None:
    if len(WRITTEN_RECORDS) < 2:  # this file run alone
        return
    # oom and oom_recovered records are written in subprocesses (a real out-of-memory); the rest here
    assert set(RECORDS) - {"oom", "oom_recovered"} <= set(WRITTEN_RECORDS), WRITTEN_RECORDS
