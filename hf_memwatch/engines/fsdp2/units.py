"""FSDP2's units as accelerate builds them (``fsdp2_prepare_model``), on the estimate's fake model.

accelerate 1.x calls ``fully_shard`` (torch's FSDP2) on, in this order, each module its auto-wrap
policy selects, bottom-up and the model itself excepted (``get_module_children_bottom_up(model)[:-1]``;
the transformer policy matches ``transformer_cls_names_to_wrap``, else the model's
``_no_split_modules``), the input embedding when it is not tied to the output embedding, the *tail*
(the final norm — the base model's last direct child whose class name holds ``Norm`` —, the input
embedding when tied, the output embedding) as one group with ``reshard_after_forward=False``, and the
root (the model; torch's default resolves to no resharding after forward for the root). A parameter
belongs to the first unit that reaches it. Measured on the test GPT-2 (2 gloo ranks): units
``h.0``, ``h.1`` (793,088 B each), the tail ``(wte, ln_f, lm_head)`` (513,024 B) and the root, ``wpe``
(262,144 B); the same FQNs as FSDP's own ``record_function`` labels.

Every parameter is cut along dim 0 in ``N`` chunks of ``ceil(dim0 / N)`` rows (``torch.chunk``;
the last ranks' may be shorter or empty), each rank's padded to the first chunk's size: the rank's
storage is the padded chunk, its parameter (and so its optimizer state) the unpadded rows.

Example:
    >>> chunk_rows(10, 4, 3), chunk_rows(10, 4, 0), padded_rows(10, 4)
    (1, 3, 3)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from ...compat.fsdp import final_norm, no_split_modules


@dataclass
class FsdpUnit:
    """One ``fully_shard`` call: its modules, the parameters it manages and when it reshards."""

    name: str
    modules: tuple[torch.nn.Module, ...]
    params: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = field(default_factory=list)
    reshard_after_forward: bool = True
    root: bool = False


def padded_rows(dim0: int, world_size: int) -> int:
    """Rows of the first chunk (``torch.chunk``), every rank's padded shard."""
    return -(-dim0 // world_size)


def chunk_rows(dim0: int, world_size: int, rank: int) -> int:
    """Rows of ``rank``'s chunk of a ``dim0``-row parameter (0 where ``torch.chunk`` gives it none)."""
    size = padded_rows(dim0, world_size)
    return max(0, min(size, dim0 - size * rank))


def wrap_policy(trainer: Any, model: torch.nn.Module) -> Any:
    """accelerate's own auto-wrap policy function for ``model`` (the Trainer's FSDP plugin, copied so
    its state is not touched before ``train()``; without one, the classes ``_no_split_modules`` names);
    None: no policy (only the embeddings, tail and root)."""
    state = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(state, "fsdp_plugin", None)
    if plugin is None:  # no accelerator (the CLI, a bare model): the transformer policy's default classes
        names = no_split_modules(model)
        return (lambda module: type(module).__name__ in names) if names else None
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    plugin = copy.copy(plugin)
    plugin.set_auto_wrap_policy(model)
    return fsdp2_prepare_auto_wrap_policy(plugin, model)


def reshards_after_forward(trainer: Any, engine: Any) -> bool:
    """The plugin's ``reshard_after_forward`` (FSDP2), else the engine's sharding strategy."""
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "fsdp_plugin", None)
    value = getattr(plugin, "reshard_after_forward", None)
    if isinstance(value, bool):
        return value
    return getattr(engine, "fsdp_strategy", "FULL_SHARD") != "SHARD_GRAD_OP"


def build_units(model: torch.nn.Module, policy: Any, reshard: bool) -> list[FsdpUnit]:
    """The units ``fsdp2_prepare_model`` makes of ``model`` (see the module doc), in creation order."""
    from accelerate.utils.other import get_module_children_bottom_up

    units: list[FsdpUnit] = []
    taken: set[int] = set()
    wrapped: set[int] = set()
    names = {id(module): name for name, module in model.named_modules()}

    def add(modules: tuple[torch.nn.Module, ...], reshard_after: bool, root: bool = False) -> None:
        unit = FsdpUnit(", ".join(names.get(id(m), "?") for m in modules) if not root else "",
                        modules, reshard_after_forward=reshard_after, root=root)
        for module in modules:
            for owner in module.modules():
                for attr, param in owner.named_parameters(recurse=False):
                    if id(param) not in taken:
                        taken.add(id(param))
                        unit.params.append((owner, attr, param))
                    elif any(param is p for _, _, p in unit.params):
                        unit.params.append((owner, attr, param))  # a tied parameter seen twice in one unit
        wrapped.update(id(m) for m in modules)
        units.append(unit)

    if policy is not None:
        for module in get_module_children_bottom_up(model)[:-1]:
            if policy(module) and id(module) not in wrapped:
                add((module,), reshard)
    get_in = getattr(model, "get_input_embeddings", lambda: None)
    get_out = getattr(model, "get_output_embeddings", lambda: None)
    input_embed, output_embed = get_in(), get_out()
    tied = (getattr(input_embed, "weight", None) is not None
            and getattr(input_embed, "weight", None) is getattr(output_embed, "weight", None))
    if not tied and input_embed is not None and id(input_embed) not in wrapped:
        add((input_embed,), reshard)
    norm = final_norm(model)
    tail = (norm, input_embed, output_embed) if tied else (norm, output_embed)
    tail = tuple(m for m in tail if m is not None and id(m) not in wrapped)
    if tail:
        add(tail, False)
    add((model,), False, root=True)
    return [unit for unit in units if unit.params or unit.root]


def state_order(model: torch.nn.Module, units: list[FsdpUnit]) -> list[FsdpUnit]:
    """Units in FSDP's ``all_states`` order: the root, then by ``model.modules()`` (the root's
    post-backward callback reduces the units the backward did not reach in this order)."""
    of_module = {id(m): unit for unit in units for m in unit.modules}
    ordered: list[FsdpUnit] = []
    for module in model.modules():
        unit = of_module.get(id(module))
        if unit is not None and unit not in ordered:
            ordered.append(unit)
    return ordered
