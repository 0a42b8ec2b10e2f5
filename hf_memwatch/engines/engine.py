"""``Engine``: the data-parallel engine a run really trains under, as accelerate builds it.

The planner must plan for the engine that runs, never for a setting the run ignores. Where the
answer comes from, first found wins:

1. the Trainer's ``Accelerator`` (built in ``Trainer.__init__``, before ``train()`` builds the
   DeepSpeed engine or wraps the model): its ``distributed_type``, ``deepspeed_plugin`` and
   ``fsdp_plugin`` are what ``prepare()`` will use;
2. without an accelerator (the CLI, a bare ``TrainingArguments``): the arguments and the environment
   a launcher passes (``accelerate launch`` writes ``ACCELERATE_USE_DEEPSPEED``,
   ``ACCELERATE_DEEPSPEED_*``, ``ACCELERATE_USE_FSDP``, ``FSDP_*``), with accelerate's own rules:
   DeepSpeed unless the run is forced onto the CPU (``use_cpu``), FSDP only on accelerator devices
   (``AcceleratorState`` turns FSDP on for the ``MULTI_GPU``-like types only; CPU ranks run
   ``MULTI_CPU``, i.e. DDP, whatever ``fsdp=`` says).

DeepSpeed bucket settings are element counts, as in its JSON. ``"auto"`` is resolved as the Trainer
resolves it at ``train()`` (``HfTrainerDeepSpeedConfig.trainer_config_finalize``: reduce bucket
``hidden_size**2``, prefetch ``0.9 * hidden_size**2``, persistence threshold ``10 * hidden_size``),
else DeepSpeed's defaults (:data:`ZERO_DEFAULTS`).

Example:
    >>> engine = engine_from_deepspeed_config(
    ...     {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, world_size=2)
    >>> engine.shard, engine.offload, engine.reduce_bucket_size
    ('zero3', 'optimizer', 500000000)
    >>> engine_of_environment({"ACCELERATE_USE_FSDP": "true"}, device="cpu", world_size=2).kind
    'ddp'
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENGINES = ("single", "ddp", "fsdp", "deepspeed")
# What a rank holds, by the estimator's name (``Engine.shard``; estimate's and the CLI's ``shard``).
SHARDS = ("none", "zero1", "zero2", "zero3", "fsdp")
OFFLOADS = ("none", "optimizer", "params")
# DeepSpeed 0.19's defaults (deepspeed/runtime/zero/config.py), in elements.
ZERO_DEFAULTS = {
    "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000, "stage3_max_reuse_distance": 1_000_000_000,
}
_BUCKET_FIELDS = {"reduce_bucket_size": "reduce_bucket_size", "allgather_bucket_size": "allgather_bucket_size",
                  "stage3_prefetch_bucket_size": "prefetch_bucket_size",
                  "stage3_max_live_parameters": "max_live_parameters",
                  "stage3_param_persistence_threshold": "param_persistence_threshold",
                  "stage3_max_reuse_distance": "max_reuse_distance"}


@dataclass(frozen=True)
class Engine:
    """One rank's engine. ``kind``: ``single``/``ddp``/``fsdp``/``deepspeed``; ``source``: where it was
    read (``accelerator``, ``arguments``, ``environment``); ``ignored``: settings the run will not use."""

    kind: str = "single"
    world_size: int = 1
    zero_stage: int = 0
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    prefetch_bucket_size: int | None = None
    max_live_parameters: int | None = None
    param_persistence_threshold: int | None = None
    max_reuse_distance: int | None = None
    # ZeRO-1/2 reduce a bucket in one all-reduce of all its slices (``use_multi_rank_bucket_allreduce``,
    # DeepSpeed 0.19's default), else one reduce per destination rank (engines/zero/backward.py, flat_copies)
    multi_rank_bucket_allreduce: bool = True
    offload_optimizer: str = "none"  # DeepSpeed's device: none | cpu | nvme
    offload_param: str = "none"
    engine_optimizer: bool = False  # DeepSpeed's JSON builds its own optimizer (its "optimizer" section)
    # accelerate replaces the Trainer's optimizer by DeepSpeedCPUAdam: offload_optimizer with
    # zero_force_ds_cpu_optimizer true, DeepSpeed's default (Accelerator._prepare_deepspeed)
    cpu_optimizer: bool = False
    fsdp_version: int | None = None
    fsdp_strategy: str | None = None  # FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD
    fsdp_wrap: str | None = None  # TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP
    fsdp_cpu_offload: bool = False
    cpu_ram_efficient_loading: bool = False
    source: str = "arguments"
    ignored: tuple[str, ...] = ()

    @property
    def shard(self) -> str:
        """The estimator's name for what a rank holds: ``none`` (single/DDP), ``zero1/2/3``, ``fsdp``."""
        if self.kind == "deepspeed" and self.zero_stage in (1, 2, 3):
            return f"zero{self.zero_stage}"
        if self.kind == "fsdp" and self.fsdp_strategy not in ("NO_SHARD",):
            return "fsdp"
        return "none"

    @property
    def own_buffers(self) -> bool:
        """Whether the engine holds buffers of its own that the estimate replays (DeepSpeed, FSDP); DDP
        and one process are told by their ``shard`` and ``world_size`` alone."""
        return self.kind in ("deepspeed", "fsdp")

    @property
    def offload(self) -> str:
        """``none``, ``optimizer`` (optimizer states and fp32 master off the device) or ``params``
        (parameters too: DeepSpeed ``offload_param``, FSDP ``cpu_offload``)."""
        if self.offload_param != "none" or self.fsdp_cpu_offload:
            return "params"
        return "optimizer" if self.offload_optimizer != "none" else "none"

    def describe(self) -> str:
        """One line for logs and plan records."""
        if self.kind == "deepspeed":
            text = f"DeepSpeed ZeRO-{self.zero_stage} x {self.world_size}"
            return text + (f", offload {self.offload}" if self.offload != "none" else "")
        if self.kind == "fsdp":
            return f"FSDP{self.fsdp_version or ''} {self.fsdp_strategy or 'FULL_SHARD'} x {self.world_size}"
        return f"DDP x {self.world_size}" if self.kind == "ddp" else "single process"

    def replace(self, **changes: Any) -> Engine:
        return dataclasses.replace(self, **changes)


def _plain(kind: str, world_size: int) -> str:
    return kind if kind in ("deepspeed", "fsdp") else ("ddp" if world_size > 1 else "single")


def _device_of(value: Any) -> str:
    if isinstance(value, Mapping):
        value = value.get("device", "none")
    return str(value or "none").lower()


def _elements(value: Any, auto: int | None, default: int) -> int:
    if isinstance(value, str) and value == "auto":
        return int(auto) if auto is not None else default
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return default


def engine_from_deepspeed_config(config: Mapping[str, Any], world_size: int, hidden_size: int | None = None,
                                 source: str = "arguments") -> Engine:
    """The engine a DeepSpeed JSON describes (``zero_optimization``: stage, buckets, offload)."""
    zero = dict(config.get("zero_optimization") or {})
    hidden = hidden_size if isinstance(hidden_size, int) and hidden_size > 0 else None
    autos = {"reduce_bucket_size": None if hidden is None else hidden * hidden,
             "allgather_bucket_size": None,
             "stage3_prefetch_bucket_size": None if hidden is None else int(0.9 * hidden * hidden),
             "stage3_max_live_parameters": None,
             "stage3_param_persistence_threshold": None if hidden is None else 10 * hidden,
             "stage3_max_reuse_distance": None}
    buckets = {field: _elements(zero.get(key, ZERO_DEFAULTS[key]), autos[key], ZERO_DEFAULTS[key])
               for key, field in _BUCKET_FIELDS.items()}
    stage = _elements(zero.get("stage", 0), None, 0)
    offload_optimizer, engine_optimizer = _device_of(zero.get("offload_optimizer")), bool(config.get("optimizer"))
    return Engine(kind="deepspeed", world_size=world_size, zero_stage=stage, offload_optimizer=offload_optimizer,
                  offload_param=_device_of(zero.get("offload_param")) if stage == 3 else "none",
                  engine_optimizer=engine_optimizer,
                  multi_rank_bucket_allreduce=_true(zero.get("use_multi_rank_bucket_allreduce", True)),
                  cpu_optimizer=(offload_optimizer != "none" and not engine_optimizer
                                 and _true(config.get("zero_force_ds_cpu_optimizer", True))),
                  source=source, **buckets)


def _true(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _fsdp_from_env(env: Mapping[str, str], world_size: int, source: str) -> Engine:
    strategy = env.get("FSDP_SHARDING_STRATEGY")
    if strategy is None and "FSDP_RESHARD_AFTER_FORWARD" in env:  # FSDP2 names it by resharding
        strategy = "FULL_SHARD" if _true(env["FSDP_RESHARD_AFTER_FORWARD"]) else "SHARD_GRAD_OP"
    if strategy is not None and strategy.isdigit():  # accelerate accepts 1..5 for the enum
        strategy = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")[int(strategy) - 1]
    return Engine(kind="fsdp", world_size=world_size, fsdp_version=int(env.get("FSDP_VERSION", "1") or 1),
                  fsdp_strategy=(strategy or "FULL_SHARD").upper(), fsdp_wrap=env.get("FSDP_AUTO_WRAP_POLICY"),
                  fsdp_cpu_offload=_true(env.get("FSDP_OFFLOAD_PARAMS", "false")),
                  cpu_ram_efficient_loading=_true(env.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")), source=source)


def engine_of_environment(env: Mapping[str, str], device: str, world_size: int, use_cpu: bool = False,
                          ignored: tuple[str, ...] = ()) -> Engine:
    """The engine ``accelerate launch``'s environment selects, by accelerate's rules for ``device``."""
    if _true(env.get("ACCELERATE_USE_DEEPSPEED", "false")) and not use_cpu:
        config = {"zero_optimization": {
            "stage": env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2),
            "offload_optimizer": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none"),
            "offload_param": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")}}
        return engine_from_deepspeed_config(config, world_size, source="environment").replace(ignored=ignored)
    if _true(env.get("ACCELERATE_USE_FSDP", "false")):
        if device != "cpu" and world_size > 1:
            return _fsdp_from_env(env, world_size, "environment").replace(ignored=ignored)
        ignored = (*ignored, f"ACCELERATE_USE_FSDP: accelerate builds FSDP on accelerator devices only; "
                             f"{'CPU ranks run DDP' if device == 'cpu' else 'one process runs unsharded'}")
    return Engine(kind=_plain("", world_size), world_size=world_size, source="environment", ignored=ignored)


def engine_of_arguments(args: Any, env: Mapping[str, str] | None = None, hidden_size: int | None = None) -> Engine:
    """The engine ``TrainingArguments`` (and the launcher's ``env``) select, before any accelerator exists."""
    import torch

    env = os.environ if env is None else env
    world_size = max(1, int(getattr(args, "world_size", 1) or 1))
    device = torch.device(getattr(args, "device", "cpu")).type
    use_cpu = bool(getattr(args, "use_cpu", False))
    config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if isinstance(config, Mapping) and not use_cpu:
        return engine_from_deepspeed_config(config, world_size, hidden_size)
    ignored: tuple[str, ...] = ()
    if getattr(args, "fsdp", None):
        if device != "cpu" and world_size > 1:
            return _fsdp_from_arguments(args, world_size)
        ignored = (f"fsdp={_fsdp_text(args)}: accelerate builds FSDP on accelerator devices only; "
                   f"{'CPU ranks run DDP' if device == 'cpu' else 'one process runs unsharded'}",)
    return engine_of_environment(env, device, world_size, use_cpu, ignored)


def _fsdp_text(args: Any) -> str:
    value = args.fsdp
    return " ".join(str(getattr(v, "value", v)) for v in value) if isinstance(value, (list, tuple)) else str(value)


def _fsdp_from_arguments(args: Any, world_size: int) -> Engine:
    plugin = dict(getattr(args, "fsdp_plugin_args", None) or {})
    options = _fsdp_text(args).upper().split()
    reshard = str(plugin.get("reshard_after_forward", "")).upper()
    strategy = next((o for o in (*options, reshard) if o in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD",
                                                             "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")),
                    "SHARD_GRAD_OP" if reshard == "FALSE" else "FULL_SHARD")
    return Engine(kind="fsdp", world_size=world_size, fsdp_version=int(plugin.get("fsdp_version", 1) or 1),
                  fsdp_strategy=strategy, fsdp_wrap=plugin.get("auto_wrap_policy"),
                  fsdp_cpu_offload="OFFLOAD" in options or bool(plugin.get("cpu_offload")),
                  cpu_ram_efficient_loading=bool(plugin.get("cpu_ram_efficient_loading")), source="arguments")


def engine_of_accelerator(accelerator: Any, world_size: int, hidden_size: int | None = None,
                          ignored: tuple[str, ...] = ()) -> Engine | None:
    """The engine ``accelerator`` will build (None: not an accelerator accelerate made)."""
    state = getattr(accelerator, "state", None)
    kind = str(getattr(getattr(state, "distributed_type", None), "value", "") or "").upper()
    if not kind:
        return None
    if kind == "DEEPSPEED":
        plugin = getattr(state, "deepspeed_plugin", None)
        config = getattr(plugin, "deepspeed_config", None) or {}
        return engine_from_deepspeed_config(config, world_size, hidden_size, source="accelerator").replace(
            ignored=ignored)
    if kind == "FSDP":
        plugin = getattr(state, "fsdp_plugin", None)
        strategy = getattr(plugin, "sharding_strategy", None)
        reshard = getattr(plugin, "reshard_after_forward", None)
        name = getattr(strategy, "name", None) or ({True: "FULL_SHARD", False: "SHARD_GRAD_OP"}.get(reshard)
                                                   if isinstance(reshard, bool) else None)
        wrap = getattr(plugin, "auto_wrap_policy", None)
        offload = getattr(plugin, "cpu_offload", None)
        return Engine(kind="fsdp", world_size=world_size, fsdp_version=int(getattr(plugin, "fsdp_version", 1) or 1),
                      fsdp_strategy=name or "FULL_SHARD",
                      fsdp_wrap=wrap if isinstance(wrap, str) or wrap is None else getattr(wrap, "__name__", str(wrap)),
                      fsdp_cpu_offload=_offloads_params(offload),
                      cpu_ram_efficient_loading=bool(getattr(plugin, "cpu_ram_efficient_loading", False)),
                      source="accelerator", ignored=ignored)
    return Engine(kind=_plain("", world_size), world_size=world_size, source="accelerator", ignored=ignored)


def engine_backward_detached(accelerator: Any) -> bool:
    """Whether ``accelerator.backward`` would call an engine the replay must not touch (DeepSpeed's)."""
    kind = str(getattr(getattr(accelerator, "distributed_type", None), "value", "") or "").upper()
    return kind == "DEEPSPEED"


# The settings whose "ignored" notes an FSDP accelerator contradicts (``fsdp=`` and accelerate's env).
_FSDP_SETTINGS = ("fsdp=", "ACCELERATE_USE_FSDP")


def _offloads_params(policy: Any) -> bool:
    """FSDP1's ``CPUOffload(offload_params=...)``, FSDP2's ``CPUOffloadPolicy`` (``OffloadPolicy``: none)."""
    if isinstance(policy, bool):
        return policy
    if hasattr(policy, "offload_params"):
        return bool(policy.offload_params)
    return type(policy).__name__ == "CPUOffloadPolicy"


def engine_of(args: Any, accelerator: Any = None, model: Any = None, env: Mapping[str, str] | None = None) -> Engine:
    """The engine the run trains under: the accelerator's when it exists, else the arguments' and
    environment's (see the module doc). ``model`` sizes DeepSpeed's ``"auto"`` buckets."""
    config = getattr(getattr(model, "module", model), "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    planned = engine_of_arguments(args, env, hidden)
    if accelerator is not None:
        real = engine_of_accelerator(accelerator, planned.world_size, hidden)
        if real is not None:
            ignored = planned.ignored
            if real.kind == "fsdp":  # the accelerator builds the FSDP the arguments read as ignored
                ignored = tuple(note for note in ignored if not note.startswith(_FSDP_SETTINGS))
            if planned.kind == "fsdp" and real.kind != "fsdp":
                ignored = (*ignored, f"fsdp={_fsdp_text(args)}: the accelerator runs {real.describe()}")
            return real.replace(ignored=ignored)
    return planned


def own_checkpointing(args: Any, engine: Engine | None = None) -> bool:
    """Whether the engine's own activation checkpointing is asked: ``fsdp_config["activation_checkpointing"]``,
    the switch transformers recommends under FSDP instead of the Trainer's (accelerate's ``fsdp2_apply_ac``
    wraps every unit in ``checkpoint_wrapper(preserve_rng_state=False)``, non-reentrant). It acts only where
    FSDP is built: with ``engine`` given, only when that engine is FSDP.

    Example:
        >>> class Args:
        ...     fsdp, fsdp_plugin_args = "full_shard", {"activation_checkpointing": True}
        >>> own_checkpointing(Args()), own_checkpointing(Args(), Engine(kind="ddp"))
        (True, False)
    """
    plugin = getattr(args, "fsdp_plugin_args", None)
    asked = bool(getattr(args, "fsdp", None)) and isinstance(plugin, dict) and bool(plugin.get("activation_checkpointing"))
    return asked and (engine is None or engine.kind == "fsdp")
