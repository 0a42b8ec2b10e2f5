"""torch's ``GradScaler`` internals the fp16 CUDA replay reads, with their probe. Verified on torch 2.13.0
(``torch/amp/grad_scaler.py``).

``estimation/cuda_optim.StepScaler`` runs torch's own ``GradScaler`` on the replay's fake tensors and
names what it keeps: the scale and growth tracker its first ``scale`` makes
(``_lazy_init_scale_growth_tracker``, ``_scale``, ``_growth_tracker``), the per-device ``found_inf`` in
``_per_optimizer_states[id(optimizer)]`` until ``update()``, and a fused optimizer's
``_step_supports_amp_scaling``. Without them (:data:`GRAD_SCALER` failed) an fp16 CUDA estimate is
replayed without the scaler (its few bytes and the unscale's temporaries not counted), warned.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .probes import Probe, holds


def _scaler_as_verified() -> bool:
    source = inspect.getsource(torch.amp.GradScaler)
    return all(name in source for name in ("def _lazy_init_scale_growth_tracker", "self._scale", "self._growth_tracker",
                                           "self._per_optimizer_states", "_step_supports_amp_scaling"))


GRAD_SCALER = Probe("torch", "GradScaler._lazy_init_scale_growth_tracker, _scale, _growth_tracker, "
                    "_per_optimizer_states, optimizer._step_supports_amp_scaling",
                    "replaying fp16's GradScaler on a CUDA target (its tensors not counted)", _scaler_as_verified)


def scaler_replayable() -> bool:
    """Whether the GradScaler replay can read what it names (:data:`GRAD_SCALER`, run once)."""
    return holds(GRAD_SCALER)


def scaler_tensors(scaler: Any, device: Any) -> list[torch.Tensor]:
    """The scale and growth tracker, made as the scaler's first ``scale`` makes them."""
    scaler._lazy_init_scale_growth_tracker(device)
    return [scaler._scale, scaler._growth_tracker]


def scaler_optimizer_state(scaler: Any, optimizer: Any) -> dict[str, Any]:
    """The scaler's state for ``optimizer`` (``stage``, ``found_inf_per_device``)."""
    return scaler._per_optimizer_states[id(optimizer)]


def steps_with_amp_scaling(optimizer: Any) -> bool:
    """Whether ``optimizer`` (a fused one) takes the scale and ``found_inf`` itself."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))
