"""FSDP1 (accelerate's ``fsdp_version: 1``) on 2 gloo ranks through the Trainer: the engine the registry reads
and the estimate against the profiler (``hf_memwatch/engines/fsdp1/rules.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import torchrun

from hf_memwatch.engines.engine import Engine
from hf_memwatch.engines.registry import rules_for

SCRIPTS = Path(__file__).resolve().parents[1] / "dist_scripts"


def test_an_fsdp1_engine_has_its_own_rules() -> None:
    fsdp1 = Engine(kind="fsdp", world_size=2, fsdp_version=1, fsdp_strategy="FULL_SHARD")
    assert rules_for("fsdp", 2, fsdp1).name == "fsdp1"
    assert rules_for("fsdp", 2, fsdp1.replace(fsdp_version=2)).name == "fsdp2"
    assert rules_for("fsdp", 2).name == "fsdp2"  # --shard fsdp: accelerate's default, FSDP2


@pytest.fixture(scope="module")
def fsdp1_runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp1")
    torchrun(SCRIPTS / "fsdp1_trainer.py", out)
    return [json.loads((out / f"fsdp1.rank{rank}.json").read_text()) for rank in (0, 1)]


def test_fsdp1_runs_on_cpu_ranks_and_its_step_peak_is_predicted_within_5_percent(fsdp1_runs) -> None:
    """Measured: the step with the optimizer states peaks at 17,273,508 / 17,273,472 B (ranks 0 / 1), the
    estimate on the Trainer before ``train()`` is 18,049,612 B (+4.5%: the full-shard division's two gathered
    layers and whole-step activations, not FSDP1's unit-by-unit lifecycle). One launch under ``make test``'s
    load (2026-12-05) read 18,066,596 B on a rank: +793,088 B, a block's all-gather output that gloo's worker let
    go after the step's high (the race of ``hf_memwatch/testing/truth.py``, which the FSDP1 rules do not replay),
    0.09% over the estimate; so the estimate is held within 1% under and 5% over."""
    for facts in fsdp1_runs:
        assert facts["wrapped"] == "FullyShardedDataParallel"
        assert facts["engine"] == "FSDP1 FULL_SHARD x 2" and facts["shard"] == "fsdp"
        truth, predicted = facts["truth_step_peaks"][-1], facts["predicted_peak"]
        assert 0.99 * truth <= predicted <= 1.05 * truth, (predicted, truth)
