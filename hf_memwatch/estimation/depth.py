"""The step's simulation at the model's depth: by depth extrapolation where it is exact and wanted
(:mod:`.layers`: 2 and 3 layers replayed, a checkpointed run 3 and 4 with its backward split per recomputed
layer), else every layer replayed (:func:`~.step.simulate_step`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..core.categories import AFTER_BACKWARD
from .layers import (
    AUTO_MIN_CHECKPOINTED_LAYERS,
    AUTO_MIN_LAYERS,
    CHECKPOINTED_DEPTHS,
    SHORT_DEPTHS,
    extrapolate,
    extrapolate_backward,
    homogeneous_layers,
    truncated,
)
from .short_model import ShortModel
from .step import StepInputs, StepSimulation, simulate_step


def simulate_at_depth(model: torch.nn.Module, fake_mode: Any, request: Any, inputs: StepInputs,
                      notes: list[str], short: ShortModel | None = None) -> StepSimulation:
    """The step's simulation: by depth extrapolation where exact and wanted.

    The details (logits) do not depend on depth: the deeper short simulation's are kept; so are its
    peak tensors (a note says so: the layers beyond hold more of the same). A checkpointed run is
    simulated at :data:`~.layers.CHECKPOINTED_DEPTHS` with its backward split where each layer's
    recomputation begins, each window extended on its own line (:func:`~.layers.extrapolate_backward`).
    ``short``: ``model`` is a short model standing for its full depth (:mod:`.short_model`: its stack
    homogeneous, checked where it was built); where every layer is replayed, its full build is.
    """
    config = inputs.config
    depth = short.depth if short is not None else getattr(config, "num_hidden_layers", 0) or 0
    checkpointed = bool(request.activation_checkpointing)
    short_depths, least = (CHECKPOINTED_DEPTHS, AUTO_MIN_CHECKPOINTED_LAYERS) if checkpointed \
        else (SHORT_DEPTHS, AUTO_MIN_LAYERS)
    if request.extrapolate_layers is False:
        stack = None
    elif short is not None:
        stack = short.stack
    else:
        stack = homogeneous_layers(model, config, short_depths)
    if stack is not None and (request.extrapolate_layers or depth >= least):
        at_depths, windows, simulation = {}, {}, None
        for layers in short_depths:
            with truncated(stack, config, layers):
                simulation = simulate_step(model, fake_mode, request, inputs,
                                           windows=stack if checkpointed else None)
            at_depths[layers] = simulation.phase_classes
            windows[layers] = simulation.phase_windows.get(AFTER_BACKWARD)
        # checkpointing: a layer's forward replayed inside the backward moves the backward's high between
        # moments of the step as depth grows (layers.py's module doc): each window on its own line
        extended = extrapolate(at_depths, depth, None if checkpointed else stack)
        if extended is not None and checkpointed:
            backward = extrapolate_backward(windows, depth)
            extended = None if backward is None else {**extended, AFTER_BACKWARD: backward}
        if extended is None:
            notes.append(f"every layer replayed: a line through {short_depths[0]} and {short_depths[1]} layers "
                         "is not exact here (layers.extrapolate)")
        else:
            notes.append(f"depth extrapolated from {short_depths[0]} and {short_depths[1]} simulated layers"
                         + (" (the backward per recomputed layer)" if checkpointed else ""))
            if simulation.phase_tensors:
                notes.append(f"peak tensors: those of the {short_depths[1]}-layer simulation")
            return simulation.replace(phase_classes=extended, phase_windows={})
    if short is not None:
        model = short.full()
        inputs = dataclasses.replace(inputs, config=model.config)
    return simulate_step(model, fake_mode, request, inputs)
