"""DeepSpeed's bf16 under ZeRO (engines/zero/half.py): the module cast to bf16, replayed without autocast.

Unit tests of the cast and the registry's ``replay_request`` hook, and one torchrun launch
(``dist_scripts/zero_bf16.py``) holding ``estimate(trainer)`` against the profiler per rank for
ZeRO-1/2 in bf16 (before: the Trainer's autocast step replayed and converted by DeepSpeed's
per-parameter formula, +7.3..+27.4% on the sweep's ZeRO-1/2 bf16 draws).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpt2_model, torchrun

from hf_memwatch.engines.engine import Engine
from hf_memwatch.engines.registry import rules_for
from hf_memwatch.engines.zero.backward import flow_applies
from hf_memwatch.engines.zero.half import deepspeed_half, half_module, replay_request
from hf_memwatch.estimation.branches import RACE_FREED
from hf_memwatch.estimation.request import EstimateRequest

SCRIPTS = Path(__file__).parents[1] / "dist_scripts"
ZERO2 = Engine(kind="deepspeed", world_size=2, zero_stage=2, reduce_bucket_size=100_000)


def test_half_module_casts_the_parameters_and_puts_them_back():
    model = gpt2_model()
    buffers = {name: b.dtype for name, b in model.named_buffers()}
    with half_module(model):
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert {name: b.dtype for name, b in model.named_buffers()} == buffers  # DeepSpeed keeps buffers
        assert flow_applies(ZERO2, model)  # the ZeRO-1/2 flow replays bf16 gradients
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_only_deepspeed_bf16_is_replayed_without_autocast():
    request = EstimateRequest(precision="bf16", world_size=2, shard="zero2", engine=ZERO2)
    assert deepspeed_half(ZERO2, "bf16") and not deepspeed_half(ZERO2, "fp16") and not deepspeed_half(None, "bf16")
    assert replay_request(request).precision == "fp32"
    assert rules_for("zero2", 2, ZERO2).replay_request(request, ZERO2).precision == "fp32"
    ddp = EstimateRequest(precision="bf16", world_size=2, shard="none")
    assert rules_for("none", 2).replay_request(ddp, None).precision == "bf16"  # DDP: the Trainer's autocast


def test_the_estimate_holds_the_model_in_bf16_and_fp32_masters():
    """Per rank, ZeRO-2 bf16 on the test GPT-2: the weights in bf16 (2 B a parameter), the fp32 master
    partition and AdamW's fp32 states on the flat partitions (12 B a parameter / 2 ranks)."""
    from hf_memwatch import estimate

    model = gpt2_model()
    params = sum(p.numel() for p in model.parameters())
    result = estimate(model, micro_batch_size=2, seq_len=16, precision="bf16", world_size=2, shard="zero2",
                      engine=ZERO2)
    assert any(note.startswith("DeepSpeed bf16") for note in result.notes)
    at_step = result.phase_peaks
    assert result.classes["weights"] == 2 * params
    assert abs(result.classes["optimizer_states"] - 12 * params // 2) <= 12 * 64, (result.classes, params)
    assert max(at_step.values()) == result.peak_bytes
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the user's model untouched


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory) -> list[dict[str, Any]]:
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    out = tmp_path_factory.mktemp("zero_bf16")
    torchrun(SCRIPTS / "zero_bf16.py", out, timeout_s=400)
    return [json.loads((out / f"zero_bf16.rank{rank}.json").read_text()) for rank in (0, 1)]


# Measured (2 gloo ranks, DeepSpeed 0.19.8): zero1, zero2 and zero2_ckpt -0.01% on both ranks: the estimate's
# branch that lets each reduction's flat copy go at once against the reconciled truth, which places gloo's frees
# there (MemoryEstimate.branches; engines/zero/backward.py, flat_copies). The estimate itself, the branch that
# holds the copy, is rank 0's high bound to 0.01% in a launch whose worker let it go late (7,378,712 against
# 7,379,260 B; +1.35% over the reconciled truth). Rank 1's zero2_ckpt read -1.22% (91 kB) while the estimate
# was made under the running profiler, where the bf16 products' oneDNN blocks cannot be probed (a profiler does
# not nest: estimation/kernel_workspaces.py): the profiler's high held a 107,648 B block allocated inside an
# aten::mm. The script now makes the estimate once before the profiler starts, as a user's is made: -0.01%.
# Before half.py: +10..+27% on ZeRO-1/2 (the autocast step converted by DeepSpeed's per-parameter formula).
TOLERANCE = {"zero1": 0.01, "zero2": 0.01, "zero2_ckpt": 0.01}


@pytest.mark.parametrize("name", TOLERANCE)
def test_zero_bf16_estimate_matches_the_profiler_per_rank(bf16_runs, name):
    """``estimate(trainer)`` before ``train()`` against each rank's highest profiler step peak (frees on
    gloo's threads reconciled: the estimate's freed-first branch where the step races), DeepSpeed casting the
    module to bf16."""
    for rank, facts in enumerate(bf16_runs):
        fact = facts[name]
        assert fact["param_dtypes"] == ["torch.bfloat16"]  # DeepSpeed did cast the module
        freed = fact["branches"].get(RACE_FREED, fact["predicted"])  # the branch the reconciled truth is
        error = freed / max(fact["truth"]) - 1
        assert abs(error) <= TOLERANCE[name], (name, rank, fact["branches"], fact["truth"], fact["classes"])
        assert fact["predicted"] == max(fact["branches"].values(), default=fact["predicted"])  # the worst


def test_zero3_in_bf16_is_estimated_and_only_zero12_name_the_flat_copys_race():
    """ZeRO-3 in bf16 has no ZeRO-1/2 flow inside the cast module: it is estimated (a flow's notes read on
    ZeRO-3 refused every such draw of the two-rank sweep once), and no note of the reduction's flat copy."""
    from hf_memwatch import estimate

    zero3 = ZERO2.replace(zero_stage=3)
    result = estimate(gpt2_model(), micro_batch_size=2, seq_len=16, precision="bf16", world_size=2, shard="zero3",
                      engine=zero3)
    assert result.peak_bytes > 0 and not any("flat copy" in note for note in result.notes)
    zero2 = estimate(gpt2_model(), micro_batch_size=2, seq_len=16, precision="bf16", world_size=2, shard="zero2",
                     engine=ZERO2)
    assert any("flat copy" in note and "worst branch" in note for note in zero2.notes)
