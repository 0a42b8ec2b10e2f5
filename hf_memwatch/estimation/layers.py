"""Depth extrapolation: simulate 2 and 3 identical layers, extend the line to the real depth.

Every class at each phase's high is affine in the number of identical layers (weights, gradients,
optimizer states and saved activations grow by one layer's worth per layer; the temporaries at
the high — the logits' gradient, one parameter's optimizer temporaries — do not), so two short
simulations give the exact figure for any depth. Used only when the layer stack is homogeneous:
one ``ModuleList`` whose length is ``config.num_hidden_layers``, every layer of the same type
with the same parameter names, shapes, dtypes and ``requires_grad``, and uniform
``config.layer_types``; otherwise the full model is simulated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

AUTO_MIN_LAYERS = 6  # below this the full simulation is cheap enough
SHORT_DEPTHS = (2, 3)


def _signature(layer: torch.nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers())
    return type(layer).__name__, params, buffers, getattr(layer, "attention_type", None)


def homogeneous_layers(model: torch.nn.Module, config: Any) -> torch.nn.ModuleList | None:
    """The model's layer stack when depth extrapolation is exact for it, else None."""
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth <= max(SHORT_DEPTHS):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and len(set(layer_types)) > 1:
        return None
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == depth]
    if len(stacks) != 1:  # none, or an encoder and a decoder stack
        return None
    stack = stacks[0]
    if len({_signature(layer) for layer in stack}) != 1:
        return None
    return stack


@contextlib.contextmanager
def truncated(stack: torch.nn.ModuleList, config: Any, depth: int) -> Iterator[None]:
    """Temporarily keep only the first ``depth`` layers (and tell the config so)."""
    removed = list(stack)[depth:]
    saved_depth = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    del stack[depth:]
    if layer_types is not None:
        config.layer_types = list(layer_types)[:depth]
    config.num_hidden_layers = depth
    try:
        yield
    finally:
        stack.extend(removed)
        if layer_types is not None:
            config.layer_types = layer_types
        config.num_hidden_layers = saved_depth


def extrapolate(short: dict[int, dict[str, dict[str, int]]], depth: int) -> dict[str, dict[str, int]] | None:
    """Per phase and class, the line through the two short depths evaluated at ``depth``.

    Example:
        >>> extrapolate({2: {"p": {"w": 10}}, 3: {"p": {"w": 14}}}, 10)
        {'p': {'w': 42}}
    """
    low, high = sorted(short)
    if set(short[low]) != set(short[high]):
        return None
    out: dict[str, dict[str, int]] = {}
    for phase, classes in short[high].items():
        base = short[low][phase]
        out[phase] = {
            name: max(0, base[name] + (depth - low) * (value - base[name]) // (high - low))
            for name, value in classes.items()
        }
    return out
