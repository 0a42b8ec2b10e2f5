"""Depth extrapolation: simulate 2 and 3 identical layers, extend the line to the real depth.

Every class at each phase's high is affine in the number of identical layers (weights, gradients,
optimizer states and saved activations grow by one layer's worth per layer; the temporaries at
the high — the logits' gradient, one parameter's optimizer temporaries — do not), so two short
simulations give the exact figure for any depth — as long as each phase's high stays at the same moment
of the step at every depth. Not so under activation checkpointing (each layer's forward replayed inside
the backward): the sweep's depth check (issue 37, 150 draws at 4-8 layers) found the line through 2 and 3
layers off the full replay on 6 of 68 checkpointed draws (-184,576 B to +4,137,796 B: the high moves
from the logits' gradient to the last layers' gradients, or the short depths' backward high grows faster
than the full depth's) and on none of 71 without checkpointing, so ``estimate`` replays every layer of a
checkpointed run; :func:`backward_high_stays` guards the backward without it (a layer saving less than
its gradients at small micro-batches). Used only when the layer stack is homogeneous:
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


def backward_high_stays(short: dict[int, dict[str, dict[str, int]]], stack: torch.nn.ModuleList) -> bool:
    """Whether the backward's high is at the same moment of the step at every depth (else a line through two
    short depths is not the high at the real one).

    A phase's high is a maximum over the moments of the phase, each affine in depth: the line through the
    two short depths is exact only where the same moment stays highest. In the backward, each layer
    processed frees what its forward saved and adds its parameters' gradients. Where a layer saves at
    least its gradients' bytes (``activations`` at the forward's high grow by at least that per layer),
    the live bytes never rise from layer to layer and the high stays at the backward's start; where the
    high at the short depths already holds every layer's gradients (it grows by a layer's gradients per
    layer), it is the backward's end and stays there. Otherwise — activation checkpointing saves one
    input a layer; small micro-batches — the high moves from the start (the logits' gradient) to the
    end at some depth. Measured by the sweep (issue 37), a Mistral-shaped model, 1 x 128 tokens,
    checkpointing, 8 layers: extrapolated 5,352,020 B (the start), the full replay 5,536,596 B (reentrant)
    and 5,468,436 B (non-reentrant), 1,324,800 B of gradients held at its high.

    Example:
        >>> stack = torch.nn.ModuleList([torch.nn.Linear(10, 10) for _ in range(3)])   # 440 B of gradients a layer
        >>> short = {2: {"after_forward": {"activations": 1000}, "after_backward": {"gradients": 0}},
        ...          3: {"after_forward": {"activations": 1100}, "after_backward": {"gradients": 0}}}
        >>> backward_high_stays(short, stack)   # 100 B saved a layer: the high moves
        False
    """
    low, high = sorted(short)
    grads = sum(p.numel() * p.element_size() for p in stack[0].parameters() if p.requires_grad)

    def slope(phase: str, name: str) -> int:
        return (short[high].get(phase, {}).get(name, 0) - short[low].get(phase, {}).get(name, 0)) // (high - low)

    return slope("after_forward", "activations") >= grads or slope("after_backward", "gradients") >= grads


def extrapolate(short: dict[int, dict[str, dict[str, int]]], depth: int,
                stack: torch.nn.ModuleList | None = None) -> dict[str, dict[str, int]] | None:
    """Per phase and class, the line through the two short depths evaluated at ``depth``; None where that
    is not exact: the phases differ, or (``stack`` given) the backward's high moves (:func:`backward_high_stays`).

    Example:
        >>> extrapolate({2: {"p": {"w": 10}}, 3: {"p": {"w": 14}}}, 10)
        {'p': {'w': 42}}
    """
    low, high = sorted(short)
    if set(short[low]) != set(short[high]) or (stack is not None and not backward_high_stays(short, stack)):
        return None
    out: dict[str, dict[str, int]] = {}
    for phase, classes in short[high].items():
        base = short[low][phase]
        out[phase] = {
            name: max(0, base[name] + (depth - low) * (value - base[name]) // (high - low))
            for name, value in classes.items()
        }
    return out
