"""Accuracy of the evaluation-loop estimate (``estimate_eval``) against real ``Trainer.evaluate()`` runs.

Small real models (random weights) of five architectures crossed with eval batch sizes, sequence
lengths, dataset sizes, ``eval_accumulation_steps``, ``prediction_loss_only`` and bf16. Truth is
PyTorch's own CPU allocator accounting of one ``trainer.evaluate()`` with ``compute_metrics`` set
(so logits and labels are gathered), from the profiler's memory events
(:func:`hf_memwatch.testing.estimate_truth.evaluate_peak`).

Run: ``HF_HUB_OFFLINE=1 python benchmarks/eval_accuracy.py`` (a few minutes on 2 cores); the markdown
report goes to stdout and to ``benchmarks/results/eval_accuracy.md``.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    BartConfig,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    RobertaConfig,
)

from hf_memwatch.estimation.estimate import auto_class, estimate_eval  # noqa: E402
from hf_memwatch.testing.estimate_truth import evaluate_peak  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "eval_accuracy.md"
SPECIAL = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
ZOO = {
    "gpt2 (causal-lm)": ("causal-lm", lambda: GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000,
                                                         n_positions=512, bos_token_id=0, eos_token_id=0)),
    "llama (causal-lm)": ("causal-lm", lambda: LlamaConfig(hidden_size=64, intermediate_size=128,
                                                           num_hidden_layers=2, num_attention_heads=4,
                                                           num_key_value_heads=2, vocab_size=1000, **SPECIAL)),
    "bert (seq-cls)": ("seq-cls", lambda: BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=128, vocab_size=1000, pad_token_id=0)),
    "roberta (masked-lm)": ("masked-lm", lambda: RobertaConfig(hidden_size=64, num_hidden_layers=2,
                                                               num_attention_heads=4, intermediate_size=128,
                                                               vocab_size=1000, max_position_embeddings=520,
                                                               **SPECIAL)),
    "bart (seq2seq)": ("seq2seq", lambda: BartConfig(d_model=64, encoder_layers=2, decoder_layers=2,
                                                     encoder_attention_heads=4, decoder_attention_heads=4,
                                                     encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=1000,
                                                     max_position_embeddings=1024, decoder_start_token_id=2,
                                                     **SPECIAL)),
}
# (eval batch, seq len, samples, eval_accumulation_steps, prediction_loss_only, precision)
SETTINGS = (
    (64, 32, 256, None, False, "fp32"),
    (16, 64, 100, None, False, "fp32"),
    (8, 128, 64, 3, False, "fp32"),
    (32, 64, 96, None, True, "fp32"),
    (16, 32, 80, 2, False, "bf16"),
    (8, 32, 1000, 10, False, "fp32"),  # 125 batches: all but 6 fast-forwarded
    (4, 32, 640, None, False, "fp32"),  # 160 batches
)


def run() -> tuple[list[str], list[float]]:
    lines = [
        "| model | eval batch | seq | samples | eval_accumulation_steps | prediction_loss_only | precision | "
        "truth (bytes) | estimate (bytes) | error | peak phase | estimate time |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---|---:|",
    ]
    errors = []
    for name, (task, factory) in ZOO.items():
        for batch, seq_len, samples, steps, loss_only, precision in SETTINGS:
            torch.manual_seed(0)
            model = auto_class(task).from_config(factory())
            target_len = min(seq_len, 32) if task == "seq2seq" else None
            kwargs = dict(task=task, prediction_loss_only=loss_only, precision=precision)
            start = time.perf_counter()
            predicted = estimate_eval(model, eval_batch_size=batch, eval_samples=samples, seq_len=seq_len,
                                      eval_accumulation_steps=steps, seq2seq_target_len=target_len, **kwargs)
            elapsed = time.perf_counter() - start
            truth = evaluate_peak(model, batch_size=batch, samples=samples, seq_len=seq_len, target_len=target_len,
                                  accumulation_steps=steps, **kwargs)
            error = (predicted.peak_bytes - truth) / truth
            errors.append(abs(error))
            lines.append(
                f"| {name} | {batch} | {seq_len} | {samples} | {steps or '-'} | {'yes' if loss_only else 'no'} | "
                f"{precision} | {truth:,} | {predicted.peak_bytes:,} | {100 * error:+.3f}% | "
                f"{predicted.peak_phase} | {elapsed:.2f} s |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
            del model
            gc.collect()
    return lines, errors


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    lines, errors = run()
    summary = (f"**{len(errors)} cases, {len(ZOO)} architectures: median error "
               f"{100 * statistics.median(errors):.4f}%, worst {100 * max(errors):.4f}%** (|estimate − truth| / truth)")
    report = "\n".join([
        "# Evaluation-loop estimate vs real `Trainer.evaluate()` (CPU, profiler truth)",
        "",
        "`python benchmarks/eval_accuracy.py`; truth: `hf_memwatch.testing.estimate_truth.evaluate_peak` "
        "(`compute_metrics` set, so logits and labels are gathered; no optimizer state: no training ran). "
        "Estimate: `hf_memwatch.estimation.estimate_eval` (fake tensors, nothing allocated).",
        "",
        summary,
        "",
        *lines,
        "",
    ])
    RESULTS.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
