"""The timeline: ``<output_dir>/memwatch/timeline.jsonl`` (``timeline.rank<N>.jsonl`` on other ranks).

One JSON object per line; a contract read by the report, the auto mode and users' scripts. The
records are typed in :mod:`hf_memwatch.core.records`. All figures in bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .records import RECORDS, Record, validate_record

TIMELINE_DIRNAME = "memwatch"


def timeline_filename(rank: int) -> str:
    """``timeline.jsonl`` for rank 0, ``timeline.rank<N>.jsonl`` for the others.

    Example:
        >>> timeline_filename(0), timeline_filename(3)
        ('timeline.jsonl', 'timeline.rank3.jsonl')
    """
    return "timeline.jsonl" if rank == 0 else f"timeline.rank{rank}.jsonl"


class TimelineWriter:
    """Append-only JSONL writer; ``flush()`` once per step keeps readers current."""

    def __init__(self, directory: str | os.PathLike[str], rank: int = 0, *, fresh: bool = False) -> None:
        """``fresh`` starts the file anew (a new run); otherwise records are appended (a resumed run)."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / timeline_filename(rank)
        self._fh: TextIO | None = open(self.path, "w" if fresh else "a", encoding="utf-8")  # noqa: SIM115

    @property
    def is_open(self) -> bool:
        """Whether records can still be written (not closed)."""
        return self._fh is not None

    def write(self, record: Record) -> None:
        """Append ``record``: the one place a record in flight becomes its JSON line (:meth:`Record.to_dict`)."""
        if not isinstance(record, Record):
            raise TypeError(f"TimelineWriter.write takes a typed record (core/records.py), not {type(record).__name__}")
        if self._fh is not None:
            self._fh.write(json.dumps(record.to_dict(), separators=(",", ":")) + "\n")

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def find_timelines(path: str | os.PathLike[str]) -> list[Path]:
    """Timeline files for ``path``: a timeline file itself, a ``memwatch`` folder or an output dir.

    Rank 0 first, then the other ranks in order.
    """
    path = Path(path)
    if path.is_file():
        return [path]
    for folder in (path / TIMELINE_DIRNAME, path):
        files = sorted(folder.glob("timeline*.jsonl"), key=_rank_of)
        if files:
            return files
    return []


def _rank_of(path: Path) -> int:
    stem = path.name[: -len(".jsonl")]
    return int(stem.split(".rank", 1)[1]) if ".rank" in stem else 0


def read_timeline(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Records of one timeline file; a torn last line (a run still writing, or killed) is skipped."""
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


@dataclass(frozen=True)
class Unread:
    """A timeline line :func:`read_records` left out: its ``number`` (1-based, among the file's JSON
    lines), why, and ``event`` when it is an event this version does not define (not malformed)."""

    number: int
    why: str
    event: str | None = None


def read_records(path: str | os.PathLike[str], unread: list[Unread] | None = None) -> Iterator[Record]:
    """The typed records of one timeline file: the one reader of the timeline (:mod:`.records`).

    Every line is read into its event's dataclass leniently: a field an older version did not write
    gets its type's absent value (:meth:`~hf_memwatch.core.records.Serial.from_dict`), a key this
    version does not know stays in ``extra``. A line that is no JSON object or has a field of the
    wrong type for its event is left out, and so is an event this version does not define: each is
    appended to ``unread``.

    Example:
        >>> import tempfile
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = Path(folder.name) / "timeline.jsonl"
        >>> lines = ({"event": "leak", "class": "other", "bytes_per_step": 1, "since_step": 2, "step": 6},
        ...          {"event": "step", "peak": "big"}, {"event": "later"}, [1])
        >>> _ = path.write_text("".join(json.dumps(line) + "\\n" for line in lines))
        >>> unread = []
        >>> [(r.EVENT, r.klass, r.rank) for r in read_records(path, unread)]
        [('leak', 'other', None)]
        >>> [(u.number, u.event) for u in unread]
        [(2, None), (3, 'later'), (4, None)]
        >>> folder.cleanup()
    """
    for number, data in enumerate(read_timeline(path), start=1):
        if not isinstance(data, dict):
            _note(unread, Unread(number, "not a JSON object"))
            continue
        event = data.get("event")
        if not isinstance(event, str) or event not in RECORDS:
            _note(unread, Unread(number, f"unknown event {event!r}", event=str(event)))
            continue
        wrong = [problem for problem in validate_record(data) if ": missing " not in problem]
        if wrong:
            _note(unread, Unread(number, wrong[0]))
            continue
        yield RECORDS[event].from_dict(data, lenient=True)


def _note(unread: list[Unread] | None, line: Unread) -> None:
    if unread is not None:
        unread.append(line)
