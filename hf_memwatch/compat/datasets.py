"""The ``datasets`` internal hf-memwatch reads, with its probe. Verified on datasets 4.4.1 and 5.2.0.

A shuffled, selected or filtered ``datasets.Dataset`` keeps its row order in an index mapping over its
Arrow table, ``Dataset._indices`` (a one-column table; ``None`` when the rows are the table's own).
datasets offers no public accessor for it (its own ``query_table`` reads ``_indices`` too). The
planner reads a token column's lengths from the table in one pass (``planning/lengths.py``) and
takes them through this mapping; without it (:data:`INDICES` failed) it reads the lengths item by
item instead (slower, the same lengths).
"""

from __future__ import annotations

from typing import Any

from .probes import Probe, holds


def _selection_kept_in_indices() -> bool:
    import datasets

    selected = datasets.Dataset.from_dict({"n": [10, 11, 12]}).select([2, 0])
    mapping = getattr(selected, "_indices", None)
    return mapping is not None and mapping.column(0).to_pylist() == [2, 0]


INDICES = Probe("datasets", "Dataset._indices (the row mapping of a selected or shuffled dataset)",
                "reading a token column's lengths from the Arrow table in one pass (read item by item)",
                _selection_kept_in_indices)


def reads_row_mapping() -> bool:
    """Whether :func:`row_mapping` can be trusted (:data:`INDICES`, run once)."""
    return holds(INDICES)


def row_mapping(dataset: Any) -> Any:
    """The Arrow table mapping ``dataset``'s rows onto its table's rows, or None (the table's own order)."""
    return dataset._indices
