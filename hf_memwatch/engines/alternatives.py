"""The engine changes a "no plan fits" stop re-estimates (issue 37, point 5): a higher ZeRO stage, optimizer offload.

The catalogue's engine advice (:mod:`hf_memwatch.engines.zero.advice`) reads its savings from the predicted
split at the peak ("saves up to"). When no plan fits, :mod:`hf_memwatch.planning.no_fit` re-estimates the
smallest plan under each change listed here instead — the estimator replays the step with the engine the
change gives (``shard`` and :class:`~hf_memwatch.engines.engine.Engine` keywords) — so the line says the
peak the run would have and whether it fits, as it does for a shorter ``max_length`` and LoRA.

Listed, for a run over 2+ ranks:

* DDP: DeepSpeed ZeRO-1, 2 and 3 (the engine of the run, DeepSpeed's defaults otherwise);
* DeepSpeed ZeRO-k: each higher stage, its other settings kept;
* optimizer offload at the run's stage, on an accelerator only (on CPU ranks host RAM is the device: the
  zero advice's rule, nothing saved).

An FSDP run and one process get none (FSDP's own switches are advised by its rules). Each name is the
catalogue's for the same change, so the re-estimated line replaces the "up to" one.

Example:
    >>> from hf_memwatch.core.run_config import RunConfig
    >>> run = RunConfig(micro_batch_size=4, world_size=2, shard="zero2",
    ...                 engine=Engine(kind="deepspeed", world_size=2, zero_stage=2))
    >>> [(change.name, change.options["shard"]) for change in engine_changes(run)]
    [('ZeRO-3 ("zero_optimization": {"stage": 3})', 'zero3')]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .engine import Engine

HOW = {1: "the optimizer states partitioned over the {world} ranks (an fp32 master partition on top)",
       2: "gradients reduced into partitions over the {world} ranks, the optimizer states partitioned",
       3: "weights, gradients and optimizer states partitioned over the {world} ranks, gathered per layer"}


@dataclass(frozen=True)
class EngineChange:
    """One engine change: ``name`` (the catalogue's), ``how`` it saves, ``options`` (estimate keywords),
    ``answers``: the reason "not predicted" a stop gives otherwise, left out once it is re-estimated."""

    name: str
    how: str
    options: dict[str, Any] = field(default_factory=dict)
    answers: str | None = None  # the start of the no-fit reason (engines/zero/advice.py) a re-estimate answers


def engine_changes(run: Any) -> list[EngineChange]:
    """The engine changes to re-estimate for ``run`` (see the module docstring)."""
    engine: Engine | None = run.engine
    world = engine.world_size if engine is not None else int(run.world_size)
    if world < 2:
        return []
    if engine is not None and engine.kind == "deepspeed" and engine.zero_stage in (1, 2, 3):
        base, stage, prefix = engine, engine.zero_stage, ""
    elif (engine is None and run.shard == "none") or (engine is not None and engine.kind == "ddp"):
        base, stage, prefix = Engine(kind="deepspeed", world_size=world, source="arguments"), 0, "DeepSpeed "
    else:
        return []
    changes = []
    for higher in range(stage + 1, 4):
        config = f'{{"zero_optimization": {{"stage": {higher}}}}}'
        name = f"DeepSpeed ZeRO-{higher} (deepspeed={config})" if prefix else \
            f'ZeRO-{higher} ("zero_optimization": {{"stage": {higher}}})'
        changes.append(EngineChange(name, HOW[higher].format(world=world) + "; re-estimated with that engine",
                                    {"shard": f"zero{higher}", "engine": dataclasses.replace(base, zero_stage=higher)},
                                    f"ZeRO-{higher} is not predicted here"))
    if stage and base.offload_optimizer == "none" and run.device != "cpu":
        changes.append(EngineChange(
            'optimizer offload ("offload_optimizer": {"device": "cpu"})',
            "the optimizer states and the fp32 master partition in host RAM; re-estimated with that engine",
            {"shard": f"zero{stage}", "engine": dataclasses.replace(base, offload_optimizer="cpu", cpu_optimizer=True)}))
    return changes
