"""Mixture-of-experts blocks that loop over their experts with data-dependent routing: there the
estimate is an upper bound, and says so.

transformers 4.x's sparse MoE blocks (``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``, ... in
4.57.6) keep their experts in an ``nn.ModuleList`` and route in a Python loop,
``idx, top_x = torch.where(expert_mask[expert_idx])``: each expert runs on the rows the router sent it,
a size only the router's values decide. Fake tensors have no values, so the replay answers ``nonzero``
(the op behind ``torch.where``) with every element true (:func:`~.fake_dispatch._nonzero_of_all_true`):
each expert receives ``tokens x top_k`` rows instead of ``tokens x top_k / experts`` on average, and
its activations and saved tensors are counted that many times over. Measured on 4.57.6 (Mixtral,
4 experts, top 2, 2 layers of hidden 64, batch 2 x 64): estimate 12,393,944 bytes vs the profiler's
7,904,740 (+56.8%, docs/compat.md). transformers 5.x's grouped experts (one ``grouped_mm`` over all
routed rows) have data-independent shapes, and the estimate is exact there.

Detected from the model, not from a version or a class name: a module whose ``experts`` is an
``nn.ModuleList`` of two or more and whose ``forward`` routes with ``torch.where``/``nonzero``.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import torch

ROUTING = re.compile(r"\btorch\.where\(|\.nonzero\(|\bnonzero\(")  # a size read from values


@functools.cache
def _routes_by_value(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):  # no source (compiled, built-in): not known to loop
        return False
    return bool(ROUTING.search(source))


def expert_loops(model: Any) -> list[Any]:
    """The modules of ``model`` that loop over a list of experts with data-dependent routing."""
    if not isinstance(model, torch.nn.Module):
        return []
    return [module for module in model.modules()
            if isinstance(getattr(module, "experts", None), torch.nn.ModuleList) and len(module.experts) > 1
            and _routes_by_value(type(module))]


def expert_loop_notes(model: Any) -> list[str]:
    """One note per looping block class of ``model``: the estimate is an upper bound, and why."""
    notes, seen = [], set()
    for module in expert_loops(model):
        name = type(module).__name__
        if name in seen:
            continue
        seen.add(name)
        experts = len(module.experts)
        top_k = getattr(module, "top_k", None)
        share = f"top_k={top_k} of {experts} experts" if isinstance(top_k, int) else f"a share of {experts} experts"
        notes.append(f"upper bound: {name} loops over its {experts} experts routing tokens with torch.where "
                     f"(a size only the router's values decide); the replay has no values and counts every "
                     f"routed token in every expert, where a real run sends each token to {share} "
                     "(docs/compat.md)")
    return notes
