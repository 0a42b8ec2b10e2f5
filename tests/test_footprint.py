"""Planning against what the limit counts: the footprint margin measured in the run (measure/footprint.py,
planning/budget.py, the auto mode's first steps), the expandable-segments advice, and a long sample
deep in the dataset planned for before training reaches it.

CUDA logic runs here on ``torch.cuda.memory_stats``-shaped dicts and CUDA-shaped timeline records
through the same functions the CUDA path calls; the CPU paths run on real runs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import DataCollatorForLanguageModeling, Trainer

from hf_memwatch import MemWatch
from hf_memwatch.core.records import FootprintRecord, Snapshot, StepRecord
from hf_memwatch.integration.auto import AutoMode
from hf_memwatch.measure.backends import backend_for
from hf_memwatch.measure.footprint import (
    FootprintReading,
    advice_from_stats,
    expandable_segments_advice,
    expandable_segments_enabled,
    peak_gap,
    probe_host_gap,
    step_footprint,
)
from hf_memwatch.planning.budget import Budget, footprint_kind, margin_before_training, resolve_budget
from hf_memwatch.reporting.summary import footprint_lines
from hf_memwatch.testing.estimate_truth import ListDataset
from hf_memwatch.testing.tokenizers import word_tokenizer
from hf_memwatch.testing.truth import StepMarker, cpu_memory_profile, step_peaks

MiB = 1 << 20
LIGHT = {"detail": "light", "report": False, "summary": False}

# torch.cuda.memory_stats() of an H100 process after a step (keys as the allocator names them; the
# peaks since the last reset_peak_memory_stats): 2.5 GiB reserved, 1.9 GiB allocated at the peak.
CUDA_STATS = {
    "allocated_bytes.all.current": 1_288_490_188, "allocated_bytes.all.peak": 2_040_109_465,
    "reserved_bytes.all.current": 2_684_354_560, "reserved_bytes.all.peak": 2_684_354_560,
    "inactive_split_bytes.all.current": 402_653_184, "num_alloc_retries": 0, "num_ooms": 0,
    "active_bytes.all.peak": 2_040_109_465, "segment.all.current": 41,
}


# -- the pure measurements ---------------------------------------------------------------------------
def test_peak_gap_counts_retained_heap_once_and_footprint_gap_twice() -> None:
    readings = [FootprintReading(0, 100 * MiB, 600 * MiB), FootprintReading(1, 400 * MiB, 960 * MiB),
                FootprintReading(2, 100 * MiB, 960 * MiB)]
    assert peak_gap(readings) == 60 * MiB  # the footprint peaked 360 MiB higher for 300 MiB more tensors
    assert peak_gap(readings[:1]) is None


def typed(record: dict[str, Any]) -> Any:
    """A timeline line as the monitor hands it on: its typed record (fields it lacks read as absent)."""
    return (StepRecord if record.get("event") == "step" else Snapshot).from_dict(record, lenient=True)


def test_step_footprint_on_cuda_shaped_records() -> None:
    # Step 1 of an AdamW run: peak in the backward pass, the states allocated after it by optimizer.step().
    step = {"event": "step", "step": 1, "peak": 2_040_109_465, "detail": "light", "live_at_peak": {"optimizer_states": 0}}
    snapshots = [
        {"phase": "step_begin", "allocated": 700_000_000, "reserved": 792_723_456, "live": {"optimizer_states": 0}},
        {"phase": "after_backward", "allocated": 1_000_000_000, "reserved": 2_684_354_560,
         "live": {"optimizer_states": 0}, "num_alloc_retries": 0},
        {"phase": "step_end", "allocated": 1_288_490_188, "reserved": 2_684_354_560,
         "live": {"optimizer_states": 288_490_188}, "num_alloc_retries": 0},
    ]
    step, snapshots = typed(step), [typed(s) for s in snapshots]
    measured = step_footprint(step, snapshots, "reserved")
    assert measured is not None
    assert measured.gap == 2_684_354_560 - 2_040_109_465  # reserved − allocated at the peak
    assert measured.states_growth == 288_490_188
    assert measured.need == 2_040_109_465 + 288_490_188 + measured.gap
    # CUDA's light steps are exact; a CPU step not tracked in full has no allocated peak of its own
    # (its figures are the last full step's, or 0), and a host kind needs the baseline: nothing measured.
    assert step_footprint(step.replace(peak=None), snapshots, "reserved") is None
    baseline = FootprintReading(0.0, 500_000_000, 3 << 30)
    assert step_footprint(step, snapshots, "rss", baseline) is None
    assert step_footprint(step.replace(detail="full"), snapshots, "rss") is None
    assert step_footprint(step.replace(detail="full"), [s.replace(host_rss=4 << 30) for s in snapshots], "rss",
                          baseline) is not None


def test_step_footprint_on_a_real_cpu_step(tmp_path: Path) -> None:
    from hf_memwatch.measure.footprint import host_reading

    model = gpt2_model()
    baseline = host_reading(sum(p.nbytes for p in model.parameters()), "vms")
    # 8 x 64 tokens: the activations' peak in the backward pass is above the step's end.
    trainer = Trainer(model=model, args=training_args(tmp_path, per_device_train_batch_size=8, max_steps=1),
                      train_dataset=token_dataset(8, 64, 1000), callbacks=[MemWatch(detail="full", report=False,
                                                                                    summary=False)])
    trainer.train()
    records = read_records(tmp_path)
    [step] = [r for r in records if r["event"] == "step"]
    snapshots = [r for r in records if r["event"] == "snapshot"]
    assert all(isinstance(s["host_vms"], int) and s["host_vms"] >= s["host_rss"] for s in snapshots)
    measured = step_footprint(typed(step), [typed(s) for s in snapshots], "vms", baseline)
    assert measured is not None and measured.step == 1 and measured.allocated_peak == step["peak"]
    assert measured.states_growth > 0  # AdamW's states, created after the backward peak
    # The gap is what the virtual size grew beyond the tensors: never negative, and here far below a GiB.
    assert 0 <= measured.gap < 1 << 30


def test_the_probe_measures_the_allocators_overhead_not_what_it_reuses() -> None:
    gap = probe_host_gap("rss", 8 * MiB, 16)
    assert gap is not None and 0 <= gap < 8 * MiB
    assert probe_host_gap("allocated") is None


def test_expandable_segments_advice_from_memory_stats_shaped_dicts() -> None:
    advice = advice_from_stats(CUDA_STATS, "")
    assert advice is not None and "expandable_segments:True" in advice and "24%" in advice
    assert advice_from_stats(CUDA_STATS, "expandable_segments:True") is None  # already on
    assert advice_from_stats(CUDA_STATS, "expandable_segments:True,expandable_segments:False") is not None
    tight = dict(CUDA_STATS, **{"reserved_bytes.all.peak": 2_100_000_000})  # 3% gap: nothing to say
    assert advice_from_stats(tight, "") is None
    retried = dict(tight, num_alloc_retries=3)  # the allocator had to free its cache and retry
    assert "3 allocation(s) retried" in (advice_from_stats(retried, "") or "")
    assert expandable_segments_advice(None, None, None, "") is None
    assert expandable_segments_enabled("garbage_collection_threshold:0.6,expandable_segments:true")


def test_the_summary_names_the_measured_margin_and_the_advice() -> None:
    steps = [StepRecord.from_dict({"step": 1, "peak": 2_040_109_465}, lenient=True)]
    snapshots = [Snapshot.from_dict({"step": 1, "reserved": 2_684_354_560, "num_alloc_retries": 0}, lenient=True)]
    assert "expandable_segments:True" in footprint_lines([], steps, snapshots, "")[0]
    assert footprint_lines([], steps, snapshots, None) == []  # a stored timeline: settings unknown
    footprint = FootprintRecord.from_dict({"step": 1, "kind": "reserved", "footprint_gap": 644_244_095,
                                           "margin": 0.31, "advice": "set X"}, lenient=True)
    assert footprint_lines([footprint], steps, snapshots, "") == [
        "footprint measured in steps 1: up to 614.40 MiB reserved beyond the allocated bytes, planning margin 31.0%",
        "set X"]


def test_the_budget_margin_before_training_is_what_the_limit_counts() -> None:
    cpu = backend_for(torch.device("cpu"))
    user = resolve_budget("1GiB", cpu)
    assert footprint_kind(user, cpu) == "allocated"
    assert margin_before_training(user, cpu).margin == 0  # a byte budget on the CPU counts tensor bytes
    default = resolve_budget(None, cpu)
    assert footprint_kind(default, cpu) in ("rss", "vms")
    measured = margin_before_training(default, cpu)
    assert measured.usable <= measured.total and "probe allocation" in measured.margin_source
    as_vm = Budget(total=1 << 30, margin=0, source="test", bound_by="RLIMIT_AS")
    assert footprint_kind(as_vm, cpu) == "vms"
    # The safety net plans below a failed plan with the measured margin kept above its limit.
    lowered = as_vm.with_margin(64 * MiB, "measured").with_usable(300 * MiB, "70% of the plan")
    assert (lowered.usable, lowered.margin) == (300 * MiB, 64 * MiB)


# -- the auto mode between steps -----------------------------------------------------------------------
def test_a_step_whose_measured_footprint_would_not_fit_turns_checkpointing_on(tmp_path: Path, caplog: Any) -> None:
    """The CUDA path on CUDA-shaped records: reserved bytes beyond the allocated ones at the peak make the
    next step not fit the budget, though the plan's allocated bytes do."""
    trainer = Trainer(model=gpt2_model(), args=training_args(tmp_path / "run", per_device_train_batch_size=4),
                      train_dataset=token_dataset(16, 64, 1000))
    records: list[dict[str, Any]] = []
    auto = AutoMode("64MiB", lambda record: records.append(record.to_dict()))  # typed records, as written
    auto.before_train(trainer)
    plan = records[0]
    assert plan["event"] == "plan" and plan["activation_checkpointing"] is False
    assert plan["margin"] == 0.0 and "tensor bytes" in plan["margin_source"]
    auto.kind = "reserved"  # as on CUDA: the limit counts reserved bytes
    peak = int(plan["predicted_peak"])
    budget = auto.budget
    assert budget is not None
    step = StepRecord.from_dict({"step": 1, "peak": peak, "detail": "light", "live_at_peak": {"optimizer_states": 0}},
                                lenient=True)
    reserved = peak + (budget.total - peak) + 8 * MiB  # reserve gap larger than the room left
    snapshots = [Snapshot.from_dict({"allocated": peak // 2, "reserved": reserved, "num_alloc_retries": 0,
                                     "live": {"optimizer_states": 0}}, lenient=True)]
    with caplog.at_level(logging.INFO, logger="hf_memwatch"):
        replanned = auto.after_step(trainer, step, snapshots)
    footprint = next(r for r in records if r["event"] == "footprint")
    assert footprint["fits"] is False and footprint["footprint_gap"] == reserved - peak
    assert footprint["next_step_need"] == reserved and footprint["budget"] == budget.total
    assert "expandable_segments:True" in (footprint["advice"] or "")
    assert replanned is not None and replanned.activation_checkpointing is True
    assert trainer.model.is_activation_checkpointing
    assert "would not fit" in replanned.reason and "between steps" in replanned.reason
    assert replanned.predicted_peak < peak  # the checkpointed step, predicted by the plan's predictor
    assert replanned.margin > 0 and "measured in step(s) 1" in replanned.margin_source
    assert records[-1] == replanned.to_dict()  # what was written is the plan in force
    # The measured gap is the margin of any later plan (the safety net's).
    assert auto.budget is not None and auto.budget.margin == reserved - peak
    assert "would not fit the budget" in caplog.text and "expandable_segments" in caplog.text
    # Only the first MEASURED_STEPS steps are measured.
    for n in (2, 3, 4):
        auto.after_step(trainer, step.replace(step=n), snapshots)
    assert [r["step"] for r in records if r["event"] == "footprint"] == [1, 2, 3]


# -- a long sample deep in the dataset -----------------------------------------------------------------
LONG_INDEX, LONG, SHORT, N_SHORT, BATCH = 10_500, 256, 8, 12_000, 8
START = LONG_INDEX - 2 * BATCH  # the long sample falls in step 3


def long_tail_dataset() -> ListDataset:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (N_SHORT, SHORT), generator=generator).tolist()
    items = [{"input_ids": row} for row in ids]
    items.insert(LONG_INDEX, {"input_ids": torch.randint(0, 1000, (LONG,), generator=generator).tolist()})
    return ListDataset(items)


class RotatedSampler(torch.utils.data.Sampler):
    """Sequential order starting at ``start`` (then wrapping): the run meets the long sample at step 3."""

    def __init__(self, size: int, start: int) -> None:
        self.size, self.start = size, start

    def __iter__(self):
        yield from range(self.start, self.size)
        yield from range(self.start)

    def __len__(self) -> int:
        return self.size


class InOrderTrainer(Trainer):
    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler:
        return RotatedSampler(len(train_dataset or self.train_dataset), START)


def run_long_tail(out: Path, callbacks: list[Any]) -> tuple[Trainer, list[int]]:
    tokenizer = word_tokenizer()
    model = gpt2_model(n_layer=1, vocab=len(tokenizer))
    trainer = InOrderTrainer(model=model, args=training_args(out, per_device_train_batch_size=BATCH, max_steps=3),
                             train_dataset=long_tail_dataset(), callbacks=[StepMarker(), *callbacks],
                             data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    baseline = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
    with cpu_memory_profile() as prof:
        trainer.train()
    return trainer, step_peaks(prof, baseline)


def test_a_long_sample_past_index_10000_is_planned_for_and_its_step_fits(tmp_path: Path) -> None:
    _, unassisted = run_long_tail(tmp_path / "given", [])
    short, long = max(unassisted[:2]), unassisted[2]
    budget = int(0.6 * long)
    assert short < budget < long  # the short batches fit, the long one does not, unassisted

    trainer, peaks = run_long_tail(tmp_path / "auto", [MemWatch(auto=True, budget=budget, **LIGHT)])
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert plan["sample"]["index"] == LONG_INDEX and plan["sample"]["seq_len"] == LONG
    assert plan["predicted_peak"] <= budget
    assert (plan["micro_batch_size"], plan["activation_checkpointing"]) != (BATCH, False)  # a remedy
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] == BATCH
    assert trainer.state.global_step == 3
    assert max(peaks) <= budget  # step 3, the long sample's, included: PyTorch's own accounting
