"""What each remedy does to one run, read off the planning core: the CLI's table, the post-mortem's savings.

Both views read one :class:`~hf_memwatch.planning.chooser.PlanRequest` — its candidates and its one
cache of predictions — and search nothing of their own, so for the same run and budget they show
the very figures the chooser (the auto mode's, ``hf-memwatch estimate --budget``'s plan) chose from:

- :func:`setting_rows` (``hf-memwatch estimate --budget``): each setting of the candidates
  (checkpointing x optimizer x ... — one line of the chooser) at the run's micro-batch, its
  prediction, whether it fits, and the largest micro-batch of that line that fits (same effective
  batch), found by the chooser's own bisection;
- :func:`single_steps` (the OOM post-mortem): each remedy of the catalogue alone, one step from the
  run (:attr:`~hf_memwatch.planning.catalogue.Remedy.step`), as the candidate it is;
  :func:`eval_single_steps` the same for the evaluation loop's remedies (the eval post-mortem).

Example (a made-up predictor: 100 bytes + 10 a sample, 5 with checkpointing):
    >>> from hf_memwatch.core.run_config import RunConfig
    >>> from hf_memwatch.planning.chooser import PlanRequest
    >>> class Toy:
    ...     calls = 0
    ...     def peak(self, plan):
    ...         return 100 + plan.micro_batch_size * (5 if plan.activation_checkpointing else 10)
    >>> request = PlanRequest(RunConfig(micro_batch_size=8, optim="sgd"), Toy(), budget=150)
    >>> [(row.label, row.predicted_peak, row.fits, row.largest_fitting.micro_batch_size) for row in setting_rows(request)]
    [('as given', 180, False, 4), ('activation checkpointing', 140, True, 8)]
    >>> [(text, plan.key()) for text, plan in single_steps(request)]
    [('micro-batch 8 -> 4, gradient accumulation 1 -> 2 (same effective batch)', (4, 2, False, 'sgd')), ('activation checkpointing on', (8, 1, True, 'sgd'))]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..core.run_config import RunConfig
from .catalogue import EVAL_REMEDIES, REMEDIES
from .chooser import PlanRequest
from .plan import EvalSetting, Plan


@dataclass
class SettingRow:
    """One setting of the candidates at the run's micro-batch (a row of the CLI's remedy table).

    ``changes``: what it changes in the run (empty: the run as given); ``predicted_peak``: the
    chooser's prediction (its margin included); ``fits``: that prediction is within the budget;
    ``largest_fitting``: the plan of the same setting with the largest micro-batch that fits (same
    effective batch; None: none does).
    """

    plan: Plan
    predicted_peak: int
    fits: bool
    largest_fitting: Plan | None
    changes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return " + ".join(self.changes) or "as given"


def setting_rows(request: PlanRequest) -> list[SettingRow]:
    """Each line of ``request``'s candidates at the run's micro-batch, the run's own setting first."""
    if request.budget is None:
        raise ValueError("setting_rows needs the request's budget")
    run, budget = request.run, request.budget
    rows = []
    for line in request.lines().values():
        plan = next(p for p in line if p.micro_batch_size == run.micro_batch_size)
        peak = request.predicted(plan)
        rows.append(SettingRow(plan, peak, peak <= budget, request.largest_fitting(line, budget),
                               plan.changes_from(run)))
    return rows


def single_steps(request: PlanRequest) -> list[tuple[str, Plan]]:
    """(description, candidate) of each remedy of the catalogue applied alone, one step from the run."""
    run, given = request.run, request.given
    by_key = {plan.key(): plan for plan in request.candidates}
    steps = []
    for remedy in REMEDIES:
        value = remedy.step(run, getattr(given, remedy.field), remedy.options(run))
        if value is None:
            continue
        target = dataclasses.replace(given, **{remedy.field: value})
        target.gradient_accumulation_steps = run.effective_batch // target.micro_batch_size
        plan = by_key.get(target.key())
        if plan is not None:
            steps.append((remedy.describe(run, plan), plan))
    return steps


def eval_single_steps(run: RunConfig, given: EvalSetting) -> list[tuple[str, EvalSetting, str]]:
    """(description, setting, note) of each evaluation remedy of the catalogue
    (:data:`~hf_memwatch.planning.catalogue.EVAL_REMEDIES`) applied alone, one step from ``given``:
    what the eval loop's post-mortem predicts.

    Example:
        >>> run = RunConfig(4, eval_batch_size=16, device="cpu")
        >>> [(setting.eval_batch_size, setting.eval_accumulation_steps, note[:10])
        ...  for _, setting, note in eval_single_steps(run, EvalSetting.of(run))][:2]
        [(8, None, ''), (16, 1, 'on the CPU')]
    """
    steps = []
    for remedy in EVAL_REMEDIES:
        value = remedy.step(run, getattr(given, remedy.field), remedy.options(run))
        if value is not None:
            setting = given.replace(**{remedy.field: value})
            steps.append((remedy.describe(run, setting), setting, remedy.note(run)))
    return steps
