"""CUDA hygiene, tested on the CPU where the logic allows (issue #21 point 7): unknown figures are
null, one allocator read per snapshot, the peak window reset at a run's first step, the run's peak
offered as ``MemWatch.max_allocated``, phase annotations requested from the installed torch."""

from __future__ import annotations

import torch
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import Trainer

from hf_memwatch import MemWatch
from hf_memwatch.measure.backends import CpuTrackedBackend, reading_from_stats
from hf_memwatch.measure.monitor import StepMonitor
from hf_memwatch.reporting.allocator_history import history_options


def test_memory_stats_before_cuda_init_read_as_unknown():
    empty = reading_from_stats({}, None, None)  # torch.cuda.memory_stats() before CUDA is initialised
    assert (empty.allocated, empty.reserved, empty.peak, empty.num_ooms, empty.inactive_split) == (None,) * 5
    known = reading_from_stats({"allocated_bytes.all.current": 0, "reserved_bytes.all.current": 2097152,
                                "allocated_bytes.all.peak": 512, "num_ooms": 0}, 10, 20)
    assert (known.allocated, known.reserved, known.peak, known.num_ooms, known.device_free) == (0, 2097152, 512, 0, 10)


class CountingBackend(CpuTrackedBackend):
    """The real CPU backend, recording the order of its reads and peak resets."""

    def __init__(self, device):
        super().__init__(device)
        self.calls: list[str] = []

    def read(self):
        self.calls.append("read")
        return super().read()

    def reset_peak(self):
        self.calls.append("reset")
        super().reset_peak()


def test_one_read_per_snapshot_and_the_peak_reset_before_the_first():
    backend = CountingBackend(torch.device("cpu"))
    monitor = StepMonitor(backend, None)
    model = torch.nn.Linear(8, 8)
    monitor.attach(model, None)
    before = torch.ones(1 << 16)  # allocated before the run: must not be the first step's peak  # noqa: F841
    for step in (1, 2):
        monitor.begin_step(step, full=True)
        model(torch.randn(4, 8)).sum().backward()
        monitor.snapshot("after_backward")
        monitor.end_step()
    # Step 1: reset, then (read, reset) per snapshot; step 2 has no run-start reset.
    assert backend.calls[:7] == ["reset", "read", "reset", "read", "reset", "read", "reset"]
    assert backend.calls.count("read") == len(monitor.step_snapshots) * 2  # 3 snapshots a step, 2 steps
    assert backend.calls.count("reset") == 1 + backend.calls.count("read")


def test_max_allocated_is_the_runs_peak(tmp_path):
    watch = MemWatch(detail="full", report=False, summary=False)
    trainer = Trainer(model=gpt2_model(n_layer=1, n_embd=32, vocab=100), args=training_args(tmp_path, max_steps=2),
                      train_dataset=token_dataset(8, 8, 100), callbacks=[watch])
    trainer.train()
    peaks = [r["peak"] for r in read_records(tmp_path) if r["event"] == "step"]
    assert watch.max_allocated == max(peaks) > 0


def test_history_asks_for_global_annotations_where_torch_takes_them():
    assert history_options() == {"global_record_annotations": True}  # the installed torch (2.13) takes it

    def older_recorder(enabled="all", context="all", stacks="all", max_entries=0, device=None):
        return None

    assert history_options(older_recorder) == {}
