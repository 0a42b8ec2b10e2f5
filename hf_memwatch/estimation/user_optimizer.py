"""The optimizer a Trainer was handed, replayed: its class, its groups' options, its state rules.

``Trainer(..., optimizers=(opt, None))`` steps ``opt`` (``create_optimizer`` builds one only while
``trainer.optimizer`` is None), and ``Trainer(..., optimizer_cls_and_kwargs=(cls, kwargs))`` builds
``cls`` over its usual parameter groups. The estimate of such a Trainer replays that optimizer, not
the one ``args.optim`` names: a fresh instance of the same class over the fake model's parameters,
each fake parameter in the group of its real twin with that group's options (``lr``, ``momentum``,
``foreach``, ``weight_decay``, ...), built from the instance's ``defaults`` — so the class's own
code decides which state it creates on the first ``step()`` (``SGD`` without momentum: none; with
momentum: one buffer; ``AdamW``: two moments and a step count; ``foreach``: its temporaries).

bitsandbytes' optimizers keep what decides their states outside ``defaults``: ``optim_bits``,
``min_8bit_size`` (tensors under 4096 elements keep 32-bit states), ``block_wise`` and
``percentile_clipping`` in ``args``, paging in ``is_paged``, and per-parameter overrides
(``Trainer.create_optimizer``'s 32-bit embeddings, a user's ``override_config``) in the
process-wide ``GlobalOptimManager``. The replica takes the instance's ``args`` and ``is_paged``, and a
private manager holding the same overrides for the fake twins (the global one is not touched).

Measured on a 2-layer BERT (hidden 128, batch 4 x 64 tokens, 2 steps, CPU; tests/test_user_optimizer.py),
before this replay every instance was estimated as the Trainer's AdamW (4,859,060 B of states, peak
14,718,232 B): SGD's profiler peak is 9,859,180 B (+49.3%), SGD with momentum 12,288,628 B (+19.8%),
``bnb.optim.Adam8bit`` 11,118,108 B (+32.4%, 1,289,648 B of states).

Example:
    >>> import torch
    >>> real = torch.nn.Linear(4, 4)
    >>> twin = torch.nn.Linear(4, 4)
    >>> opt = torch.optim.SGD(real.parameters(), lr=0.1, momentum=0.9)
    >>> fakes = {id(p): q for p, q in zip(real.parameters(), twin.parameters())}
    >>> copy = rebuild(opt, fakes, "cpu")
    >>> type(copy).__name__, copy.param_groups[0]["momentum"], copy.param_groups[0]["params"][0] is twin.weight
    ('SGD', 0.9, True)
"""

from __future__ import annotations

import inspect
import re
import types
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..core.run_config import optim_name


@dataclass(frozen=True)
class UserOptimizer:
    """The optimizer a Trainer will step instead of ``args.optim``'s: an instance, or a class and kwargs."""

    instance: Any = None  # torch.optim.Optimizer (unwrapped from accelerate's AcceleratedOptimizer)
    cls_and_kwargs: tuple[type, dict[str, Any]] | None = None

    @property
    def label(self) -> str:
        """``SGD(lr=0.1, momentum=0.9)``: the class and the options that differ from its defaults."""
        if self.instance is None:
            cls, kwargs = self.cls_and_kwargs  # type: ignore[misc]
            return f"{cls.__name__}({_options(kwargs)}) (optimizer_cls_and_kwargs)"
        opt = self.instance
        shown = {k: v for k, v in opt.defaults.items() if k in _SHOWN and v not in (None, False)}
        bits = getattr(getattr(opt, "args", None), "optim_bits", None)
        if bits is not None:
            shown["optim_bits"] = bits
        return f"{type(opt).__name__}({_options(shown)})"


_SHOWN = ("lr", "momentum", "betas", "weight_decay", "foreach", "fused", "nesterov", "amsgrad", "eps")


def _options(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def user_optimizer(trainer: Any, optim: str | None, shard: str | None = "none") -> UserOptimizer | None:
    """The optimizer ``trainer`` will step when the estimate asks for the run's own ``optim``, on one
    process or DDP (None: the Trainer builds ``args.optim``'s; another optimizer is asked for — a
    plan's 8-bit AdamW; a sharding engine, whose optimizer is its own; or an instance over none of the
    model's parameters)."""
    if trainer is None or shard not in (None, "none"):
        return None
    if optim is not None and optim != optim_name(trainer.args):
        return None
    instance = getattr(trainer, "optimizer", None)
    instance = getattr(instance, "optimizer", instance)  # accelerate's AcceleratedOptimizer after train()
    if isinstance(instance, torch.optim.Optimizer):
        model_params = {id(p) for p in trainer.model.parameters()}
        if any(id(p) in model_params for group in instance.param_groups for p in group["params"]):
            return UserOptimizer(instance=instance)
        return None
    given = getattr(trainer, "optimizer_cls_and_kwargs", None)
    if given is not None and isinstance(given[0], type) and issubclass(given[0], torch.optim.Optimizer):
        return UserOptimizer(cls_and_kwargs=(given[0], dict(given[1])))
    return None


def optimizer_for(model: torch.nn.Module, request: Any, trainer: Any) -> Any:
    """The optimizer a replayed step steps: the Trainer's own (:func:`user_optimizer`), else the one
    ``request.optim`` names, as ``Trainer.create_optimizer`` builds it."""
    from .cuda_paged import mark_paged  # a paged bitsandbytes optimizer's states leave CUDA's reserve

    spec = user_optimizer(trainer, request.optim, request.shard)
    if spec is None:
        from .optim import build_optimizer

        return mark_paged(build_optimizer(model, request.optim, request.device), request.device)
    return mark_paged(replay_optimizer(spec, model, trainer.model, request.device,
                                       float(trainer.args.weight_decay or 0.0)), request.device)


def with_user_optimizer(trainer: Any, request: Any, notes: list[str]) -> Any:
    """``request`` for a Trainer whose own optimizer is replayed (a note says which; the depth is not
    extrapolated where its layers are not optimized alike: :func:`uniform_over_layers`)."""
    spec = user_optimizer(trainer, request.optim, request.shard)
    if spec is None:
        return request
    notes.append(f"optimizer: the Trainer's own {spec.label} replayed (not args.optim {request.optim!r})")
    if request.extrapolate_layers is None and not uniform_over_layers(spec, trainer.model):
        notes.append("its layers are not optimized alike: the full depth replayed")
        return request.replace(extrapolate_layers=False)
    return request


def is_bitsandbytes(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of bitsandbytes' (its ops replayed with bitsandbytes' kernels)."""
    return type(optimizer).__module__.startswith("bitsandbytes")


def replay_optimizer(spec: UserOptimizer, model: torch.nn.Module, real_model: torch.nn.Module, target: str,
                     weight_decay: float = 0.0) -> Any:
    """``spec`` rebuilt over ``model`` (the fake twin of ``real_model``, possibly cut to fewer layers):
    each fake parameter takes its real twin's place (matched by name); parameters absent from the
    fake model (layers cut away) are left out, as their states would be."""
    fake_of = dict(model.named_parameters())
    fakes = {id(p): fake_of[name] for name, p in real_model.named_parameters() if name in fake_of}
    if spec.instance is not None:
        return rebuild(spec.instance, fakes, target)
    from .optim import param_groups

    cls, kwargs = spec.cls_and_kwargs  # type: ignore[misc]
    kwargs = _cuda_default(cls, dict(kwargs), target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(param_groups(model, weight_decay), **kwargs)


def rebuild(optimizer: Any, fakes: dict[int, torch.Tensor], target: str) -> Any:
    """A fresh ``type(optimizer)`` over the fake parameters ``fakes`` maps the real ones' ids to,
    each group with its options, bitsandbytes' ``args``/paging/overrides carried over (module doc)."""
    cls = type(optimizer)
    groups = []
    for group in optimizer.param_groups:
        params = [fakes[id(p)] for p in group["params"] if id(p) in fakes]
        if params:
            options = _cuda_default(cls, {k: v for k, v in group.items() if k != "params"}, target)
            groups.append({**options, "params": params})
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = _cuda_default(cls, {k: v for k, v in optimizer.defaults.items() if k in accepted}, target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replica = cls(groups, **kwargs)
    if is_bitsandbytes(optimizer):
        _bitsandbytes_rules(optimizer, replica, fakes)
    return replica


def _cuda_default(cls: type, options: dict[str, Any], target: str) -> dict[str, Any]:
    """For a CUDA target simulated on CPU tensors: ``foreach`` where left None (neither fused), the
    implementation torch's ``_default_to_fused_or_foreach`` picks for CUDA tensors (as
    :func:`~hf_memwatch.estimation.optim.build_optimizer` does for ``args.optim``)."""
    if (target == "cuda" and cls.__module__.startswith("torch.optim") and not options.get("fused")
            and "foreach" in inspect.signature(cls.__init__).parameters and options.get("foreach") is None):
        options["foreach"] = True
    return options


def _bitsandbytes_rules(optimizer: Any, replica: Any, fakes: dict[int, torch.Tensor]) -> None:
    """bitsandbytes' state rules outside ``defaults`` (``args``, ``is_paged``, the manager's overrides),
    carried from ``optimizer`` to ``replica`` for the fake twins."""
    import copy

    from bitsandbytes.optim import GlobalOptimManager

    replica.args = copy.copy(optimizer.args)
    replica.is_paged = optimizer.is_paged
    if getattr(replica.args, "optim_bits", 32) == 8 and not replica.name2qmap:
        replica.fill_qmap()
    source = optimizer.mng
    manager = GlobalOptimManager.__new__(GlobalOptimManager)
    manager.initialize()
    for module, attr, config in source.module_weight_config_triple:
        real = getattr(module, attr, None)
        if real is not None and id(real) in fakes:
            manager.register_module_override(types.SimpleNamespace(**{attr: fakes[id(real)]}), attr, config)
    real_of = {id(twin): real_id for real_id, twin in fakes.items()}
    for gindex, group in enumerate(replica.param_groups):
        for pindex, fake in enumerate(group["params"]):
            config = source.pid2config.get(real_of.get(id(fake)))
            if config is not None:
                manager.pid2config[id(fake)] = config
                manager.index2config[(gindex, pindex)] = config
    replica.mng = manager


_LAYER_INDEX = re.compile(r"\.\d+\.")


def uniform_over_layers(spec: UserOptimizer, real_model: torch.nn.Module) -> bool:
    """Whether every layer's parameters are in the optimizer with the same options, so that the step
    extrapolated from 2 and 3 layers is the full depth's (an optimizer over some layers only, or with
    per-layer options, is replayed at full depth)."""
    if spec.instance is None:
        return True
    where: dict[int, int] = {}
    for index, group in enumerate(spec.instance.param_groups):
        for p in group["params"]:
            where[id(p)] = index
    seen: dict[str, tuple[Any, ...]] = {}
    for name, p in real_model.named_parameters():
        if not p.requires_grad:
            continue
        index = where.get(id(p))
        options = None if index is None else tuple(sorted(
            (k, repr(v)) for k, v in spec.instance.param_groups[index].items() if k != "params"))
        key = _LAYER_INDEX.sub(".#.", name)
        if seen.setdefault(key, options) != options:
            return False
    return True
