"""Which module is running: the scope a :class:`~hf_memwatch.measure.peak_tensors.PeakCensus` stamps
on each allocation (``("model.layers.3.self_attn", "forward")``).

Forward: global module forward pre-/post-hooks (``torch.nn.modules.module``) keep a stack of the
model's module paths; modules outside the model are ignored. Backward: the post-hook registers a
tensor hook on the module's first output that requires grad; autograd calls it when that output's
gradient is ready, i.e. when the module's backward begins (what a backward pre-hook sees), without
wrapping outputs in a ``BackwardHookFunction`` as ``register_full_backward_pre_hook`` would — the
graph, the bytes and the numbers stay as without it. The hooks return nothing and hold no tensor.
Installed only while a step is tracked in full (:meth:`ModuleScope.start`/:meth:`stop`): light steps
run no hook of ours. A recomputed forward under activation checkpointing runs the forward hooks
again, inside the backward: its allocations are stamped ``forward`` of their module.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from .peak_tensors import NO_SCOPE, PeakCensus


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad and output.grad_fn is not None else None
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    for value in values:
        if isinstance(value, torch.Tensor) and value.requires_grad and value.grad_fn is not None:
            return value
    return None


class ModuleScope:
    """Stamps ``census.scope`` with the running module of ``model`` (its ``named_modules`` paths; the
    root is named by its class)."""

    def __init__(self, census: PeakCensus) -> None:
        self.census = census
        self.names: dict[int, str] = {}
        self._stack: list[str] = []
        self._handles: list[Any] = []

    def attach(self, model: torch.nn.Module | None) -> None:
        self.names = {} if model is None else {
            id(module): name or type(model).__name__ for name, module in model.named_modules()}

    def start(self) -> None:
        """Install the hooks (pair with :meth:`stop`)."""
        if self._handles or not self.names:
            return
        self._stack.clear()
        self._handles = [nn_module.register_module_forward_pre_hook(self._enter),
                         nn_module.register_module_forward_hook(self._leave)]

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack.clear()

    def set_stage(self, stage: str) -> None:
        """Between the model's calls (the monitor's phases): no module, ``stage`` (``optimizer`` ...)."""
        self._stack.clear()
        self.census.scope = (f"({stage})", stage)

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None:
            self._stack.append(name)
            self.census.scope = (name, "forward")

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        if self._stack and self._stack[-1] == name:
            self._stack.pop()
        self.census.scope = (self._stack[-1], "forward") if self._stack else (name, "forward")
        if torch.is_grad_enabled():
            tensor = _first_grad_tensor(output)
            if tensor is not None:
                tensor.register_hook(partial(self._backward, (name, "backward")))

    def _backward(self, scope: tuple[str, str], grad: Any) -> None:
        self.census.scope = scope


__all__ = ["ModuleScope", "NO_SCOPE"]
