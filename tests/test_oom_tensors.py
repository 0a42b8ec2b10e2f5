"""``reporting/oom_tensors``: the post-mortem's largest tensors, read from the last full step's typed record."""

from __future__ import annotations

import torch

from hf_memwatch.core.records import PeakTensorsRecord
from hf_memwatch.measure.backends import backend_for
from hf_memwatch.measure.monitor import StepMonitor
from hf_memwatch.measure.peak_tensors import PeakTensor, PeakTensors, TensorGroup
from hf_memwatch.reporting.oom_tensors import tensor_lines, tensors_at_failure

PEAK = PeakTensors(4096, 2, [PeakTensor(4096, [32, 32], "fp32", "activations", "aten.mm", "model.fc", "forward")],
                   [TensorGroup("model.fc", 4096, 1)], [TensorGroup("aten.mm", 4096, 1)], {"activations": 4096})


def test_the_last_full_steps_tensors_come_from_its_typed_record() -> None:
    monitor = StepMonitor(backend_for(torch.device("cpu")), writer=None)
    assert tensors_at_failure(monitor) is None  # no full step yet: nothing to show
    record = PeakTensorsRecord(step=3, rank=0, phase="after_forward", micro_step=0, source="tracker", **PEAK.as_record())
    monitor.peaks.last = record  # as PeakWatch.end_step leaves it
    source, found = tensors_at_failure(monitor)
    assert source == "the peak of the last fully tracked step (3, `after_forward`)"
    assert found == PEAK == PeakTensors.from_record(record.to_dict())  # the typed record and its JSON agree


def test_the_markdown_lists_the_tensors_then_the_groups() -> None:
    lines = tensor_lines(("a test", PEAK))
    assert "From a test: 4.00 KiB in 2 storages." in lines
    assert "| 4.00 KiB | 32 × 32 | fp32 | activations | aten.mm | model.fc | forward |" in lines
    assert lines[-2:] == ["", "By operator: aten.mm 4.00 KiB (1)"] and tensor_lines(None) == []
