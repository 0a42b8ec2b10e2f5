"""What MemWatch adds to one ``Trainer.train()`` call, in seconds, on a small real run (CPU).

The per-step overhead is in ``overhead.py``; this measures the fixed part a hyperparameter search, a
notebook or a CI job pays per ``train()``: setup at train begin, the fully tracked first steps, the
timeline, the summary and the picture at train end. Variants (no MemWatch, ``MemWatch()``,
``MemWatch(detail="light")``, ``MemWatch(auto=True)``) run interleaved in one process, after one warm-up
round, so imports and machine noise hit every variant alike. Writes a Markdown table.

    python benchmarks/fixed_cost.py --out benchmarks/results/fixed_cost.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_memwatch import MemWatch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from overhead import Tokens, publish  # noqa: E402  (the same synthetic batches as the overhead benchmark)

VARIANTS = {
    "none": None,
    "default": {},
    "light": {"detail": "light"},
    "auto": {"auto": True},
}


def one_train(variant: str, steps: int, batch: int, seq_len: int, workdir: str) -> tuple[float, float]:
    """(wall, CPU) seconds of ``trainer.train()`` alone (model and Trainer built before the clocks start)."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=128, num_labels=2)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=workdir, per_device_train_batch_size=batch, max_steps=steps,
                             logging_steps=steps, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, seed=0)
    options = VARIANTS[variant]
    callbacks = [] if options is None else [MemWatch(**options)]
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(steps * batch, seq_len, 1000),
                      callbacks=callbacks)
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer.train()
    return time.perf_counter() - start, time.process_time() - cpu_start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)  # CPU time then equals the work done, whatever else runs on the machine
    names = list(VARIANTS)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:  # warm-up: imports, first-call caches; not counted
            one_train(name, opts.steps, opts.batch, opts.seq_len, f"{tmp}/warm-{name}")
        for round_index in range(opts.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                seconds, cpu_seconds = one_train(name, opts.steps, opts.batch, opts.seq_len, f"{tmp}/{name}")
                wall[name].append(seconds)
                cpu[name].append(cpu_seconds)
    base, cpu_base = statistics.median(wall["none"]), statistics.median(cpu["none"])
    rows = []
    for name in names:
        median, cpu_median = statistics.median(wall[name]), statistics.median(cpu[name])
        label = "no MemWatch" if VARIANTS[name] is None else f"MemWatch({_call(VARIANTS[name])})"
        rows.append(f"| {label} | {cpu_median:.3f} | {cpu_median - cpu_base:+.3f} | {cpu_median / cpu_base:.2f} "
                    f"| {median:.3f} | {median - base:+.3f} |")
    lines = [
        "# Fixed cost of MemWatch per train() (CPU)",
        "",
        f"BERT 2x64 sequence classification, batch {opts.batch} x {opts.seq_len} tokens, {opts.steps} steps, "
        f"fp32 AdamW; {opts.rounds} interleaved rounds after one warm-up round; "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread, {platform.machine()}, "
        f"load average {os.getloadavg()[0]:.1f} at the end on {os.cpu_count()} CPUs. "
        "Medians over rounds of `trainer.train()`: CPU time of this process (robust to other processes "
        "sharing the machine; with one torch thread it is the wall time of an idle machine) and wall time. "
        "The picture is drawn by a background process at idle priority, not counted and not waited for.",
        "",
        "| variant | CPU s | added CPU s | ratio | wall s | added wall s |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    publish(lines, opts.out)
    return 0


def _call(options: dict) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in options.items())


if __name__ == "__main__":
    sys.exit(main())
