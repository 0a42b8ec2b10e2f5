"""``Advice``: a memory saving a planner shows and never applies (the catalogue's, the engines').

Below the planner, so that each engine (:mod:`hf_memwatch.engines`) states its own advice where its
replay rules are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Advice:
    """A memory saving that changes what the run computes or trains: shown with its predicted saving,
    never applied by a planner. ``saving`` is bytes per device; ``how`` says what to change and its cost."""

    name: str
    saving: int
    how: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "saving": self.saving, "how": self.how}
