"""The timeline: ``<output_dir>/memwatch/timeline.jsonl`` (``timeline.rank<N>.jsonl`` on other ranks).

One JSON object per line; a contract read by the report, the auto mode and users' scripts. The
records are typed in :mod:`hf_memwatch.core.records`. All figures in bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

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

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")

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
