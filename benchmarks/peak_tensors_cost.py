"""What the peak-tensor census adds to a fully tracked CPU step: process CPU time per step, A/B.

Both variants track every step in full (``MemWatch(detail="full")``); B also keeps the census and
writes ``peak_tensors`` (``top_tensors=20``), A does not (``top_tensors=0``). Runs alternate
(A, B, B, A, ...) in one process and each step is timed in process CPU time (``time.process_time``:
what the step cost this process, whatever else the machine runs), so the ratio of medians is the
census's own cost. Writes a Markdown section.

    python benchmarks/peak_tensors_cost.py --out benchmarks/results/peak_tensors_cost.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import StepClock, Tokens  # noqa: E402

from hf_memwatch import MemWatch  # noqa: E402


def run(top: int, steps: int, batch: int, seq_len: int, workdir: str) -> list[float]:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = BertConfig(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=512, num_labels=2)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=workdir, per_device_train_batch_size=batch, max_steps=steps,
                             logging_steps=50, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, seed=0)
    clock = StepClock()
    watch = MemWatch(detail="full", report=False, summary=False, top_tensors=top)
    Trainer(model=model, args=args, train_dataset=Tokens(steps * batch, seq_len, 8000),
            callbacks=[clock, watch]).train()
    return clock.step_times()[1:]  # the first step warms up


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args()
    hf_logging.set_verbosity_error()
    times: dict[int, list[float]] = {0: [], 20: []}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(opts.rounds):
            order = (0, 20) if index % 4 in (0, 3) else (20, 0)
            for top in order:
                times[top].extend(run(top, opts.steps, opts.batch, opts.seq_len, f"{tmp}/{top}"))
    a, b = statistics.median(times[0]), statistics.median(times[20])
    text = "\n".join([
        "# Peak-tensor census: its cost on a fully tracked CPU step",
        "",
        f"BERT 4x256 sequence classification, batch {opts.batch} x {opts.seq_len} tokens, fp32 AdamW, every step "
        f"tracked in full; {opts.rounds} interleaved rounds x {opts.steps - 1} timed steps per variant; process CPU "
        f"time per step; torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}.",
        "",
        "| variant | median CPU s per step | ratio |",
        "|---|---|---|",
        f"| `MemWatch(detail=\"full\", top_tensors=0)` (no census) | {a:.4f} | 1.000 |",
        f"| `MemWatch(detail=\"full\")` (census, `peak_tensors` of the top 20) | {b:.4f} | {b / a:.3f} |",
        "",
    ])
    print(text)
    if opts.out:
        opts.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
