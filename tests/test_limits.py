"""The real limit (budget.py) and the real footprint (footprint.py): real rlimits, real cgroup files."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_memwatch.measure.backends import backend_for
from hf_memwatch.measure.footprint import (
    FootprintReading,
    footprint_gap,
    host_sizes,
    parse_proc_status,
    read_footprint,
)
from hf_memwatch.planning.budget import (
    CGROUP_ROOT,
    DEFAULT_FRACTION,
    PROC_CGROUP,
    cgroup_limit,
    parse_cgroup_value,
    parse_proc_cgroup,
    resolve_budget,
)

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]

RLIMIT_SCRIPT = """
import json, resource, sys, torch
from hf_memwatch.planning.budget import resolve_budget
from hf_memwatch.measure.backends import backend_for
from hf_memwatch.measure.footprint import parse_proc_status
name, above = sys.argv[1], int(sys.argv[2])
field = {"RLIMIT_AS": "VmSize", "RLIMIT_DATA": "VmData"}[name]
size = parse_proc_status(open("/proc/self/status").read())[field]
resource.setrlimit(getattr(resource, name), (size + above, resource.RLIM_INFINITY))
budget = resolve_budget(None, backend_for(torch.device("cpu")))
print(json.dumps({"total": budget.total, "bound_by": budget.bound_by, "limits": budget.limits_record(),
                  "source": budget.source}))
"""


def budget_under_rlimit(name: str, above: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", RLIMIT_SCRIPT, name, str(above)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("name", ["RLIMIT_AS", "RLIMIT_DATA"])
def test_default_budget_is_bound_by_a_real_rlimit_set_in_the_process(name):
    above = 1200 * MiB
    result = budget_under_rlimit(name, above)
    print(name, result)
    assert result["bound_by"] == name
    available = result["limits"][name]
    # Between setrlimit and the reading the process grew a little (imports are done before it).
    assert above - 64 * MiB <= available <= above
    assert result["total"] == int(DEFAULT_FRACTION * available)
    assert result["limits"]["MemAvailable"] > available
    assert name in result["source"] and "above the" in result["source"]


def test_default_budget_without_rlimits_is_the_smallest_candidate():
    budget = resolve_budget(None, backend_for(torch.device("cpu")))
    smallest = min(budget.limits_record().items(), key=lambda kv: kv[1])
    assert budget.bound_by == smallest[0]
    assert budget.total == int(DEFAULT_FRACTION * smallest[1])
    assert budget.binding_limit is not None and budget.binding_limit.name == budget.bound_by
    # A user budget names no limit; the old signature and fields still work.
    user = resolve_budget("1GiB", backend_for(torch.device("cpu")))
    assert (user.total, user.usable, user.bound_by, user.source) == (1 << 30, 1 << 30, None, "user budget")


def test_cgroup_value_parser_reads_the_kernels_formats():
    assert parse_cgroup_value("max\n") is None  # v2 no limit
    assert parse_cgroup_value("9223372036854771712\n") is None  # v1 no limit (PAGE_COUNTER_MAX)
    assert parse_cgroup_value("536870912\n") == 512 * MiB
    assert parse_cgroup_value(None) is None and parse_cgroup_value("") is None


def test_cgroup_parsers_on_this_machines_real_files():
    text = Path(PROC_CGROUP).read_text() if Path(PROC_CGROUP).exists() else None
    if text is None:
        pytest.skip("no /proc/self/cgroup")
    v2, v1 = parse_proc_cgroup(text)
    assert v2 is not None or v1 is not None
    read_any = False
    for folder, limit_file, usage_file in ((Path(CGROUP_ROOT) / (v2 or "/").lstrip("/"), "memory.max", "memory.current"),
                                           (Path(CGROUP_ROOT, "memory") / (v1 or "/").lstrip("/"),
                                            "memory.limit_in_bytes", "memory.usage_in_bytes")):
        if (folder / usage_file).exists():
            read_any = True
            usage = parse_cgroup_value((folder / usage_file).read_text())
            assert usage is not None and usage > 0  # this very process is in the group
            limit_text = (folder / limit_file).read_text()
            limit = parse_cgroup_value(limit_text)
            assert limit is None or limit > 0
            assert (limit is None) == (limit_text.strip() == "max" or int(limit_text) >= 1 << 62)
    found = cgroup_limit()
    if not read_any:
        pytest.skip("no readable memory cgroup here")
    assert found is None or found.available >= 0


CGROUP_SCRIPT = """
import json, os, sys, torch
from hf_memwatch.planning.budget import resolve_budget
from hf_memwatch.measure.backends import backend_for
group = sys.argv[1]
with open(os.path.join(group, "cgroup.procs"), "w") as fh:  # join the group after the imports
    fh.write(str(os.getpid()))
budget = resolve_budget(None, backend_for(torch.device("cpu")))
usage = int(open(os.path.join(group, "memory.usage_in_bytes")).read())
print(json.dumps({"total": budget.total, "bound_by": budget.bound_by, "limits": budget.limits_record(),
                  "usage": usage, "source": budget.source}))
"""


def own_v1_memory_group() -> Path | None:
    text = Path(PROC_CGROUP).read_text() if Path(PROC_CGROUP).exists() else ""
    v1 = parse_proc_cgroup(text)[1]
    folder = None if v1 is None else Path(CGROUP_ROOT, "memory") / v1.lstrip("/")
    return folder if folder is not None and (folder / "memory.limit_in_bytes").exists() else None


def test_default_budget_is_bound_by_a_real_cgroup_v1_limit_where_the_machine_allows(tmp_path):
    parent = own_v1_memory_group()
    if parent is None:
        pytest.skip("no cgroup v1 memory group of this process")
    group = parent / f"hf_memwatch_test_{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(1 << 30))
    except OSError as exc:
        if group.exists():
            group.rmdir()
        pytest.skip(f"cannot create a cgroup here: {exc}")
    try:
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out = subprocess.run([sys.executable, "-c", CGROUP_SCRIPT, str(group)], env=env,
                             capture_output=True, text=True, timeout=120, check=True)
    finally:
        group.rmdir()
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(result)
    name = "cgroup v1 memory.limit_in_bytes"
    assert result["bound_by"] == name
    available = result["limits"][name]
    # limit - usage, usage read a moment later by the process itself
    assert abs(available - ((1 << 30) - result["usage"])) <= 16 * MiB
    assert result["total"] == int(DEFAULT_FRACTION * available)
    assert str(group) in result["source"]


def write_group(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (folder / name).write_text(value)


def test_cgroup_v2_limit_is_the_tightest_ancestor(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/job.scope\n")
    root = tmp_path / "sys"
    write_group(root, {})
    write_group(root / "system.slice", {"memory.max": "2147483648\n", "memory.current": "1610612736\n"})
    write_group(root / "system.slice" / "job.scope", {"memory.max": "max\n", "memory.current": "104857600\n"})
    limit = cgroup_limit(str(proc), str(root))
    assert limit is not None and limit.name == "cgroup v2 memory.max"
    assert limit.available == 2147483648 - 1610612736
    assert "system.slice" in limit.detail


def test_cgroup_v1_limit_minus_usage(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("12:pids:/\n4:memory:/docker/abc\n0::/\n")
    root = tmp_path / "sys"
    write_group(root, {"memory.max": "max\n"})  # v2 root with no limit
    write_group(root / "memory", {"memory.limit_in_bytes": "9223372036854771712\n",
                                  "memory.usage_in_bytes": "5000000000\n"})
    write_group(root / "memory" / "docker" / "abc", {"memory.limit_in_bytes": "1073741824\n",
                                                     "memory.usage_in_bytes": "268435456\n"})
    limit = cgroup_limit(str(proc), str(root))
    assert limit is not None and limit.name == "cgroup v1 memory.limit_in_bytes"
    assert limit.available == 1073741824 - 268435456


def test_cgroup_without_limits_gives_none(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    write_group(tmp_path / "sys", {"memory.max": "max\n", "memory.current": "123\n"})
    assert cgroup_limit(str(proc), str(tmp_path / "sys")) is None
    assert cgroup_limit(str(tmp_path / "missing"), str(tmp_path / "sys")) is None


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_host_sizes_agree_with_proc_status_and_follow_a_real_allocation():
    vms, rss = host_sizes()
    status = parse_proc_status(Path("/proc/self/status").read_text())
    assert vms is not None and rss is not None
    assert abs(vms - status["VmSize"]) <= 64 * MiB and abs(rss - status["VmRSS"]) <= 64 * MiB
    # A fresh mapping, written through torch: its pages become resident whatever malloc already holds (a
    # torch.ones of 64 MiB reused pages the process had freed, and RSS did not move, in one suite run).
    region = mmap.mmap(-1, 64 * MiB)
    before = read_footprint(allocated=0)
    block = torch.frombuffer(region, dtype=torch.float32).fill_(1.0)  # 64 MiB, touched
    after_alloc = read_footprint(allocated=block.nbytes)
    assert after_alloc.rss - before.rss >= 60 * MiB
    # The footprint followed the allocation: no growth of the gap beyond a few MiB.
    assert abs(footprint_gap([before, after_alloc])) < 16 * MiB
    del block
    region.close()


def test_footprint_gap_is_the_growth_of_footprint_over_allocated():
    readings = [FootprintReading(0, 100 * MiB, 150 * MiB), FootprintReading(1, 400 * MiB, 780 * MiB),
                FootprintReading(2, 100 * MiB, 480 * MiB)]
    assert footprint_gap(readings) == 330 * MiB  # malloc kept 330 MiB the allocations gave back
    assert footprint_gap(readings[:1]) is None
    assert footprint_gap([FootprintReading(0, None, 1), FootprintReading(1, 2, 3)]) is None
