"""Published configurations on the card at hand: the fifth check of ``benchmarks/gpu_check.py`` (issue 32, point 6).

Three of ``benchmarks/cuda_published.py``'s cases, one per kind of run those sources measured, run again here
with today's torch and transformers and estimated for this card (``estimate(..., device="cuda")``: the local GPU):

=============================  ======================================================================
``perf-fp16`` [A]              bert-large seq-cls through the Trainer, fp16 AMP, AdamW, eager attention
``bert-sdpa-sdpa-16x512`` [B]  bert-base in fp16, SDPA, the forward and backward of ``logits.sum()``
``fms-mistral-lora-bs8`` [F]   Mistral-7B in bf16, LoRA r 16 on q/k/v/o, checkpointing, SDPA, AdamW
=============================  ======================================================================

Scaled to the card: the micro-batch times the card's memory over the source card's where that is below 1
(at least 1); model, sequence and settings as published. What the sources' older versions did differently
(``cuda_published_models``: torch 1.10's softmax, 4.16's ``zero_grad``, 4.48's loss) is not replayed: the run
is today's, and so is its estimate. Measured over the run, the model built first: ``max_memory_allocated``,
``max_memory_reserved`` and the device's used memory (``mem_get_info``), against the estimate's
``peak_bytes``, ``reserved_bytes`` and ``device_bytes``; the goals are the prediction check's. ``--quick`` (the
CPU dry run): the same three at tiny shapes, bf16 autocast for fp16 (the Trainer's fp16 needs a GPU), the
CPU backend's figures.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import torch
import transformers
from cuda_published import CASES, Case, LogitsSum
from gpu_check_probe import CUDA_ONLY, Context, measured_rows
from gpu_check_report import GOALS, CheckResult, error_stats, relative_error
from gpu_check_runs import PeakFromTrainBegin, dataset_for, train, training_args

from hf_memwatch.core.gpus import gpu_spec
from hf_memwatch.estimation.estimate import estimate
from hf_memwatch.estimation.fake_model import auto_class
from hf_memwatch.estimation.peft import LoraSpec

PUBLISHED = ("perf-fp16", "bert-sdpa-sdpa-16x512", "fms-mistral-lora-bs8")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, None: torch.float32}


def published_cases(card_memory: int | None, quick: bool) -> list[Case]:
    """The three cases, each scaled to a card of ``card_memory`` bytes (None: as published); ``quick``: tiny.

    Example:
        >>> [(c.key, c.batch) for c in published_cases(16 * 2**30, quick=False)]
        [('perf-fp16', 4), ('bert-sdpa-sdpa-16x512', 3), ('fms-mistral-lora-bs8', 1)]
        >>> {(c.batch, c.seq) for c in published_cases(None, quick=True)}
        {(2, 32)}
    """
    by_key = {case.key: case for case in CASES}
    cases = []
    for key in PUBLISHED:
        case = by_key[key]
        if quick:
            cases.append(dataclasses.replace(case, batch=2, seq=32))
            continue
        scale = 1.0 if card_memory is None else min(1.0, card_memory / gpu_spec(case.gpu).memory)
        cases.append(dataclasses.replace(case, batch=max(1, int(case.batch * scale))))
    return cases


def tiny_config(case: Case) -> Any:
    """A 2-layer config of the case's family (the dry run)."""
    config = case.config()
    if isinstance(config, transformers.MistralConfig):
        return transformers.MistralConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                          tie_word_embeddings=False)
    return transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=256, max_position_embeddings=512)


def precision_of(case: Case, cuda: bool) -> str:
    """The run's autocast: the case's, bf16 for fp16 on the CPU."""
    return "bf16" if case.precision == "fp16" and not cuda else case.precision


def build(case: Case, quick: bool, device: Any) -> torch.nn.Module:
    """The case's model with random weights on ``device``: its weights' dtype, its attention, its LoRA
    (peft's defaults, as the source ran them), its loop's wrapper."""
    torch.manual_seed(0)
    config = tiny_config(case) if quick else case.config()
    with torch.device(device):
        model = auto_class(case.task).from_config(config, dtype=DTYPES[case.weights_dtype],
                                                  attn_implementation=case.attn)
    if case.lora is not None:
        from peft import get_peft_model

        r, alpha, targets, dropout = case.lora
        model = get_peft_model(model, LoraSpec(r=r, alpha=alpha, targets=targets, dropout=dropout).peft_config(case.task))
    return LogitsSum(model) if case.loop == "logits_sum" else model


def predict(case: Case, model: torch.nn.Module, ctx: Context) -> Any:
    """``estimate`` of the built model with the case's settings, for this device (the local card)."""
    common = dict(task=case.task, micro_batch_size=case.batch, seq_len=case.seq, device=ctx.probe.kind)
    if case.loop == "logits_sum":
        return estimate(model, precision="fp32", optimizer_step=False, **common)
    return estimate(model, precision=precision_of(case, ctx.cuda), optim=case.optim,
                    activation_checkpointing=case.checkpointing, gradient_accumulation_steps=case.accum, **common)


def run_logits_sum(ctx: Context, model: LogitsSum, batch: int, seq: int, steps: int) -> None:
    """The SDPA benchmark script's loop: ``zero_grad(set_to_none)``, forward, ``logits.sum().backward()``."""
    probe = ctx.probe
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(probe.device)
    model.train()
    probe.synchronize()
    probe.reset_peak()
    with probe.session(model):
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            model(input_ids=ids)["loss"].backward()
    model.held = None
    probe.synchronize()


def measure(case: Case, ctx: Context) -> dict[str, Any]:
    """Build, estimate, run 3 steps (2 quick) and read the device; one row of the check."""
    probe, steps = ctx.probe, 2 if ctx.quick else 3
    row: dict[str, Any] = {"case": case.key, "source": case.source.split(" (")[0], "batch": case.batch, "seq": case.seq,
                           "precision": precision_of(case, ctx.cuda), "published_gpu": case.gpu}
    model = build(case, ctx.quick, probe.device)
    est = predict(case, model, ctx)
    row.update(predicted=est.peak_bytes, predicted_reserved=getattr(est, "reserved_bytes", None),
               predicted_device=getattr(est, "device_bytes", None))
    if case.loop == "logits_sum":
        run_logits_sum(ctx, model, case.batch, case.seq, steps)
    else:
        precision = precision_of(case, ctx.cuda)
        with tempfile.TemporaryDirectory(dir=ctx.workdir) as tmp:
            args = training_args(tmp, batch=case.batch, steps=steps, device=probe.kind, bf16=precision == "bf16",
                                 fp16=precision == "fp16", optim=case.optim, checkpointing=case.checkpointing,
                                 gradient_accumulation_steps=case.accum)
            trainer = train(probe, model, args, dataset_for(model, case.batch, case.seq, steps * case.accum),
                            [PeakFromTrainBegin(probe)])
            del trainer
    row.update(max_allocated=probe.peak(), max_reserved=probe.peak_reserved(), device_used=probe.device_used(),
               num_alloc_retries=probe.num_alloc_retries())
    del model
    probe.free()
    row["error_allocated"] = relative_error(row["predicted"], row["max_allocated"])
    for key, predicted, measured in (("error_reserved", "predicted_reserved", "max_reserved"),
                                     ("error_device", "predicted_device", "device_used")):
        if row[predicted] is not None and row[measured]:
            row[key] = relative_error(row[predicted], row[measured])
    return row


def published_result(rows: list[dict[str, Any]], planned: int, running: bool) -> CheckResult:
    """The verdict: every case measured, allocated within the prediction goals, reserved within its worst."""
    measured = [r for r in rows if "error_allocated" in r]
    details: dict[str, Any] = {"cases": rows, "planned": planned}
    if not measured:
        return CheckResult("published", None if running else False,
                           "running: no case measured yet" if running else "no case could be measured", details)
    stats = {name: error_stats([r[f"error_{name}"] for r in measured]) for name in ("allocated", "reserved", "device")
             if all(f"error_{name}" in r for r in measured)}
    details.update(stats)
    text = f"{len(measured)} of {planned} cases; " + "; ".join(
        f"vs {name}: median {s['median']:.2%}, worst {s['worst_signed']:+.2%}" for name, s in stats.items())
    failed = [r for r in rows if "error" in r]
    if failed:
        text += f"; {len(failed)} failed to run"
    if running:
        return CheckResult("published", None, "running: " + text, details)
    allocated, reserved = stats["allocated"], stats.get("reserved")
    passed = (len(measured) == planned and allocated["median"] <= GOALS["prediction_median"]
              and allocated["worst"] <= GOALS["prediction_worst"]
              and (reserved is None or reserved["worst"] <= GOALS["reserved_worst"]))
    return CheckResult("published", passed, text, details)


def check_published(ctx: Context) -> CheckResult:
    """The three published configurations, scaled to the card, in :data:`PUBLISHED`'s order (the 7B one
    last: the longest); a case that fails is a row saying why, the others still run; what the time left
    cannot hold is dropped and listed."""
    cases = published_cases(ctx.probe.total_memory(), ctx.quick)
    rows, _ = measured_rows(
        ctx, "published", cases, lambda case: measure(case, ctx),
        lambda case, exc: {"case": case.key, "error": f"{type(exc).__name__}: {str(exc)[:300]}"},
        lambda rows: ctx.results.publish(published_result(rows, len(cases), running=True)),
        lambda dropped: ", ".join(case.key for case in dropped), "case")
    if not ctx.cuda:
        for what in ("reserved", "mem_get_info"):
            ctx.skip("published", f"predicted vs measured {what}", CUDA_ONLY[what])
    return published_result(rows, len(cases), running=False)
