"""Models a Trainer holds beside the one it trains — TRL's ``ref_model``, a distillation teacher, a
reward model (an attribute, or an entry of a list such as ``reward_funcs``): resident weights a user
must see, counted as ``weights`` and shown apart.

:func:`held_models` finds them; :class:`HeldModels` contributes their storages to the step monitor
(:class:`~hf_memwatch.measure.monitor.StorageContributor`) and adds ``frozen_models`` — name ->
bytes not shared with the trained model — to every fully measured snapshot.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.records import Snapshot
from .attribution import weight_storages, weight_tensors


def held_model_slots(trainer: Any) -> dict[str, tuple[str, Any]]:
    """Where each held model sits: name -> (attribute, key in it or None), the module itself excluded.

    A model in an attribute (``ref_model``, ``teacher_model``, ``value_model``) is named by it; one in a
    list, tuple or dict (GRPO's and RLOO's ``reward_funcs``, Online DPO's) as ``reward_funcs[0]``.
    Wrappers of the trained model (DDP, accelerate) are excluded.
    """
    trained = {id(m) for m in (getattr(trainer, "model", None), getattr(trainer, "model_wrapped", None),
                                getattr(getattr(trainer, "model", None), "module", None)) if m is not None}

    def other(value: Any) -> bool:
        if not isinstance(value, torch.nn.Module) or id(value) in trained:
            return False
        inner = getattr(value, "module", None)
        return inner is None or id(inner) not in trained

    found: dict[str, tuple[str, Any]] = {}
    for name, value in vars(trainer).items():
        if other(value):
            found[name] = (name, None)
        elif isinstance(value, (list, tuple)) and len(value) <= 64:
            found.update({f"{name}[{i}]": (name, i) for i, item in enumerate(value) if other(item)})
        elif isinstance(value, dict) and len(value) <= 64:
            found.update({f"{name}[{key!r}]": (name, key) for key, item in value.items() if other(item)})
    return found


def held_models(trainer: Any) -> dict[str, torch.nn.Module]:
    """Other models the Trainer holds beside the one it trains: name -> module (see :func:`held_model_slots`).

    Each module once (a reward model both in an attribute and in ``reward_funcs`` is one model).
    """
    found: dict[str, torch.nn.Module] = {}
    seen: set[int] = set()
    for name, (attribute, key) in held_model_slots(trainer).items():
        value = getattr(trainer, attribute)
        module = value if key is None else value[key]
        if id(module) not in seen:
            seen.add(id(module))
            found[name] = module
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

    def adjust(self, record: Snapshot, monitor: Any, phase: str, window_peak: int | None) -> None:
        trained = set(weight_storages(monitor.model, monitor.device)) if monitor.model is not None else set()
        record.frozen_models = {
            name: sum(v for k, v in weight_storages(module, monitor.device).items() if k not in trained)
            for name, module in self.models.items()
        }
