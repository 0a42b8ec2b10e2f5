"""The seeded sweep's fixed-seed slice (issue 37): ``benchmarks/sweep.py`` draws, measured against the profiler.

The benchmark runs 150 draws (``make bench``); here two of them, one with the auto mode at 0.7 x its peak.
"""

from __future__ import annotations

import torch

from hf_memwatch.testing.sweep import _lengths, draw, run_draw


def test_draws_are_the_same_for_a_seed_and_ragged_runs_reach_the_worst_batch() -> None:
    assert draw(5) == draw(5) and draw(5) != draw(6)
    padded = draw(2)  # bloom, 1 x 64, ragged and padded, accumulation 2
    assert (padded.shape, padded.batch, padded.accum) == ("padded", 1, 2)
    lengths = _lengths(padded, torch.Generator().manual_seed(0))
    # step 1 ragged, step 2's two micro-batches and the one fetched ahead during it the longest
    assert len(lengths) == 5 and max(lengths[:2]) <= 64 and lengths[2:] == [64, 64, 64]
    wide = padded.__class__(**{**padded.__dict__, "batch": 4, "accum": 1})
    assert _lengths(wide, torch.Generator().manual_seed(0))[4:] == [64, 64, 64, 32] * 2


def test_a_fixed_seed_slice_is_within_one_percent() -> None:
    plain = run_draw(draw(1))  # distilbert, 1 x 128, bf16, AdamW(foreach=False) handed in, accumulation 2
    auto = run_draw(draw(2), auto=True)  # bloom, ragged 1 x 64, fp32, fused AdamW, accumulation 2
    for result in (plain, auto):
        assert result.error is None, result.error
        assert abs(result.estimate_error) <= 0.01, (result.draw.describe(), result.estimate, result.truth)
        assert result.live_error <= 0.01, (result.live, result.live_truth)
    assert auto.auto in ("fits", "no plan fits (truthful)"), (auto.auto, auto.auto_peak, auto.budget)


def test_the_depth_extrapolated_estimate_equals_the_full_depth_replay() -> None:
    """Issue 37: each draw's configuration at 4-8 layers, estimated by depth extrapolation (2 and 3
    layers replayed) and by the full-depth replay: equal to the byte where the shortcut is taken."""
    from hf_memwatch.testing.sweep import depth_check

    depth, shortcut, full = depth_check(draw(2))  # bloom, ragged 1 x 64, fused AdamW, accumulation 2
    assert depth >= 4 and shortcut is not None
    assert shortcut == full, (shortcut, full)


def test_where_the_checkpointed_backward_high_moves_with_depth_each_window_is_extended() -> None:
    """Draw 11 (Mistral-shaped, 1 x 128, reentrant checkpointing) at 8 layers: the backward's high moves
    from the logits' gradient to the last layers' gradients, and the line through 2 and 3 layers read
    5,352,020 B against the full replay's 5,536,596 B (-3.3%). Now 3 and 4 layers are replayed with the
    backward split where each layer's recomputation begins, each window on its own line
    (layers.extrapolate_backward): equal to the byte."""
    from hf_memwatch.testing.sweep import depth_check

    depth, shortcut, full = depth_check(draw(11))
    assert depth == 8 and shortcut == full == 5_536_596, (shortcut, full)


def test_the_variants_cover_the_issue_s_kinds_and_keep_the_seeded_draws() -> None:
    from hf_memwatch.testing.sweep import TrlDraw, variants

    kinds = variants()
    described = " / ".join(k.describe() for k in kinds)
    for kind in ("bf16 weights", "fp16 weights", "instance:Adafactor", "instance:bnb.PagedAdamW8bit", "QLoRA nf4",
                 "TRL sft,", "TRL sft-iterable", "TRL dpo", "lmbda 0.0", "lmbda 0.5", "lmbda 1.0"):
        assert kind in described, kind
    assert any(isinstance(k, TrlDraw) for k in kinds)
    assert draw(0).weights == "fp32" and "weights" not in draw(0).describe()  # the seeded space is unchanged


def test_the_gkd_teacher_counts_in_the_truth_baseline(tmp_path) -> None:
    """The profiler's window starts with the student and the teacher resident: both are the baseline (without
    the teacher, GKD's truth read the teacher's weights as the step's memory)."""
    from hf_memwatch.measure.attribution import weight_storages
    from hf_memwatch.testing.perturbation import _baseline
    from hf_memwatch.testing.sweep import TrlDraw, trl_builder

    trainer = trl_builder(TrlDraw(1000, "gkd", lmbda=0.5))(str(tmp_path), [])
    student = sum(weight_storages(trainer.model, None).values())
    teacher = sum(weight_storages(trainer.teacher_model, None).values())
    assert teacher > 0 and _baseline(trainer) == student + teacher


def test_sft_over_an_iterable_dataset_is_estimated() -> None:
    """A stream of 64-token rows under max_length 64: estimated at that bound, unread, on the batch TRL's
    collator forms (``streaming.bounded_batch``). Failed before: the replayed synthetic batch had no
    ``attention_mask`` and TRL's ``compute_loss`` raised inside the replay."""
    from hf_memwatch.testing.sweep import TrlDraw

    result = run_draw(TrlDraw(1000, "sft-iterable"))
    assert result.error is None, result.error
    assert abs(result.estimate_error) <= 0.01, (result.estimate, result.truth)
