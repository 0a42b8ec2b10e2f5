"""Accuracy of ``estimate(..., lora=LoraSpec(...))`` against real LoRA fine-tunes with the Trainer.

The estimate is made from the base *config* and a :class:`~hf_memwatch.estimation.peft.LoraSpec`
(what ``hf-memwatch estimate MODEL --lora-r R`` does); the truth is PyTorch's CPU allocator
accounting (profiler memory events) of ``Trainer.train()`` on the real ``PeftModel`` built with the
same ``LoraConfig`` (2 optimizer steps). Two architectures (Mistral: separate projections, GQA;
GPT-NeoX: fused QKV, partial rotary), fp32/bf16, checkpointing on/off, attention-only and
all-linear targets.

QLoRA cases: the truth model is saved, loaded back through ``BitsAndBytesConfig`` (bitsandbytes
quantizes on the CPU), prepared by ``peft.prepare_model_for_kbit_training`` and given the same
LoRA; the estimate is from the config with the matching ``QuantSpec``.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/peft_accuracy.py`` (about 4 minutes on 2 cores); the
markdown report goes to stdout and to ``benchmarks/results/peft_accuracy.md``.
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import peft
import torch
import transformers
from peft import get_peft_model

from hf_memwatch.estimation.estimate import estimate
from hf_memwatch.estimation.fake_model import auto_class
from hf_memwatch.estimation.peft import LoraSpec
from hf_memwatch.estimation.quantized import QuantSpec
from hf_memwatch.testing.estimate_truth import trainer_peak
from hf_memwatch.testing.families import FAMILIES, build_family_model

RESULTS = Path(__file__).parent / "results" / "peft_accuracy.md"
TARGETS = {"mistral": ("q_proj", "v_proj"), "gpt_neox": ("query_key_value",)}
CASES = [
    dict(batch_size=4, seq_len=128, precision="fp32", checkpointing=False, targets="attention", r=8),
    dict(batch_size=8, seq_len=256, precision="bf16", checkpointing=False, targets="all-linear", r=16),
    dict(batch_size=4, seq_len=256, precision="bf16", checkpointing=True, targets="attention", r=8),
    dict(batch_size=8, seq_len=128, precision="fp32", checkpointing=True, targets="all-linear", r=4),
]

# QLoRA: the base quantized as BitsAndBytesConfig loads it
QUANTIZED = [
    dict(batch_size=4, seq_len=128, precision="fp32", checkpointing=False, targets="attention", r=8,
         quant=QuantSpec(bits=4, quant_type="nf4")),
    dict(batch_size=8, seq_len=256, precision="bf16", checkpointing=True, targets="all-linear", r=16,
         quant=QuantSpec(bits=4, quant_type="nf4", double_quant=True)),
    dict(batch_size=4, seq_len=256, precision="bf16", checkpointing=False, targets="all-linear", r=8,
         quant=QuantSpec(bits=4, quant_type="fp4", compute_dtype="bf16")),
    dict(batch_size=4, seq_len=128, precision="fp32", checkpointing=False, targets="all-linear", r=8,
         quant=QuantSpec(bits=8)),
]


def quantized_peft_model(family: str, quant: QuantSpec, spec: LoraSpec, task: str) -> torch.nn.Module:
    """The QLoRA model as a user builds it: saved base, loaded quantized, prepared, LoRA applied."""
    from peft import prepare_model_for_kbit_training

    with tempfile.TemporaryDirectory() as tmp:
        build_family_model(family).save_pretrained(tmp)
        base = auto_class(task).from_pretrained(tmp, quantization_config=quant.bnb_config(), device_map="cpu")
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    return get_peft_model(base, spec.peft_config(task))


def describe_quant(quant: QuantSpec) -> str:
    if quant.bits == 8:
        return "8-bit"
    return (f"4-bit {quant.quant_type}{' +dq' if quant.double_quant else ''}"
            f"{' compute ' + quant.compute_dtype if quant.compute_dtype != 'fp32' else ''}")


def measure(family: str, case: dict[str, Any]) -> dict[str, Any]:
    """One case: the estimate, the profiler's truth, their error, and the error of the estimate without
    what the case adds (LoRA rows: the full fine-tune; QLoRA rows: the unquantized base)."""
    task, make_config = FAMILIES[family]
    targets = "all-linear" if case["targets"] == "all-linear" else TARGETS[family]
    spec = LoraSpec(r=case["r"], alpha=2 * case["r"], targets=targets)
    kwargs = dict(micro_batch_size=case["batch_size"], seq_len=case["seq_len"], precision=case["precision"],
                  activation_checkpointing=case["checkpointing"])
    quant = case.get("quant")
    predicted = estimate(make_config(), task=task, lora=spec, quantization=quant, **kwargs)
    other = estimate(make_config(), task=task, lora=spec if quant else None, **kwargs)
    if quant is None:
        model = get_peft_model(build_family_model(family), spec.peft_config(task))
    else:
        model = quantized_peft_model(family, quant, spec, task)
    truth = trainer_peak(model, task=task, **kwargs)
    del model
    gc.collect()
    return {"predicted": predicted, "truth": truth, "error": (predicted.peak_bytes - truth) / truth,
            "other_error": (other.peak_bytes - truth) / truth,
            "lora": f"r={case['r']} {'all-linear' if targets == 'all-linear' else ','.join(targets)}"}


LORA_HEADER = ("| model | batch | seq | precision | ckpt | LoRA | trainable params | truth (bytes) | estimate (bytes) "
               "| error | full fine-tune estimate |", "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|")
QLORA_HEADER = ("| model | base | batch | seq | precision | ckpt | LoRA | truth (bytes) | estimate (bytes) | error "
                "| weights (est.) | unquantized LoRA estimate |", "|---|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|")


def lora_row(family: str, case: dict[str, Any], m: dict[str, Any]) -> str:
    return (f"| {family} | {case['batch_size']} | {case['seq_len']} | {case['precision']} | "
            f"{'on' if case['checkpointing'] else 'off'} | {m['lora']} | {m['predicted'].trainable_params:,} | "
            f"{m['truth']:,} | {m['predicted'].peak_bytes:,} | {100 * m['error']:+.3f}% | "
            f"{100 * m['other_error']:+.1f}% |")


def qlora_row(family: str, case: dict[str, Any], m: dict[str, Any]) -> str:
    return (f"| {family} | {describe_quant(case['quant'])} | {case['batch_size']} | {case['seq_len']} | "
            f"{case['precision']} | {'on' if case['checkpointing'] else 'off'} | {m['lora']} | {m['truth']:,} | "
            f"{m['predicted'].peak_bytes:,} | {100 * m['error']:+.3f}% | {m['predicted'].classes['weights']:,} | "
            f"{100 * m['other_error']:+.1f}% |")


def run_cases(cases: list[dict[str, Any]], lines: list[str], row: Callable[..., str]) -> list[float]:
    """Measure every case on every architecture, append its table row to ``lines``; the absolute errors."""
    errors = []
    for family in TARGETS:
        for case in cases:
            m = measure(family, case)
            errors.append(abs(m["error"]))
            lines.append(row(family, case, m))
            print(lines[-1], file=sys.stderr, flush=True)
    return errors


def main() -> None:
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # the optional CPU kernel package's notice
    torch.set_num_threads(min(2, torch.get_num_threads()))
    started = time.perf_counter()
    lines, quant_lines = list(LORA_HEADER), list(QLORA_HEADER)
    errors = run_cases(CASES, lines, lora_row)
    quant_errors = run_cases(QUANTIZED, quant_lines, qlora_row)
    report = [
        "# hf-memwatch estimate with PEFT (LoRA): accuracy",
        "",
        f"Generated by `benchmarks/peft_accuracy.py` (torch {torch.__version__}, transformers "
        f"{transformers.__version__}, peft {peft.__version__}, {os.cpu_count()} CPUs) in "
        f"{time.perf_counter() - started:.0f} s. Estimate from the base config + `LoraSpec`; truth from the "
        "profiler's CPU memory events of a real `Trainer.train()` (2 steps) on the `PeftModel`.",
        "",
        f"{len(errors)} cases over {len(TARGETS)} architectures. Peak error, absolute relative: "
        f"**median {100 * statistics.median(errors):.3f}%, worst {100 * max(errors):.3f}%**. The last column is "
        "the full fine-tune estimate against the same LoRA truth (what the CLI said before `--lora-r`).",
        "",
        *lines,
        "",
        "## QLoRA: a bitsandbytes-quantized base (`--load-in-4bit` / `--load-in-8bit`)",
        "",
        f"{len(quant_errors)} cases over {len(TARGETS)} architectures. The truth model is saved, loaded back "
        "through `BitsAndBytesConfig` (bitsandbytes quantizes on the CPU), prepared by "
        "`prepare_model_for_kbit_training` and given the LoRA; the estimate is from the config with the "
        "matching `QuantSpec`. Peak error, absolute relative: "
        f"**median {100 * statistics.median(quant_errors):.3f}%, worst {100 * max(quant_errors):.3f}%**. "
        "The last column is the LoRA estimate with an unquantized base against the same truth.",
        "",
        *quant_lines,
        "",
    ]
    text = "\n".join(report)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
