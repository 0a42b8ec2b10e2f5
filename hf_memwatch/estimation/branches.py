"""Steps that take a random branch: each branch replayed, the estimate the worst, and it says which.

TRL's ``GKDTrainer.training_step`` draws ``random.random() <= lmbda`` each micro-step: on-policy, the
student generates ``max_new_tokens`` and trains on its own completions; otherwise, with ``seq_kd`` the
teacher generates them, else the dataset's completions are trained on as they are. The branches hold
different sequences (prompt + ``max_new_tokens`` against prompt + the dataset's completion) and only
the generating ones hold a decoding loop, so either can be the higher: a run's step peaks follow its
draws. The estimate replays every branch the draw can take — on-policy for ``lmbda > 0``, the other
for ``lmbda < 1`` — by setting ``lmbda`` for the replay (1: always on-policy; -1: never), keeps the
branch whose step peaks highest (its notes; for a CUDA target its allocation trace is the one the
caching allocator's replay reads), and a note names the branches and their peaks. The auto mode plans
from that estimate, so its plan fits every branch.

Measured (tests/test_branches.py, 1-layer Llama student and teacher, 4 x (12-word prompt + 40-word answer),
``max_new_tokens`` 4, 3 steps, CPU): the off-policy steps peak at 17,634,992 B, the on-policy ones at
7,239,920 B. With ``lmbda`` 0.5 the run's step peaks were 5,917,368 / 17,634,992 / 7,239,920 B: the
estimate was 7,239,904 B (on-policy replayed alone, -58.9%), now 17,634,976 B (off-policy, the worst);
with ``lmbda`` 0 and 1 (one branch) it is the run's peak within 16 B.

A race between threads is a branch too: an engine's collective hands a block to its worker thread,
which lets it go before or after the training thread's next allocations, as the two threads happen
to be scheduled (DeepSpeed ZeRO-1/2's flat copy of a reduced bucket on gloo's thread,
:func:`~hf_memwatch.engines.zero.backward.flat_copies`). The engine's replay asks :func:`race_held`
which branch it replays (the block held: the worst, what the estimate and its plan take) and
reports the race with :func:`report_race`; :func:`races` collects the reports of one replay and sets
the branch. A direct estimate replays the other branch beside it (the block freed at once: the
profiler's reconciled truth places every free on a worker thread there, ``testing/truth.py``) and
gives both peaks (``MemoryEstimate.branches``); a plan's estimates replay the worst alone. A random
draw's branches are there too, each by name (GKD's: every one is replayed anyway).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

ON_POLICY = "on-policy (the student generates)"
SEQ_KD = "sequence-level KD (the teacher generates)"
OFF_POLICY = "off-policy (the dataset's completions)"
RACE_HELD = "held"  # the worker thread lets the block go after the training thread's next allocations
RACE_FREED = "freed first"  # ... before them

# The reports of the replay in progress (None: no :func:`races` block) and the race's branch it replays.
_RACES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("hf_memwatch_races", default=None)
_HELD: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_memwatch_race_held", default=True)


@dataclass(frozen=True)
class Branch:
    """One branch of a random draw: its name and the ``lmbda`` that forces it."""

    name: str
    lmbda: float


def random_branches(trainer: Any) -> list[Branch]:
    """The branches ``trainer``'s step may take (empty: its step takes none at random)."""
    if trainer is None or "GKDTrainer" not in {cls.__name__ for cls in type(trainer).__mro__}:
        return []
    lmbda = float(getattr(trainer, "lmbda", 0.0) or 0.0)
    other = Branch(SEQ_KD if getattr(trainer, "seq_kd", False) else OFF_POLICY, -1.0)
    if lmbda >= 1.0:  # random.random() < 1 <= lmbda: always
        return [Branch(ON_POLICY, 1.0)]
    if lmbda <= 0.0:
        return [other]
    return [Branch(ON_POLICY, 1.0), other]


def worst_branch(simulate: Callable[[list[str]], Any], replay: Any, trainer: Any, notes: list[str],
                 traces: list | None = None, drawn: dict[str, Any] | None = None) -> Any:
    """``simulate(notes)`` once per branch of ``trainer``'s random draw (``replay.lmbda`` set for each),
    the simulation whose step peaks highest; a single-branch step is simulated once, as it is. ``drawn``
    receives each branch's simulation by name where the draw has more than one."""
    branches = random_branches(trainer)
    if replay is None or not branches:
        return simulate(notes)
    lmbda, results = trainer.lmbda, []  # the user's (each branch's replay forces its own)
    for branch in branches:
        replay.lmbda = branch.lmbda
        start = len(traces) if traces is not None else 0
        branch_notes: list[str] = []
        simulation = simulate(branch_notes)
        recorded = traces[start:] if traces is not None else []
        peak = max(sum(classes.values()) for classes in simulation.phase_classes.values())
        results.append((peak, branch, simulation, branch_notes, recorded))
    peak, branch, simulation, branch_notes, recorded = max(results, key=lambda result: result[0])
    if traces is not None:  # the caching allocator's replay reads the last trace: the worst branch's
        traces.extend(recorded)
    notes.extend(branch_notes)
    if len(results) > 1 and drawn is not None:
        drawn.update({b.name: sim for _, b, sim, *_ in results})
    if len(results) > 1:
        others = ", ".join(f"{b.name} {p:,} B" for p, b, *_ in results if b is not branch)
        notes.append(f"random branch (GKD, lmbda={lmbda}): the worst, {branch.name}, estimated "
                     f"({peak:,} B at its peak; {others})")
    else:
        notes.append(f"GKD, lmbda={lmbda}: every step takes the {branch.name} branch")
    return simulation


def race_held() -> bool:
    """Whether the replay in progress takes a race's worst branch (the block held: the default)."""
    return _HELD.get()


def report_race(note: str) -> None:
    """An engine's replay met a race (``note`` says what and how much): kept for :func:`races`."""
    log = _RACES.get()
    if log is not None and note not in log:
        log.append(note)


@contextlib.contextmanager
def races(held: bool = True) -> Iterator[list[str]]:
    """Within, a race's block is ``held`` (the worst branch) or freed first; yields the races reported.

    Example:
        >>> with races(held=False) as met:
        ...     race_held(), report_race("a copy"), met
        (False, None, ['a copy'])
        >>> race_held()
        True
    """
    log_token, held_token = _RACES.set([]), _HELD.set(held)
    try:
        yield _RACES.get()
    finally:
        _RACES.reset(log_token)
        _HELD.reset(held_token)


# An engine whose earlier micro-step leaves a race's blocks to the next one's forward asks for it (see below).
_EARLIER: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_memwatch_earlier_micro_step", default=False)
_LAST: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_memwatch_last_micro_step", default=True)


@contextlib.contextmanager
def _scoped(var: contextvars.ContextVar[bool], value: bool) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@contextlib.contextmanager
def earlier_micro_step_wanted() -> Iterator[None]:
    """Within, a step with accumulation replays its first micro-step as it runs, then one after it (whose
    gradients the first left), instead of that one alone on gradients made resident: an engine's race
    whose blocks the earlier micro-step's backward hands to gloo's threads and the next forward meets
    (DeepSpeed ZeRO-2's last reductions, :class:`~hf_memwatch.engines.zero.backward.ZeroGradientFlow`)
    needs the backward that made them. :func:`last_micro_step` tells the engine which one runs.

    Example:
        >>> with earlier_micro_step_wanted():
        ...     earlier_micro_step_replayed()
        True
        >>> earlier_micro_step_replayed(), last_micro_step()
        (False, True)
    """
    with _scoped(_EARLIER, True):
        yield


def earlier_micro_step_replayed() -> bool:
    """Whether the replay in progress wants its earlier micro-step replayed (:func:`earlier_micro_step_wanted`)."""
    return _EARLIER.get()


@contextlib.contextmanager
def micro_step(last: bool) -> Iterator[None]:
    """Within, the replay runs a micro-step, the step's ``last`` (its accumulation boundary) or an earlier one."""
    with _scoped(_LAST, last):
        yield


def last_micro_step() -> bool:
    """Whether the micro-step replayed now is the step's last (outside a micro-step: True)."""
    return _LAST.get()


@dataclass
class StepBranches:
    """The races between threads the step's replay met (their reports) and, for a direct estimate,
    the step replayed on their other branch, each block freed at once; a random draw's branches, each
    replayed (GKD's ``lmbda``), by name (this module)."""

    met: list[str] = field(default_factory=list)
    freed: Any = None
    drawn: dict[str, Any] = field(default_factory=dict)

    def simulations(self) -> list[Any]:
        """The simulations beside the estimate's own (they get what it gets: the frozen models' weights)."""
        return [*([self.freed] if self.freed is not None else []), *self.drawn.values()]


def branch_peaks(race: StepBranches, peak: int, per_rank: Any, notes: list[str]) -> dict[str, int]:
    """Each branch's peak (``MemoryEstimate.branches``): a random draw's (GKD's, each by name), the races the
    replay met (empty: none, or the other not replayed), noted; ``per_rank``: phase classes -> the rank's."""
    def rank_peak(simulation: Any) -> int:
        return max(sum(classes.values()) for classes in per_rank(simulation.phase_classes).values())

    drawn = {name: rank_peak(simulation) for name, simulation in race.drawn.items()}
    if not race.met:
        return drawn
    what = "; ".join(race.met)
    if race.freed is None:
        notes.append(f"race: {what}: estimated at its worst branch, {RACE_HELD} (the other is not replayed "
                     f"for a plan)")
        return drawn
    freed = rank_peak(race.freed)
    notes.append(f"race: {what}: estimated at its worst branch, {RACE_HELD}, {peak:,} B; {RACE_FREED}, "
                 f"{freed:,} B" + (" (the same peak)" if freed == peak else ""))
    return {**drawn, RACE_HELD: peak, RACE_FREED: freed}


def highest_rank(results: list[tuple[int | None, Any]], shard: str) -> Any:
    """The estimate of the rank that peaks highest, where each rank was replayed (an engine whose ranks hold
    different things and are not live: ``EngineRules.ranks``; noted), else the one."""
    rank, result = max(results, key=lambda item: item[1].peak_bytes)
    if len(results) > 1:
        each = ", ".join(f"rank {r}: {e.peak_bytes:,} B" for r, e in results)
        result.notes.append(f"{shard} without live ranks: each of the {len(results)} ranks' partitions "
                            f"replayed ({each}); the estimate is rank {rank}'s, the highest")
    return result
