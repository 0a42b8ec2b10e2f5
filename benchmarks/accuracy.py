"""Accuracy and speed of ``hf_memwatch.estimation.estimate`` — the numbers behind docs/estimate.md.

1. Accuracy: a zoo of small real models (random weights) crossed with batch sizes 1-16, sequence
   lengths 64-512, fp32/bf16, checkpointing on/off and adamw_torch / adamw_bnb_8bit / sgd; then
   every other decoder/encoder family of :mod:`hf_memwatch.testing.families` (GPT-NeoX, Phi-3,
   Falcon, Gemma 1-3, BLOOM, Mixtral, Qwen2-MoE, DistilBERT, ALBERT, DeBERTa-v2, ...) at three
   settings each (2 x 64 fp32; 8 x 256 bf16; 4 x 128 with checkpointing). Truth is
   PyTorch's own CPU allocator accounting of a real ``Trainer.train()`` of 2 optimizer steps
   (profiler memory events: model bytes before ``train()`` + highest running sum of deltas, see
   :mod:`hf_memwatch.testing.truth`). The bytes-per-parameter rule most calculators apply is shown beside.
2. Scale: a Qwen3-4B-shaped and a Llama-3-8B-shaped config, each in a fresh process (wall time of
   the ``estimate()`` call and of the whole process including imports, peak RSS).
3. The Transformers memory guide's "4B parameters, batch 16, mixed precision: about 85 GB".

Run: ``HF_HUB_OFFLINE=1 python benchmarks/accuracy.py`` (about 10 minutes on 2 cores); the
markdown report goes to stdout and to ``benchmarks/results/accuracy.md``.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers
from transformers import (
    BartConfig,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    Qwen3Config,
    RobertaConfig,
    T5Config,
)

from hf_memwatch.estimation.estimate import estimate
from hf_memwatch.estimation.fake_model import auto_class
from hf_memwatch.testing.estimate_truth import trainer_peak
from hf_memwatch.testing.families import FAMILIES, NO_CHECKPOINTING, build_family_model

RESULTS = Path(__file__).parent / "results" / "accuracy.md"
SPECIAL = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
ZOO = {
    "bert (seq-cls)": ("seq-cls", lambda: BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=256, vocab_size=1000, pad_token_id=0)),
    "roberta (masked-lm)": ("masked-lm", lambda: RobertaConfig(hidden_size=128, num_hidden_layers=2,
                                                               num_attention_heads=4, intermediate_size=256,
                                                               vocab_size=1000, max_position_embeddings=520,
                                                               **SPECIAL)),
    "gpt2 (causal-lm)": ("causal-lm", lambda: GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000,
                                                         n_positions=512, bos_token_id=0, eos_token_id=0)),
    "llama (causal-lm)": ("causal-lm", lambda: LlamaConfig(hidden_size=128, intermediate_size=256,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           num_key_value_heads=2, vocab_size=1000, **SPECIAL)),
    "qwen3 (causal-lm)": ("causal-lm", lambda: Qwen3Config(hidden_size=128, intermediate_size=256,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           num_key_value_heads=2, head_dim=32, vocab_size=1000,
                                                           **SPECIAL)),
    "bart (seq2seq)": ("seq2seq", lambda: BartConfig(d_model=64, encoder_layers=2, decoder_layers=2,
                                                     encoder_attention_heads=4, decoder_attention_heads=4,
                                                     encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=1000,
                                                     max_position_embeddings=1024, decoder_start_token_id=2,
                                                     **SPECIAL)),
    "t5 (seq2seq)": ("seq2seq", lambda: T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                                                 vocab_size=1000, decoder_start_token_id=0, pad_token_id=0,
                                                 eos_token_id=1)),
}
BATCHES = (1, 2, 4, 8, 16)
SEQ_LENS = (64, 128, 256, 512)
OPTIMS = ("adamw_torch", "adamw_bnb_8bit", "sgd")
CASES_PER_MODEL = 5

QWEN3_4B = dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True)
LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256)


def cases() -> list[dict]:
    """Each model gets CASES_PER_MODEL settings; offsets make the zoo cover every axis."""
    rows = []
    for offset, (name, (task, _)) in enumerate(ZOO.items()):
        for i in range(CASES_PER_MODEL):
            k = i + offset
            seq_len = SEQ_LENS[(i + 2 * offset) % len(SEQ_LENS)]
            rows.append(dict(
                name=name, task=task, batch_size=BATCHES[k % len(BATCHES)], seq_len=seq_len,
                precision=("fp32", "bf16")[k % 2], checkpointing=bool((i // 2 + offset) % 2),
                optim=OPTIMS[k % len(OPTIMS)], target_len=min(seq_len, 128) if task == "seq2seq" else None,
            ))
    return rows


def bytes_per_param_rule(params: int, optim: str, precision: str) -> int:
    """The rule of `accelerate estimate-memory` and most calculators: no activations at all.

    fp32 weights 4 + gradients 4 + Adam states 8 (8-bit Adam 2, plain SGD 0) + a half-precision copy
    2 under mixed precision: 16-18 B/param for Adam.
    """
    states = {"adamw_torch": 8, "adamw_bnb_8bit": 2, "sgd": 0}[optim]
    return params * (4 + 4 + states + (2 if precision != "fp32" else 0))


TABLE_HEAD = [
    "| model | batch | seq | precision | ckpt | optim | truth (bytes) | estimate (bytes) | error | "
    "bytes/param rule | rule error | estimate time |",
    "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
]


def measure(model: torch.nn.Module, case: dict) -> tuple[str, float, float]:
    """One case: (table row, signed estimate error, signed rule error) against the real Trainer."""
    task = case["task"]
    kwargs = dict(micro_batch_size=case["batch_size"], seq_len=case["seq_len"], precision=case["precision"],
                  activation_checkpointing=case["checkpointing"], optim=case["optim"])
    start = time.perf_counter()
    predicted = estimate(model, task=task, seq2seq_target_len=case["target_len"], **kwargs)
    elapsed = time.perf_counter() - start
    truth = trainer_peak(model, task=task, target_len=case["target_len"], **kwargs)
    rule = bytes_per_param_rule(predicted.params, case["optim"], case["precision"])
    error, rule_error = (predicted.peak_bytes - truth) / truth, (rule - truth) / truth
    row = (f"| {case['name']} | {case['batch_size']} | {case['seq_len']} | {case['precision']} | "
           f"{'on' if case['checkpointing'] else 'off'} | {case['optim']} | {truth:,} | {predicted.peak_bytes:,} | "
           f"{100 * error:+.3f}% | {rule:,} | {100 * rule_error:+.1f}% | {elapsed:.2f} s |")
    print(row, file=sys.stderr, flush=True)
    return row, error, rule_error


def run_accuracy() -> tuple[list[str], list[float], list[float]]:
    lines = list(TABLE_HEAD)
    ours, rule_errors = [], []
    for case in cases():
        task, factory = ZOO[case["name"]]
        torch.manual_seed(0)
        model = auto_class(task).from_config(factory())
        row, error, rule_error = measure(model, case)
        lines.append(row)
        ours.append(abs(error))
        rule_errors.append(abs(rule_error))
        del model
        gc.collect()
    return lines, ours, rule_errors


def family_cases() -> list[dict]:
    """Three settings per family: small fp32; 8 x 256 bf16 (optimizer rotating); checkpointing on."""
    rows = []
    for offset, (name, (task, _)) in enumerate(FAMILIES.items()):
        base = dict(name=name, task=task, target_len=None)
        rows += [
            dict(base, batch_size=2, seq_len=64, precision="fp32", checkpointing=False, optim="adamw_torch"),
            dict(base, batch_size=8, seq_len=256, precision="bf16", checkpointing=False,
                 optim=OPTIMS[offset % len(OPTIMS)]),
            dict(base, batch_size=4, seq_len=128, precision=("fp32", "bf16")[offset % 2],
                 checkpointing=name not in NO_CHECKPOINTING, optim="adamw_torch"),
        ]
    return rows


def run_families() -> tuple[list[str], list[str], list[float]]:
    """Per-case rows, a per-family summary (median |error|, worst signed error) and all |errors|."""
    lines = list(TABLE_HEAD)
    errors: dict[str, list[float]] = {}
    for case in family_cases():
        model = build_family_model(case["name"])
        row, error, _ = measure(model, case)
        lines.append(row)
        errors.setdefault(case["name"], []).append(error)
        del model
        gc.collect()
    summary = ["| family | task | cases | median abs. error | worst error |", "|---|---|---:|---:|---:|"]
    for name, errs in errors.items():
        worst = max(errs, key=abs)
        summary.append(f"| {name} | {FAMILIES[name][0]} | {len(errs)} | "
                       f"{100 * statistics.median(abs(e) for e in errs):.3f}% | {100 * worst:+.3f}% |")
    return lines, summary, [abs(e) for errs in errors.values() for e in errs]


SCALE_SCRIPT = """
import json, resource, sys, time
start = time.perf_counter()
from transformers import {cls}
from hf_memwatch.estimation.estimate import estimate
imported = time.perf_counter()
config = {cls}(**json.loads(sys.argv[1]))
kwargs = json.loads(sys.argv[2])
t0 = time.perf_counter()
result = estimate(config, **kwargs)
t1 = time.perf_counter()
print(json.dumps(dict(peak=result.peak_bytes, phase=result.peak_phase, classes=result.classes, params=result.params,
                      notes=result.notes, call_s=t1 - t0, imports_s=imported - start, process_s=t1 - start,
                      rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)))
"""


def scale_case(cls: str, config: dict, **kwargs) -> dict:
    """One estimate in a fresh Python process: wall times and peak RSS of that process."""
    wall = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", SCALE_SCRIPT.format(cls=cls), json.dumps(config), json.dumps(kwargs)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    data["wall_s"] = time.perf_counter() - wall
    return data


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def run_scale() -> list[str]:
    lines = ["| config | setting | peak | phase | estimate() call | process incl. imports | peak RSS | notes |",
             "|---|---|---:|---|---:|---:|---:|---|"]
    runs = [
        ("Qwen3-4B shape", "Qwen3Config", QWEN3_4B, dict(micro_batch_size=16, seq_len=256), "batch 16 x 256, fp32, AdamW"),
        ("Qwen3-4B shape, full simulation", "Qwen3Config", QWEN3_4B,
         dict(micro_batch_size=16, seq_len=256, extrapolate_layers=False), "batch 16 x 256, fp32, AdamW, all 36 layers"),
        ("Llama-3-8B shape", "LlamaConfig", LLAMA3_8B, dict(micro_batch_size=8, seq_len=2048, precision="bf16"),
         "batch 8 x 2048, bf16, AdamW"),
    ]
    for label, cls, config, kwargs, setting in runs:
        data = scale_case(cls, config, **kwargs)
        lines.append(f"| {label} | {setting} | {data['peak']:,} B ({gib(data['peak'])}) | {data['phase']} | "
                     f"{data['call_s']:.1f} s | {data['process_s']:.1f} s | {gib(data['rss'])} | "
                     f"{'; '.join(data['notes']) or '-'} |")
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def run_guide() -> list[str]:
    """The memory guide's 4B / batch 16 / mixed precision figure, at three sequence lengths."""
    config = Qwen3Config(**QWEN3_4B)
    lines = ["| seq | precision | peak (GB) | weights | gradients | optimizer states | activations | temporaries |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    bf16 = {}
    for precision in ("bf16", "fp32"):
        for seq_len in (128, 256, 512):
            result = estimate(config, micro_batch_size=16, seq_len=seq_len, precision=precision)
            c = result.classes
            if precision == "bf16":
                bf16[seq_len] = result
            lines.append(f"| {seq_len} | {precision} | {result.peak_bytes / 1e9:.1f} | {c['weights'] / 1e9:.1f} | "
                         f"{c['gradients'] / 1e9:.1f} | {c['optimizer_states'] / 1e9:.1f} | "
                         f"{c['activations'] / 1e9:.1f} | {c['temporaries'] / 1e9:.1f} |")
    (s1, e1), (s2, e2) = sorted(bf16.items())[:2]
    crossing = s1 + (85e9 - e1.peak_bytes) * (s2 - s1) / (e2.peak_bytes - e1.peak_bytes)
    params = e1.params
    guide_states = 18 * params
    per_token = (e1.classes["activations"] + e1.classes["temporaries"]) / s1
    guide_tokens = (85e9 - guide_states) / per_token
    lines += [
        "",
        f"params: {params:,}. This estimate (bf16 mixed precision as the Trainer runs it) crosses 85 GB at about "
        f"{crossing:.0f} tokens per sample (linear between {s1} and {s2}).",
        f"The guide's assumption — 18 B/param (fp32 weights 4 + half-precision copy 2 + fp32 gradients 4 + Adam 8) "
        f"all held at once = {guide_states / 1e9:.1f} GB, plus activations — gives 85 GB with "
        f"{(85e9 - guide_states) / 1e9:.1f} GB of activations, which at this estimate's {s1}-token rate "
        f"({per_token / 1e6:.0f} MB per unit of sequence length at batch 16) is about {guide_tokens:.0f} tokens per sample.",
    ]
    return lines


def main() -> None:
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    started = time.perf_counter()
    accuracy, ours, rule = run_accuracy()
    family_rows, family_summary, family_errors = run_families()
    scale = run_scale()
    guide = run_guide()
    report = [
        "# hf-memwatch estimate: accuracy and speed",
        "",
        f"Generated by `benchmarks/accuracy.py` (torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{os.cpu_count()} CPUs) in {time.perf_counter() - started:.0f} s.",
        "",
        "## Accuracy against a real Trainer run (2 optimizer steps, CPU, profiler memory events)",
        "",
        f"{len(ours)} cases over {len(ZOO)} architectures. Peak error, absolute relative: "
        f"**median {100 * statistics.median(ours):.3f}%, worst {100 * max(ours):.3f}%**. "
        f"Bytes-per-parameter rule on the same cases: median {100 * statistics.median(rule):.1f}%, "
        f"worst {100 * max(rule):.1f}%.",
        "",
        *accuracy,
        "",
        "## Every other architecture family (hf_memwatch.testing.families)",
        "",
        f"{len(family_errors)} cases over {len(FAMILIES)} more families (hidden 64, 2 layers, vocabulary 1000). "
        f"Peak error, absolute relative: **median {100 * statistics.median(family_errors):.3f}%, "
        f"worst {100 * max(family_errors):.3f}%**.",
        "",
        *family_summary,
        "",
        *family_rows,
        "",
        "## Scale (each in a fresh process on this machine)",
        "",
        *scale,
        "",
        "## The memory guide's 4B model at batch 16 (Qwen3-4B shape)",
        "",
        *guide,
        "",
    ]
    text = "\n".join(report)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
