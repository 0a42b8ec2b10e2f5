"""``Trainer.hyperparameter_search``: a timeline per trial, and which trial peaked highest.

Every trial is one ``train(trial=...)`` call of the same Trainer. Its records go to
``<memwatch dir>/<run name>/timeline.jsonl``, the run name being the one the Trainer gives the
trial's checkpoints (``run-<trial.number>`` under optuna, ``hp_name(trial)`` when given). After each
trial, ``<memwatch dir>/trials.json`` holds every trial's step peak so far and the highest::

    {"trials": {"run-0": 1048576, "run-1": 2097152}, "highest": "run-1", "peak": 2097152}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..compat.trainer_methods import trial_output_dir
from ..core.units import format_bytes

TRIALS_NAME = "trials.json"


def trial_name(trainer: Any, trial: Any) -> str | None:
    """The run name of ``trial`` as the Trainer names its folder (None outside a search)."""
    if trial is None or getattr(trainer, "hp_search_backend", None) is None:
        return None
    try:
        folder = trial_output_dir(trainer, trial)
        return None if folder is None else os.path.basename(os.path.normpath(folder))
    except Exception:  # noqa: BLE001 - another backend's context missing: one folder for all
        return None


class TrialPeaks:
    """The highest step peak of each trial of a search, in bytes (None: no step measured)."""

    def __init__(self) -> None:
        self.peaks: dict[str, int | None] = {}

    def record(self, name: str, peak: int | None) -> None:
        self.peaks[name] = peak

    def highest(self) -> tuple[str, int] | None:
        """(trial, peak) of the trial that peaked highest so far.

        Example:
            >>> t = TrialPeaks(); t.record("run-0", 5); t.record("run-1", 9); t.record("run-2", None)
            >>> t.highest()
            ('run-1', 9)
        """
        known = [(peak, name) for name, peak in self.peaks.items() if peak is not None]
        if not known:
            return None
        peak, name = max(known)
        return name, peak

    def summary_line(self) -> str:
        highest = self.highest()
        if highest is None:
            return f"hf-memwatch: {len(self.peaks)} trial(s), no step measured"
        others = ", ".join(f"{name} {format_bytes(peak)}" for name, peak in self.peaks.items())
        return (f"hf-memwatch: trial {highest[0]} peaked highest of {len(self.peaks)} so far "
                f"({format_bytes(highest[1])}); {others}")

    def write(self, directory: Path) -> Path:
        highest = self.highest()
        path = Path(directory) / TRIALS_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"trials": self.peaks, "highest": highest and highest[0],
                                    "peak": highest and highest[1]}, indent=1))
        return path
