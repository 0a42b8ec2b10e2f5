"""The one table of engines, and what the estimator, the monitor, the planner and the CLI ask it.

:data:`ENGINES` holds one :class:`~hf_memwatch.engines.rules.EngineRules` per engine, one line each;
the last, the base class, is one process. Callers never name an engine: they ask the rules of the run
(:func:`rules_for`, by the ``shard`` a rank holds) or every engine at once (the monitor's contributor,
the planner's advice), and each engine answers for its own runs only.

Example:
    >>> [rules.name for rules in ENGINES]
    ['ddp', 'zero', 'fsdp1', 'fsdp2', 'single']
    >>> rules_for("zero3", 2).name, rules_for("none", 2).name, rules_for("none", 1).name
    ('zero', 'ddp', 'single')
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ..core.advice import Advice
from ..core.run_config import RunConfig
from ..measure.held_models import HeldModels, held_models
from ..measure.monitor import StepMonitor
from .alternatives import EngineChange
from .alternatives import engine_changes as alternatives_of
from .ddp.rules import DdpRules
from .fsdp1.rules import Fsdp1Rules
from .fsdp2.rules import Fsdp2Rules
from .rules import EngineRules
from .zero.rules import ZeroRules

ENGINES: tuple[EngineRules, ...] = (
    DdpRules(),
    ZeroRules(),
    Fsdp1Rules(),
    Fsdp2Rules(),
    EngineRules(),  # one process: nothing beside the model
)


def rules_for(shard: str, world_size: int, engine: Any = None) -> EngineRules:
    """The rules of the engine whose rank holds ``shard`` over ``world_size`` ranks under ``engine`` (the
    run's :class:`~hf_memwatch.engines.engine.Engine`, None: plain values); one process's: the last."""
    return next((rules for rules in ENGINES[:-1] if rules.answers(shard, world_size, engine)), ENGINES[-1])


# -- the CLI ---------------------------------------------------------------------------------------
def engine_of_options(args: argparse.Namespace) -> Any:
    """The :class:`~hf_memwatch.engines.engine.Engine` the command's flags describe (``--shard``,
    ``--world-size``, ``--offload``, the bucket flags); None: plain values (DDP, one process). Every
    engine reads the flags, so a flag given to the wrong shard fails in one line."""
    found = [rules.engine_of_options(args) for rules in ENGINES]
    return next((engine for engine in found if engine is not None), None)


# -- the live monitor ------------------------------------------------------------------------------
def make_monitor(backend: Any, writer: Any, rank: int, trainer: Any = None) -> StepMonitor:
    """The monitor for this process; under an engine it also counts what the engine holds (the first
    engine's contributor for the Trainer's wrapped model), and the models the Trainer holds besides."""
    monitor = StepMonitor(backend, writer, rank=rank)
    wrapped = getattr(trainer, "model_wrapped", None) if trainer is not None else None
    contributor = next((c for rules in ENGINES if (c := rules.contributor(trainer, wrapped)) is not None), None)
    if contributor is not None:
        monitor.add_contributor(contributor)
    held = held_models(trainer) if trainer is not None else {}
    if held:  # TRL's reference model, a teacher: frozen weights, shown apart
        monitor.add_contributor(HeldModels(held))
    return monitor


# -- the planner -----------------------------------------------------------------------------------
def engine_advice(run: RunConfig, classes: Mapping[str, int], peak: int,
                  peak_phase: str | None = None) -> list[Advice]:
    """Every engine's remedies for ``run`` (each engine answers for its own runs), with their savings in
    bytes per rank (``classes``: the predicted per-rank split at ``peak``; ``peak_phase``: None, not known)."""
    return [item for rules in ENGINES for item in rules.advice(run, classes, peak, peak_phase)]


def eight_bit_unavailable(run: RunConfig) -> str | None:
    """Why the run's engine cannot step 8-bit AdamW (None: it can)."""
    return next((why for rules in ENGINES if (why := rules.eight_bit_unavailable(run)) is not None), None)


def engine_changes(run: RunConfig) -> list[EngineChange]:
    """The engine changes a "no plan fits" stop re-estimates for ``run`` (:mod:`.alternatives`)."""
    return alternatives_of(run)


def no_fit_reasons(run: RunConfig, peak_phase: str | None) -> list[str] | None:
    """Why no remedy of ``run``'s engine applies when no plan fits (None: the engine has none to say)."""
    return next((reasons for rules in ENGINES if (reasons := rules.no_fit_reasons(run, peak_phase)) is not None), None)
