"""Models a Trainer holds beside the one it trains — TRL's ``ref_model``, a distillation teacher, a
reward model: resident weights a user must see, counted as ``weights`` and shown apart.

:func:`held_models` finds them; :class:`HeldModels` contributes their storages to the step monitor
(:class:`~hf_memwatch.measure.monitor.StorageContributor`) and adds ``frozen_models`` — name ->
bytes not shared with the trained model — to every fully measured snapshot.
"""

from __future__ import annotations

from typing import Any

import torch

from .attribution import weight_storages, weight_tensors


def held_models(trainer: Any) -> dict[str, torch.nn.Module]:
    """Other models the Trainer holds beside the one it trains: attribute name -> module (wrappers of
    the trained model excluded)."""
    trained = {id(m) for m in (getattr(trainer, "model", None), getattr(trainer, "model_wrapped", None),
                                getattr(getattr(trainer, "model", None), "module", None)) if m is not None}
    found = {}
    for name, value in vars(trainer).items():
        if not isinstance(value, torch.nn.Module) or id(value) in trained:
            continue
        inner = getattr(value, "module", None)
        if inner is None or id(inner) not in trained:
            found[name] = value
    return found


class HeldModels:
    """Counts the held models' parameters and buffers as weights, each storage once."""

    def __init__(self, models: dict[str, torch.nn.Module]) -> None:
        self.models = models

    def known_tensors(self, monitor: Any) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for module in self.models.values():
            tensors.extend(weight_tensors(module))
        return tensors

    def class_storages(self, monitor: Any) -> dict[str, dict[int, int]]:
        held: dict[int, int] = {}
        for module in self.models.values():
            held.update(weight_storages(module, monitor.device))
        return {"weights": held}

    def adjust(self, record: dict[str, Any], monitor: Any, phase: str, window_peak: int | None) -> None:
        trained = set(weight_storages(monitor.model, monitor.device)) if monitor.model is not None else set()
        record["frozen_models"] = {
            name: sum(v for k, v in weight_storages(module, monitor.device).items() if k not in trained)
            for name, module in self.models.items()
        }
