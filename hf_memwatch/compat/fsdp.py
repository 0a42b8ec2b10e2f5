"""FSDP2's and accelerate's private names the FSDP2 engine (:mod:`hf_memwatch.engines.fsdp2`) relies on,
each with its probe. Verified on torch 2.13 (``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``,
``_fsdp_param.py``, ``_fsdp_common.py``), accelerate 1.15 (``utils/fsdp_utils.py``; 1.10.1 has no ``_find_final_norm``:
:data:`FINAL_NORM` fails there and the FSDP2 replay is off, warned) and transformers 5.23 / 4.57
(``modeling_utils.py``); the torch probes hold on both stacks (torch 2.13).

=======================================  ==================================  ====================================
private thing (``guards``)                what relies on it                   without it (``off``)
=======================================  ==================================  ====================================
``FSDPModule._get_fsdp_state()``,         FSDP2's shards and all-gathered     no FSDP2 parameter group is read on
``FSDPState._fsdp_param_group``           parameters in their classes on a    a live rank: its shards counted as
                                          live rank (``engines/fsdp2/live``)  ``other``
``FSDPParam._unsharded_param``            the unsharded ``.grad`` counted as  it stays in ``other``
                                          gradients on a live rank
``Module._parameters`` (FSDP2's           the FSDP2 replay swaps a module's   the FSDP2 replay is off: the shard
``unsafe_setattr_param``),                shard and unsharded parameter       division's rules estimate the rank
``accelerate.utils.fsdp_utils.            (``engines/fsdp2/replay``); the
_find_final_norm``                        replay's tail unit, as accelerate
                                          builds it
``PreTrainedModel._no_split_modules``     the units of a model without a      no unit but the embeddings, the tail
(transformers)                            Trainer's plugin (the CLI, a bare   and the root
                                          model): accelerate's default policy
=======================================  ==================================  ====================================

The replay also needs the autograd engine's callbacks
(:data:`~hf_memwatch.compat.torch_internals.AUTOGRAD_ENGINE`): :func:`replay_supported` checks both.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from .probes import Probe, holds
from .torch_internals import autograd_engine_replayable, disable_current_modes


def _fully_shard_module(name: str) -> Any:
    """``torch.distributed.fsdp._fully_shard.<name>`` (where torch 2.13 defines FSDP2)."""
    return importlib.import_module(f"torch.distributed.fsdp._fully_shard.{name}")


def _state_has_param_group() -> bool:
    from torch.distributed.fsdp import FSDPModule

    return (callable(getattr(FSDPModule, "_get_fsdp_state", None))
            and "self._fsdp_param_group" in inspect.getsource(_fully_shard_module("_fsdp_state")))


def _param_keeps_unsharded() -> bool:
    return "self._unsharded_param" in inspect.getsource(_fully_shard_module("_fsdp_param"))


def _parameters_settable() -> bool:
    with disable_current_modes():  # no layer built: its initialization would draw from the run's RNG
        owner, param = torch.nn.Module(), torch.nn.Parameter(torch.zeros(1))
        owner.register_parameter("weight", torch.nn.Parameter(torch.ones(1)))
        set_parameter(owner, "weight", param)
        return owner.weight is param and dict(owner.named_parameters())["weight"] is param


def _final_norm_found() -> bool:
    from accelerate.utils import fsdp_utils

    return callable(getattr(fsdp_utils, "_find_final_norm", None))


def _no_split_declared() -> bool:
    import transformers

    return hasattr(transformers.PreTrainedModel, "_no_split_modules")


PARAM_GROUP = Probe("torch", "FSDPModule._get_fsdp_state()._fsdp_param_group",
                    "FSDP2's shards in their memory classes on a live rank (counted as other)", _state_has_param_group)
UNSHARDED_PARAM = Probe("torch", "FSDPParam._unsharded_param",
                        "FSDP2's unsharded gradients as gradients on a live rank (counted as other)",
                        _param_keeps_unsharded)
MODULE_PARAMETERS = Probe("torch", "Module._parameters (FSDP2's unsafe_setattr_param)",
                          "the FSDP2 replay (the shard division's rules instead)", _parameters_settable)
FINAL_NORM = Probe("accelerate", "accelerate.utils.fsdp_utils._find_final_norm",
                   "the FSDP2 replay (the shard division's rules instead)", _final_norm_found)
NO_SPLIT = Probe("transformers", "PreTrainedModel._no_split_modules",
                 "the FSDP2 replay's layer units without a Trainer (only the embeddings, tail and root)",
                 _no_split_declared)


def fsdp_param_group(module: Any) -> Any:
    """The ``FSDPParamGroup`` of a ``fully_shard`` module (None: it has no parameters, or the probe failed)."""
    return module._get_fsdp_state()._fsdp_param_group if holds(PARAM_GROUP) else None


def unsharded_param(param: Any) -> Any:
    """An ``FSDPParam``'s unsharded parameter while it exists, else None (also where the probe failed)."""
    return getattr(param, "_unsharded_param", None) if holds(UNSHARDED_PARAM) else None


def set_parameter(owner: torch.nn.Module, attr: str, param: torch.nn.Parameter) -> None:
    """``owner.<attr> = param`` without ``Module.__setattr__``'s checks (FSDP2's ``unsafe_setattr_param``)."""
    owner._parameters[attr] = param


def final_norm(model: torch.nn.Module) -> Any:
    """accelerate's final norm of ``model`` (the tail unit's first module), or None."""
    from accelerate.utils.fsdp_utils import _find_final_norm

    return _find_final_norm(model)


def no_split_modules(model: Any) -> set[str]:
    """The class names ``model`` keeps whole (transformers' ``_no_split_modules``); empty where the probe failed."""
    return set(getattr(model, "_no_split_modules", None) or ()) if holds(NO_SPLIT) else set()


def replay_supported() -> bool:
    """Whether the FSDP2 replay's private needs hold (each probe warns once where it fails)."""
    return autograd_engine_replayable() and holds(MODULE_PARAMETERS) and holds(FINAL_NORM)
