"""A "no plan fits" stop of a distributed run re-estimates the engine's advice (issue #37, point 5):
:mod:`hf_memwatch.engines.alternatives` lists the changes (a higher ZeRO stage, optimizer offload), and
:func:`hf_memwatch.planning.no_fit.engine_advice` replays the smallest plan under each, so the line gives the
peak the run would have — checked here against an estimate made by hand with that engine.

The runs are ZeRO-2 (explicit 100k-element reduce buckets): ZeRO-1 and DeepSpeed's default 5e8-element
bucket currently predict the whole bucket as gradients (~1.9 GiB on a tiny GPT-2, engines/zero, being fixed),
so a DDP run's ZeRO-1/2 lines are dropped (they save nothing as predicted) until then.
"""

from __future__ import annotations

import dataclasses

from transformers import GPT2Config

from hf_memwatch import estimate
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.engines.alternatives import engine_changes
from hf_memwatch.engines.engine import Engine
from hf_memwatch.engines.registry import engine_advice
from hf_memwatch.planning.chooser import plan_run
from hf_memwatch.planning.no_fit import no_fit_report, smallest_plan
from hf_memwatch.planning.plan import Plan
from hf_memwatch.planning.predict import ESTIMATE_MARGIN, EstimatorPredictor


def _zero(stage: int, device: str = "cpu", **engine: object) -> RunConfig:
    return RunConfig(micro_batch_size=4, seq_len=16, world_size=2, shard=f"zero{stage}", device=device,
                     optim="adamw_torch", engine=Engine(kind="deepspeed", world_size=2, zero_stage=stage, **engine))


def test_the_changes_listed_per_engine() -> None:
    ddp = RunConfig(micro_batch_size=4, world_size=2, engine=Engine(kind="ddp", world_size=2))
    names = [change.name for change in engine_changes(ddp)]
    assert [change.options["shard"] for change in engine_changes(ddp)] == ["zero1", "zero2", "zero3"]
    [catalogue] = engine_advice(ddp, {"weights": 400, "optimizer_states": 800}, 1200)
    assert names[0] == catalogue.name  # the catalogue's line for DDP -> ZeRO-1: the re-estimate replaces it
    assert [c.options["shard"] for c in engine_changes(_zero(2))] == ["zero3"]  # CPU ranks: no offload
    on_gpu = engine_changes(_zero(1, "cuda"))
    assert [c.options["shard"] for c in on_gpu] == ["zero2", "zero3", "zero1"]
    assert on_gpu[-1].options["engine"].offload_optimizer == "cpu" and "offload" in on_gpu[-1].name
    assert engine_changes(_zero(3)) == [] and engine_changes(RunConfig(micro_batch_size=4)) == []
    fsdp = RunConfig(micro_batch_size=4, world_size=2, shard="fsdp", engine=Engine(kind="fsdp", world_size=2))
    assert engine_changes(fsdp) == []


def test_a_zero2_stop_gives_zero3_re_estimated() -> None:
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=8000, n_positions=64,
                        bos_token_id=0, eos_token_id=0)
    run = _zero(2, reduce_bucket_size=100_000)
    predictor = EstimatorPredictor(config, run)
    given = predictor.peak(Plan.of(run))
    zero3 = dataclasses.replace(run.engine, zero_stage=3)
    budget = int(0.5 * given)
    result = plan_run(run, predictor, budget)
    assert result.chosen is None
    message, need = no_fit_report(result, predictor, budget, "the budget")
    flat = " ".join(message.split())
    best = smallest_plan(result, predictor)
    by_hand = estimate(config, **{**best.configure(run).estimate_kwargs(), "shard": "zero3", "engine": zero3})
    figure = int(-(-by_hand.peak_bytes * (1.0 + ESTIMATE_MARGIN) // 1))
    from hf_memwatch.core.units import format_bytes

    assert f'- ZeRO-3 ("zero_optimization": {{"stage": 3}}): predicted {format_bytes(figure)}, ' in flat, message
    assert figure < need and "re-estimated with that engine" in flat
    assert "ZeRO-3 is not predicted here" not in flat  # it is, now
