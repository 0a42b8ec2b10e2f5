"""Accuracy of the evaluation-loop estimate (``estimate_eval``) against real ``Trainer.evaluate()`` runs.

Small real models (random weights) of five architectures crossed with eval batch sizes, sequence
lengths, dataset sizes, ``eval_accumulation_steps``, ``prediction_loss_only`` and bf16. Truth is
PyTorch's own CPU allocator accounting of one ``trainer.evaluate()`` with ``compute_metrics`` set
(so logits and labels are gathered), from the profiler's memory events
(:func:`hf_memwatch.testing.estimate_truth.evaluate_peak`).

A second section measures generation-based prediction: ``Seq2SeqTrainer.evaluate()`` with
``predict_with_generate`` (greedy and beam search) on encoder-decoder (BART, T5) and decoder-only
(GPT-2, Llama) models. Each real run generates to ``generation_max_length`` — the model's
``eos_token_id`` is unset for it and the prompts hold no pad token — which is the worst case the
estimate models.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/eval_accuracy.py`` (a few minutes on 2 cores); the markdown
report goes to stdout and to ``benchmarks/results/eval_accuracy.md``. ``--generate-only`` measures
the generation section alone and keeps the first section of the existing report as it is.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    BartConfig,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    RobertaConfig,
    T5Config,
)

from hf_memwatch.estimation.estimate import estimate_eval  # noqa: E402
from hf_memwatch.estimation.fake_model import auto_class  # noqa: E402
from hf_memwatch.estimation.generation import GenerationSettings  # noqa: E402
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
GENERATE_ZOO = {
    "bart (seq2seq)": ZOO["bart (seq2seq)"],
    "t5 (seq2seq)": ("seq2seq", lambda: T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                                 vocab_size=1000, decoder_start_token_id=0, pad_token_id=0,
                                                 eos_token_id=1)),
    # Seq2SeqTrainer pads the generated tokens and labels with the config's pad_token_id: GPT-2 gets one
    "gpt2 (causal-lm)": ("causal-lm", lambda: GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000,
                                                         n_positions=512, **SPECIAL)),
    "llama (causal-lm)": ZOO["llama (causal-lm)"],
}
# (eval batch, seq len (prompt), samples, eval_accumulation_steps, generation_max_length, generation_num_beams)
GENERATE_SETTINGS = (
    (8, 16, 32, None, 24, 1),
    (8, 16, 32, None, 24, 3),
    (16, 8, 48, None, 40, 1),
    (4, 16, 20, 2, 32, 2),
    (2, 24, 10, None, 64, 4),
)
GENERATE_TARGET_LEN = 16  # labels of the seq2seq rows (and the loss forward's decoder length)
GENERATE_HEADER = "## Generation-based prediction (`Seq2SeqTrainer`, `predict_with_generate`)"


def _measure(task: str, factory: Any, estimate_kwargs: dict[str, Any], truth_kwargs: dict[str, Any],
             cells: str, lines: list[str], errors: list[float]) -> None:
    """One case: estimate (timed) and profiler truth on a fresh random-weight model; its row appended."""
    torch.manual_seed(0)
    model = auto_class(task).from_config(factory())
    start = time.perf_counter()
    predicted = estimate_eval(model, task=task, **estimate_kwargs)
    elapsed = time.perf_counter() - start
    truth = evaluate_peak(model, task=task, **truth_kwargs)
    error = (predicted.peak_bytes - truth) / truth
    errors.append(abs(error))
    lines.append(f"| {cells} | {truth:,} | {predicted.peak_bytes:,} | {100 * error:+.3f}% | "
                 f"{predicted.peak_phase} | {elapsed:.2f} s |")
    print(lines[-1], file=sys.stderr, flush=True)
    del model
    gc.collect()


def _header(settings: str, aligns: str) -> list[str]:
    """A results table's two header lines: the model, ``settings``' columns, then the measured ones."""
    return [f"| model | {settings} | truth (bytes) | estimate (bytes) | error | peak phase | estimate time |",
            f"|---|{aligns}|---:|---:|---:|---|---:|"]


def run() -> tuple[list[str], list[float]]:
    lines = _header("eval batch | seq | samples | eval_accumulation_steps | prediction_loss_only | precision",
                    "---:|---:|---:|---:|---|---")
    errors: list[float] = []
    for name, (task, factory) in ZOO.items():
        for batch, seq_len, samples, steps, loss_only, precision in SETTINGS:
            target_len = min(seq_len, 32) if task == "seq2seq" else None
            common = dict(prediction_loss_only=loss_only, precision=precision)
            _measure(task, factory,
                     dict(eval_batch_size=batch, eval_samples=samples, seq_len=seq_len, eval_accumulation_steps=steps,
                          seq2seq_target_len=target_len, **common),
                     dict(batch_size=batch, samples=samples, seq_len=seq_len, target_len=target_len,
                          accumulation_steps=steps, **common),
                     f"{name} | {batch} | {seq_len} | {samples} | {steps or '-'} | {'yes' if loss_only else 'no'} | "
                     f"{precision}", lines, errors)
    return lines, errors


def run_generate() -> tuple[list[str], list[float]]:
    lines = _header("eval batch | prompt | samples | eval_accumulation_steps | generation_max_length | beams",
                    "---:|---:|---:|---:|---:|---:")
    errors: list[float] = []
    for name, (task, factory) in GENERATE_ZOO.items():
        for batch, seq_len, samples, steps, max_length, beams in GENERATE_SETTINGS:
            _measure(task, factory,
                     dict(eval_batch_size=batch, eval_samples=samples, seq_len=seq_len, eval_accumulation_steps=steps,
                          seq2seq_target_len=GENERATE_TARGET_LEN, predict_with_generate=True,
                          generation_max_length=max_length, generation_num_beams=beams),
                     dict(batch_size=batch, samples=samples, seq_len=seq_len, target_len=GENERATE_TARGET_LEN,
                          accumulation_steps=steps, generation=GenerationSettings(max_length, beams)),
                     f"{name} | {batch} | {seq_len} | {samples} | {steps or '-'} | {max_length} | {beams}",
                     lines, errors)
    return lines, errors


def _summary(errors: list[float], architectures: int) -> str:
    return (f"**{len(errors)} cases, {architectures} architectures: median error "
            f"{100 * statistics.median(errors):.4f}%, worst {100 * max(errors):.4f}%** (|estimate − truth| / truth)")


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    generate_only = "--generate-only" in sys.argv[1:]
    if generate_only:  # the first section as the last full run wrote it
        first = RESULTS.read_text().split(GENERATE_HEADER)[0].rstrip("\n").splitlines()
    else:
        lines, errors = run()
        first = [
            "# Evaluation-loop estimate vs real `Trainer.evaluate()` (CPU, profiler truth)",
            "",
            "`python benchmarks/eval_accuracy.py`; truth: `hf_memwatch.testing.estimate_truth.evaluate_peak` "
            "(`compute_metrics` set, so logits and labels are gathered; no optimizer state: no training ran). "
            "Estimate: `hf_memwatch.estimation.estimate_eval` (fake tensors, nothing allocated).",
            "",
            _summary(errors, len(ZOO)),
            "",
            *lines,
        ]
    generate_lines, generate_errors = run_generate()
    report = "\n".join([
        *first,
        "",
        GENERATE_HEADER,
        "",
        "`Seq2SeqTrainer.evaluate()` with `predict_with_generate`, `generation_max_length`, `generation_num_beams` "
        f"(`compute_metrics` set; seq2seq labels of {GENERATE_TARGET_LEN} tokens, decoder-only labels as long as the "
        "prompt). Every real run generates to `generation_max_length`: the model's `eos_token_id` is unset for it and "
        "the prompts hold no pad token — the worst case the estimate models (no early EOS). Estimate: "
        "`estimate_eval(..., predict_with_generate=True, generation_max_length=, generation_num_beams=)`.",
        "",
        _summary(generate_errors, len(GENERATE_ZOO)),
        "",
        *generate_lines,
        "",
    ])
    RESULTS.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
