"""Depth extrapolation: simulate 2 and 3 identical layers, extend the line to the real depth.

Every class at each phase's high is affine in the number of identical layers (weights, gradients,
optimizer states and saved activations grow by one layer's worth per layer; the temporaries at
the high — the logits' gradient, one parameter's optimizer temporaries — do not), so two short
simulations give the exact figure for any depth — as long as each phase's high stays at the same moment
of the step at every depth. Not so under activation checkpointing (each layer's forward replayed inside
the backward): the sweep's depth check (issue 37, 150 draws at 4-8 layers) found the line through 2 and 3
layers off the full replay on 6 of 68 checkpointed draws (-184,576 B to +4,137,796 B: the high moves
from the logits' gradient to the last layers' gradients, or the short depths' backward high grows faster
than the full depth's) and on none of 71 without checkpointing; :func:`backward_high_stays` guards the
backward without it (a layer saving less than its gradients at small micro-batches). A checkpointed run
is simulated at 3 and 4 layers with its backward split where each layer's recomputation begins
(:func:`recompute_windows`), and each window extended on its own line (:func:`extrapolate_backward`).
Used only when the layer stack is homogeneous:
one ``ModuleList`` whose length is ``config.num_hidden_layers``, every layer of the same type
with the same parameter names, shapes, dtypes and ``requires_grad``, and uniform
``config.layer_types``; otherwise the full model is simulated.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from ..compat.torch_internals import autograd_engine_replayable, in_backward

AUTO_MIN_LAYERS = 6  # below this the full simulation is cheap enough
SHORT_DEPTHS = (2, 3)
# A checkpointed run: 3 and 4 layers (4 is the least depth with a layer between the top's and the bottom's
# neighbours), taken from 8 layers on (7 simulated).
CHECKPOINTED_DEPTHS = (3, 4)
AUTO_MIN_CHECKPOINTED_LAYERS = 8


def _signature(layer: torch.nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers())
    return type(layer).__name__, params, buffers, getattr(layer, "attention_type", None)


def homogeneous_layers(model: torch.nn.Module, config: Any,
                       short: tuple[int, int] = SHORT_DEPTHS) -> torch.nn.ModuleList | None:
    """The model's layer stack when depth extrapolation from the ``short`` depths is exact for it, else None."""
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth <= max(short):
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


# -- a checkpointed run's backward -----------------------------------------------------------------
@contextlib.contextmanager
def recompute_windows(stack: torch.nn.ModuleList | None, phases: Any) -> Iterator[None]:
    """Split the backward where each layer of ``stack`` begins its recomputation (its forward run again
    inside the backward: activation checkpointing), into windows labelled by the layer's index (the first
    one ``"head"``): :meth:`~hf_memwatch.estimation.classify.Phases.split`. Nothing is split where the
    autograd engine cannot be read (:func:`~hf_memwatch.compat.torch_internals.autograd_engine_replayable`)
    or a peak census runs (its high is the phase's): the windows are missing and every layer is replayed."""
    if stack is None or phases.census is not None or not autograd_engine_replayable():
        yield
        return
    # On the layer's every module: Transformers' checkpointing layers recompute their raw ``forward``
    # (``GradientCheckpointingLayer``), not through the layer's own hooks; their modules are called.
    hooks = [module.register_forward_pre_hook(functools.partial(_recomputation_begins, phases, index))
             for index, layer in enumerate(stack) for module in layer.modules()]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _recomputation_begins(phases: Any, index: int, *_: Any) -> None:
    if in_backward() and phases.window != index:  # not the forward: a recomputation inside the backward
        phases.split(index)


# the windows whose lines bound every window of the backward at any depth: the backward's start, the top
# layer's, its neighbour's, the bottom's neighbour's and the bottom's (its index at a depth)
_BACKWARD_WINDOWS = (("head", lambda d: "head"), ("top", lambda d: d - 1), ("below top", lambda d: d - 2),
                     ("above bottom", lambda d: 1), ("bottom", lambda d: 0))


def extrapolate_backward(short: dict[int, list[list[tuple[Any, dict[str, int]]]] | None],
                         depth: int) -> dict[str, int] | None:
    """A checkpointed backward's high at ``depth``, from its windows at two short depths (each backward
    split where a layer's recomputation begins: :func:`recompute_windows`); None where the windows are not
    the expected ones (the start, then every layer from the top down, in each backward).

    In the window of layer ``k`` (of ``L``) the live bytes are those of every window's like: the
    checkpointed inputs of the layers below and its own (``k + 1`` of them), the gradients of the layers
    above (``L - 1 - k``), the layer's recomputed activations: affine in ``k`` and in ``L``. So among the
    middle layers the highest is the top's neighbour or the bottom's, and each named window's classes lie
    on a line in depth; the start's (the logits' gradient, ``L`` inputs) and the top's and bottom's own
    (the final norm's, the embeddings' gradients) too. The high is the first of the highest of the five
    lines at ``depth``, per backward, in time order. Measured by the sweep's depth check (issue 37): the
    line through 2 and 3 layers missed the full replay on 6 of 68 checkpointed draws (-184,576 B to
    +4,137,796 B) where the high moved from the start to the last layers' gradients.

    Example:
        >>> run = lambda d: [[("head", {"a": 10 * d})] + [(k, {"a": 10 * d + 3 * (d - 1 - k)}) for k in range(d - 1, -1, -1)]]
        >>> extrapolate_backward({3: run(3), 4: run(4)}, 10)   # gradients outgrow the inputs: the bottom's
        {'a': 127}
    """
    (low, runs_low), (high, runs_high) = sorted(short.items())
    if not runs_low or not runs_high or len(runs_low) != len(runs_high):
        return None
    for d, runs in ((low, runs_low), (high, runs_high)):
        if any([label for label, _ in run] != ["head", *range(d - 1, -1, -1)] for run in runs):
            return None
    best: dict[str, int] | None = None
    for run_low, run_high in zip(runs_low, runs_high):
        at_low, at_high = dict(run_low), dict(run_high)
        for _, index in _BACKWARD_WINDOWS:
            base, value = at_low[index(low)], at_high[index(high)]
            if set(base) != set(value):
                return None
            line = {name: max(0, base[name] + (depth - low) * (value[name] - base[name]) // (high - low))
                    for name in value}
            if best is None or sum(line.values()) > sum(best.values()):
                best = line
    return best
