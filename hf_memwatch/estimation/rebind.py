"""Instance-level ``forward`` patches whose closure holds the original model, rebound in a copy.

TRL's ``add_fused_lm_head`` (SFTTrainer and its subclasses: GKD) replaces ``model.forward`` by a
``functools.wraps`` function bound to the model, whose closure keeps ``original_forward`` — the
model's *own* bound ``forward``. ``copy.deepcopy`` binds the patched method to the copy but keeps
the function (and its closure) as is, so a call without ``fused_lm_head`` on the fake copy ran the
*real* model's modules: real weights in the fake graph, and the replay's backward wrote fake
gradients into the live model's parameters (the auto mode's GKD run then failed in its first
``grad_norm.item()``; and the real model's layers, not checkpointing yet, ignored the copy's
checkpointing: GKD with checkpointing +7.5% over the profiler before, see benchmarks/trl_accuracy.md).
"""

from __future__ import annotations

import types
from typing import Any

import torch


def _rebound(value: Any, memo: dict[int, Any]) -> Any:
    """``value`` with a bound method of an original module bound to that module's copy instead."""
    if isinstance(value, types.MethodType) and isinstance(value.__self__, torch.nn.Module):
        copy = memo.get(id(value.__self__))
        if isinstance(copy, torch.nn.Module) and copy is not value.__self__:
            return types.MethodType(value.__func__, copy)
    return value


def _function_rebound(function: types.FunctionType, memo: dict[int, Any]) -> types.FunctionType:
    """``function`` with each closure cell that holds an original module's bound method rebound (or itself)."""
    cells, changed = [], False
    for cell in function.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            cells.append(cell)
            continue
        rebound = _rebound(value, memo)
        changed |= rebound is not value
        cells.append(types.CellType(rebound) if rebound is not value else cell)
    if not changed:
        return function
    copy = types.FunctionType(function.__code__, function.__globals__, function.__name__, function.__defaults__,
                              tuple(cells))
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__dict__.update(function.__dict__)
    return copy


def rebind_patched_forwards(copied: torch.nn.Module, memo: dict[int, Any]) -> None:
    """In ``copied`` (a ``deepcopy`` made with ``memo``), every instance ``forward`` whose closure calls the
    original module's methods calls the copy's."""
    for module in copied.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, types.MethodType) and isinstance(forward.__func__, types.FunctionType):
            function = _function_rebound(forward.__func__, memo)
            if function is not forward.__func__:
                module.forward = types.MethodType(function, forward.__self__)


__all__ = ["rebind_patched_forwards"]
