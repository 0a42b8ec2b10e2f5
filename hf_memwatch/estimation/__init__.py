"""Estimation: a Trainer optimizer step replayed on fake tensors, its peak and class split predicted.

The package's names are loaded at their first use (PEP 562), not when the package is: the engines'
replay rules (:mod:`hf_memwatch.engines`) import this package's modules (the tracker, the classifier,
the optimizer choice), and the facade imports the engines' registry. Were the facade imported with
the package, every engine module would sit in an import cycle through this file (an engine module
imported first: ``engines.zero.backward`` -> ``estimation`` -> ``estimation.estimate`` ->
``engines.registry`` -> ``engines.zero.backward``, half-initialized). ``estimate`` is the function
(the public API), never the submodule of that name, which the import system would otherwise bind here
when it loads it (Python's reference, "Customizing module attribute access": a module's ``__class__``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .estimate import MemoryEstimate, estimate, estimate_eval
    from .fitting import largest_fitting_batch
    from .peft import LoraSpec
    from .quantized import QuantSpec

_NAMES = {"MemoryEstimate": "estimate", "estimate": "estimate", "estimate_eval": "estimate",
          "largest_fitting_batch": "fitting", "LoraSpec": "peft", "QuantSpec": "quantized"}
__all__ = ["LoraSpec", "MemoryEstimate", "QuantSpec", "estimate", "estimate_eval", "largest_fitting_batch"]


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    globals()[name] = value
    return value


class _Estimation(types.ModuleType):
    """This package: the submodule ``estimate`` never shadows the function ``estimate``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _NAMES and isinstance(value, types.ModuleType):
            return  # the import system binding a loaded submodule: the function of that name stays
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Estimation
