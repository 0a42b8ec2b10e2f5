"""torch.compile's internals hf-memwatch reads to tell a compiled model, with their probe. Verified on torch 2.13.0.

``torch.compile(model)`` returns a ``torch._dynamo.eval_frame.OptimizedModule`` wrapping the model;
``model.compile()`` compiles in place and keeps the compiled call in ``Module._compiled_call_impl``.
:mod:`hf_memwatch.integration.compiled` hooks the compiled wrapper the Trainer calls and says what a
compiled step changes. Without these (:data:`COMPILED` failed) a compiled model is taken for an eager one.
"""

from __future__ import annotations

from typing import Any

import torch

from .probes import Probe, holds


def _optimized_module() -> type:
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule


COMPILED = Probe("torch", "torch._dynamo.eval_frame.OptimizedModule, Module._compiled_call_impl",
                 "telling a torch.compile'd model (taken for an eager one)",
                 lambda: isinstance(_optimized_module(), type)
                 and "_compiled_call_impl" in vars(torch.nn.Module).get("__annotations__", {}) | vars(torch.nn.Module))


def optimized_module_type() -> type | None:
    """``OptimizedModule`` (what ``torch.compile(model)`` returns), None where it cannot be told."""
    return _optimized_module() if holds(COMPILED) else None


def compiled_in_place(module: Any) -> bool:
    """Whether ``module`` itself was compiled in place (``module.compile()``)."""
    return holds(COMPILED) and getattr(module, "_compiled_call_impl", None) is not None
