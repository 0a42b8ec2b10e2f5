"""A step that takes a random branch (issue 37, point 2): GKD's ``lmbda`` draw, every branch replayed.

``GKDTrainer.training_step`` draws ``random.random() <= lmbda`` each micro-step: on-policy, the student
generates ``max_new_tokens`` and trains on that; otherwise it trains on the dataset's completion. Which
branch peaks higher depends on the lengths: here the dataset's answers (40 words) are longer than what
the student generates (4 tokens), so the off-policy steps are the run's highest — the estimate that
replayed the on-policy branch alone for any ``lmbda > 0`` was under them. Every branch the draw can take
is now replayed and the worst kept, named in a note (:mod:`hf_memwatch.estimation.branches`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_gkd_auto import gkd as gkd_run
from test_trl_online import resident

from hf_memwatch import MemWatch, estimate
from hf_memwatch.estimation.branches import OFF_POLICY, ON_POLICY, random_branches
from hf_memwatch.testing.step_marker import StepMarker
from hf_memwatch.testing.truth import cpu_memory_profile, step_peaks, window_peak


def gkd(out: Path, callbacks: list[Any], *, answer: int, lmbda: float) -> Any:
    """test_gkd_auto's GKD run: 1-layer Llama student and teacher, 3 steps, answers of ``answer`` words."""
    return gkd_run(out, callbacks, layers=1, answer=answer, lmbda=lmbda, max_steps=3, seed=3)


def test_the_branches_a_draw_can_take(tmp_path: Path) -> None:
    names = {lmbda: [b.name for b in random_branches(gkd(tmp_path, [], answer=4, lmbda=lmbda))]
             for lmbda in (0.0, 0.5, 1.0)}
    assert names == {0.0: [OFF_POLICY], 0.5: [ON_POLICY, OFF_POLICY], 1.0: [ON_POLICY]}


@pytest.mark.parametrize("lmbda", [0.0, 0.5, 1.0])
def test_the_estimate_is_the_worst_branch(lmbda: float, tmp_path: Path) -> None:
    trainer = gkd(tmp_path, [StepMarker()], answer=40, lmbda=lmbda)
    est = estimate(trainer)
    assert any("GKD" in note and "branch" in note for note in est.notes), est.notes
    with cpu_memory_profile() as prof:
        trainer.train()
    truth, peaks = window_peak(prof, resident(trainer)), step_peaks(prof, resident(trainer))
    assert est.peak_bytes >= max(peaks) - 16, (est.peak_bytes, peaks)
    if lmbda in (0.0, 1.0):  # one branch: the run takes it every step
        assert abs(est.peak_bytes - truth) <= 0.005 * truth, (est.peak_bytes, truth)
    else:
        worst = next(note for note in est.notes if note.startswith("random branch"))
        assert OFF_POLICY in worst.split(", estimated")[0], worst  # the dataset's 40-word answers: the higher


def test_the_auto_plan_fits_every_branch(tmp_path: Path) -> None:
    on = estimate(gkd(tmp_path / "on", [], answer=40, lmbda=1.0)).peak_bytes
    off = estimate(gkd(tmp_path / "off", [], answer=40, lmbda=0.0)).peak_bytes
    budget = int(0.9 * max(on, off))
    auto = gkd(tmp_path / "auto", [MemWatch(auto=True, budget=budget, report=False, summary=False)], answer=40,
               lmbda=0.5)
    with cpu_memory_profile() as prof:
        auto.train()
    assert window_peak(prof, resident(auto)) <= budget


def test_the_estimate_gives_each_branchs_peak(tmp_path: Path) -> None:
    """``MemoryEstimate.branches`` at ``lmbda`` 0.5: each branch's peak, the one the estimate of a run that
    always takes it predicts (``lmbda`` 1: on-policy; 0: off-policy; each within 0.5% of its run's profiler
    peak in ``test_the_estimate_is_the_worst_branch``), the estimate their highest. A single branch: none."""
    drawn = estimate(gkd(tmp_path / "both", [], answer=40, lmbda=0.5))
    on = estimate(gkd(tmp_path / "on", [], answer=40, lmbda=1.0))
    off = estimate(gkd(tmp_path / "off", [], answer=40, lmbda=0.0))
    assert drawn.branches == {ON_POLICY: on.peak_bytes, OFF_POLICY: off.peak_bytes}, drawn.branches
    assert drawn.peak_bytes == max(drawn.branches.values())
    assert on.branches == {} and off.branches == {}
