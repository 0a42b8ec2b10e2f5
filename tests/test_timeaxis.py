"""The x-axis on wall-clock seconds (hf_memwatch.reporting.timeaxis), on timeline records as MemWatch writes them."""

from __future__ import annotations

import json

import pytest

from hf_memwatch import MemWatchConfigError
from hf_memwatch.reporting.report import load_run
from hf_memwatch.reporting.timeaxis import XAxis, time_positions, x_axes


def test_positions_interpolate_between_snapshots_and_clamp_at_the_ends():
    times = [0.0, 0.25, 1.0, 4.0]
    assert time_positions([0, 1, 2, 3], times) == times  # a snapshot at its own time
    assert time_positions([1.5, 2.5], times) == [0.625, 2.5]  # a phase's middle, between its two ends
    assert time_positions([-0.5, 3.5, None], times) == [0.0, 4.0, None]
    assert [XAxis(times).span(i) for i in range(4)] == [(0.0, 0.0), (0.0, 0.25), (0.25, 1.0), (1.0, 4.0)]
    assert XAxis().at(2.5) == 2.5 and XAxis().span(0) == (-0.5, 0.5)


def test_ranks_share_one_clock_and_an_unknown_axis_is_one_line(tmp_path):
    """Two ranks whose first snapshots were taken 1.5 s apart: rank 1's seconds start at 1.5."""
    folder = tmp_path / "memwatch"
    folder.mkdir()
    for rank, start in ((0, 1000.0), (1, 1001.5)):
        records = [{"event": "snapshot", "step": 1, "micro_step": 0, "phase": phase, "rank": rank, "device": "cpu",
                    "time": start + dt, "allocated": 100, "reserved": None, "peak": 100,
                    "live": {"weights": 100}, "spike": 0, "allocator_overhead": None, "fragmentation": None,
                    "num_alloc_retries": None, "num_ooms": None, "device_free": None, "device_total": None,
                    "host_rss": 1, "host_vms": 1, "detail": "full"}
                   for phase, dt in (("step_begin", 0.0), ("after_forward", 0.5))]
        name = "timeline.jsonl" if rank == 0 else f"timeline.rank{rank}.jsonl"
        (folder / name).write_text("\n".join(json.dumps(r) for r in records) + "\n")
    runs = load_run(folder)
    assert [axis.times for axis in x_axes(runs, "seconds")] == [[0.0, 0.5], [1.5, 2.0]]
    assert [axis.times for axis in x_axes(runs, "steps")] == [None, None]
    with pytest.raises(MemWatchConfigError, match="the x-axis is one of steps, seconds; got 'wall'"):
        x_axes(runs, "wall")


def test_a_timeline_without_times_keeps_the_step_axis(tmp_path):
    """Snapshots written without their ``time`` (by hand, or an older version): the page draws without
    the seconds button and the picture on seconds is one line saying why."""
    from hf_memwatch.reporting.page import build_figure

    record = {"event": "snapshot", "step": 1, "micro_step": 0, "phase": "step_begin", "allocated": 100,
              "peak": 100, "live": {"weights": 100}, "spike": 0}
    (tmp_path / "timeline.jsonl").write_text(json.dumps(record) + "\n")
    runs = load_run(tmp_path)
    assert [s.time for s in runs[0].snapshots] == [None]
    assert build_figure(runs).layout.updatemenus == ()
    with pytest.raises(MemWatchConfigError, match="needs each snapshot's time"):
        x_axes(runs, "seconds")
