"""A CPU target's estimates stay byte-identical while the CUDA replay changes (``benchmarks/cpu_golden.py``).

The golden file holds the estimate of every case of the accuracy benchmark's zoo, written when those
figures were last checked against the profiler (``benchmarks/results/accuracy.md``: the same bytes in its
estimate column). The suite checks one case per architecture; ``python benchmarks/cpu_golden.py --check``
checks all 35.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cpu_golden  # noqa: E402

GOLDEN = json.loads(cpu_golden.GOLDEN.read_text())
ONE_PER_ARCHITECTURE = list({case["name"]: case for case in reversed(cpu_golden.cases())}.values())


def test_the_suite_caps_onednn_at_the_golden_file_s_isa():
    """The golden bf16 figures hold on a host of that ISA or above (an AMX host alone moves two of them)."""
    import os

    assert os.environ.get("ONEDNN_MAX_CPU_ISA") == cpu_golden.ONEDNN_ISA


def test_the_golden_file_holds_every_zoo_case():
    assert sorted(GOLDEN) == sorted(cpu_golden.case_key(case) for case in cpu_golden.cases())


@pytest.mark.parametrize("case", ONE_PER_ARCHITECTURE, ids=cpu_golden.case_key)
def test_a_cpu_estimate_is_byte_identical_to_the_golden_file(case):
    assert cpu_golden.figures(case) == GOLDEN[cpu_golden.case_key(case)]
