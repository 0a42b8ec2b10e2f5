"""``EngineRules``: what one engine does at each floor, the methods the registry's table offers.

The base class is the engine of one process: nothing held beside the model, the step replayed as
it runs, no advice. An engine (``engines/ddp``, ``engines/zero``, ``engines/fsdp2``) subclasses it
in its ``rules`` module and overrides the methods it has; :mod:`hf_memwatch.engines.registry` holds
one instance of each. The methods take the run's objects and return plain values, so the callers
(the estimator, the monitor, the planner, the CLI) never name an engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from ..core.advice import Advice
from .cuda_reserve import carried_reserve
from .shard import shard_classes


class EngineRules:
    """One engine's rules; this base: a single process (``shard`` ``none`` on one rank)."""

    name = "single"
    label = "one process"  # the engine as notes name it
    shards: tuple[str, ...] = ()  # the ``shard`` names (estimate, CLI) whose ranks this engine's rules divide

    def answers(self, shard: str, world_size: int, engine: Any = None) -> bool:
        """Whether a rank of ``shard`` over ``world_size`` ranks (under ``engine``, where the run has one)
        holds what this engine holds."""
        return shard in self.shards

    # -- the CLI ---------------------------------------------------------------------------------
    def engine_of_options(self, args: Any) -> Any:
        """The :class:`~hf_memwatch.engines.engine.Engine` the command's flags describe (None: not this engine's)."""
        return None

    # -- the live monitor ------------------------------------------------------------------------
    def contributor(self, trainer: Any, wrapped: Any) -> Any:
        """What this engine holds on a live rank beside the model, as a monitor's
        :class:`~hf_memwatch.measure.monitor.StorageContributor` (None: not this engine's run)."""
        return None

    # -- the replay ------------------------------------------------------------------------------
    def flow(self, model: torch.nn.Module, engine: Any, trainer: Any, request: Any) -> Any:
        """A context the step is replayed in, holding what the rank holds while it runs."""
        return contextlib.nullcontext()

    def ranks(self, model: torch.nn.Module, engine: Any, request: Any) -> list[int | None]:
        """The ranks whose step is replayed one by one, the estimate the highest (ranks that hold different
        things and are not live); this base: ``[None]``, one replay, the rank the replay plans for."""
        return [None]

    def for_rank(self, rank: int | None) -> Any:
        """A context within which the replay and its split are ``rank``'s (:meth:`ranks`); this base: nothing."""
        return contextlib.nullcontext()

    def replay_request(self, request: Any, engine: Any) -> Any:
        """The request the step is replayed under (DeepSpeed's bf16: no autocast, :mod:`.zero.half`); this base:
        ``request`` as it is."""
        return request

    def per_rank(self, model: torch.nn.Module, engine: Any, request: Any) -> bool:
        """Whether the replayed step was already the rank's own (its shards), not one unsharded process's."""
        return False

    def split(self, classes: dict[str, int], model: torch.nn.Module, world_size: int, shard: str, notes: list[str],
              precision: str = "fp32") -> dict[str, int]:
        """One phase's classes as one of ``world_size`` ranks holds them under ``shard``; this base: the
        full-shard division (:func:`~hf_memwatch.engines.shard.shard_classes`; one process: unchanged)."""
        return shard_classes(classes, model, world_size, shard, notes)

    def rank_classes(self, phase_classes: Mapping[str, dict[str, int]], model: torch.nn.Module, engine: Any,
                     request: Any, notes: list[str], windows: Mapping[str, list] | None = None
                     ) -> dict[str, dict[str, int]]:
        """Each phase's classes as one rank holds them (:meth:`split`). ``windows``: the replay's windows per
        phase (``StepSimulation.phase_windows``), for engines that hold something per module call."""
        return {phase: self.split(classes, model, request.world_size, request.shard, notes, request.precision)
                for phase, classes in phase_classes.items()}

    def carried_reserve(self, replay: Any, rank_peak: int, notes: list[str]) -> Any:
        """The rank's CUDA reserve where the recorded step is one unsharded process's (a sharded run,
        ``per_rank`` False: ZeRO's shares, the full-shard division): ``replay(peak)`` replays that sequence
        through the caching-allocator model with its gap carried onto ``peak`` (a
        :class:`~hf_memwatch.estimation.cuda_device.ReservePrediction`; :mod:`.cuda_reserve`); None: not
        predicted."""
        return carried_reserve(replay, rank_peak, notes, self.label)

    def resident(self, model: torch.nn.Module, request: Any, trainer: Any) -> list[int]:
        """Blocks a CUDA rank holds through the step besides the replayed ones (bytes each)."""
        return []

    # -- the planner -----------------------------------------------------------------------------
    def advice(self, run: Any, classes: Mapping[str, int], peak: int, peak_phase: str | None) -> list[Advice]:
        """The engine remedies for ``run`` (the predicted per-rank split ``classes`` at ``peak``)."""
        return []

    def no_fit_reasons(self, run: Any, peak_phase: str) -> list[str] | None:
        """Why none of this engine's remedies applies to ``run`` (None: ``run`` is not this engine's)."""
        return None

    def eight_bit_unavailable(self, run: Any) -> str | None:
        """Why 8-bit AdamW cannot run under this engine (None: it can, or ``run`` is not this engine's)."""
        return None
