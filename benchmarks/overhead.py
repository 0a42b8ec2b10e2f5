"""CPU time per optimizer step with MemWatch vs without, on a real Trainer run (CPU).

The clock is this process's CPU time (``time.process_time``, one thread, as
``fixed_cost.py`` measures), not wall time: on a shared machine other processes' bursts stretch wall
time (a no-MemWatch step read 2,091 ms in one burst, 160 ms quiet) but not this process's CPU
time. Runs are interleaved (none, default, full, default, full, none, ...) after one warm-up round;
each round gives a ratio per variant (its median step over the same round's no-MemWatch median), and
the table reports the median ratio over rounds with its spread (lowest-highest round). Writes Markdown.

    python benchmarks/overhead.py --out benchmarks/results/overhead.md
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
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_memwatch import MemWatch  # noqa: E402


class StepClock(TrainerCallback):
    """Process CPU time between consecutive step ends: everything a step costs, callbacks included."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.marks:
            self.marks.append(time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append(time.process_time())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=gen)
        self.labels = torch.randint(0, 2, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def run(variant: str, steps: int, batch: int, seq_len: int, workdir: str) -> list[float]:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=512, num_labels=2)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=workdir, per_device_train_batch_size=batch, max_steps=steps,
                             logging_steps=50, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, seed=0)
    clock = StepClock()
    callbacks: list[TrainerCallback] = [clock]
    if variant == "default":
        callbacks.append(MemWatch())
    elif variant == "full":
        callbacks.append(MemWatch(detail="full"))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(steps * batch, seq_len, 8000),
                      callbacks=callbacks)
    trainer.train()
    return clock.step_times()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args()
    # One thread: a second one spin-waits for work under contention, and its spinning is CPU time of
    # this process that no variant did (a no-MemWatch step read 1,200 ms at load 17, spread 0.3-1.1).
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    variants = ("none", "default", "full")
    times: dict[str, list[list[float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(opts.rounds + 1):  # round 0 warms up (imports, allocator, caches)
            order = variants[round_index % 3:] + variants[: round_index % 3]
            for variant in order:
                step_times = run(variant, opts.steps, opts.batch, opts.seq_len, f"{tmp}/{variant}")
                if round_index:
                    times[variant].append(step_times)
    full_steps = MemWatch().full_steps

    def per_round(variant: str, steady: bool) -> list[float]:
        """The variant's ratio to the no-MemWatch run of the same round, one per round."""
        ratios = []
        for mine, base in zip(times[variant], times["none"], strict=True):
            if steady:
                ratios.append(statistics.median(mine[full_steps:]) / statistics.median(base[full_steps:]))
            else:
                ratios.append(sum(mine) / sum(base))
        return ratios

    rows = [
        (f"default, steady state (steps after the first {full_steps} fully tracked)", per_round("default", True)),
        (f"default, whole {opts.steps}-step run ({full_steps} full steps included)", per_round("default", False)),
        ("full tracking every step", per_round("full", True)),
    ]
    base_ms = statistics.median(t for run_times in times["none"] for t in run_times[full_steps:]) * 1000
    lines = [
        "# MemWatch overhead (CPU)",
        "",
        f"BERT 4x256 sequence classification, batch {opts.batch} x {opts.seq_len} tokens, fp32 AdamW, "
        f"{opts.rounds} interleaved rounds x {opts.steps} steps per variant after one warm-up round; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}, "
        f"{os.cpu_count()} CPUs.",
        "Clock: this process's CPU time per step (`time.process_time`, one torch thread), robust to other "
        "processes on a shared machine.",
        f"Median step without MemWatch: {base_ms:.1f} ms of CPU time.",
        "",
        "| variant | CPU time ratio vs no MemWatch (median over rounds) | spread (lowest - highest round) |",
        "|---|---|---|",
        *[f"| {name} | {statistics.median(r):.3f} | {min(r):.3f} - {max(r):.3f} |" for name, r in rows],
        "",
        f"Command: `python benchmarks/overhead.py --rounds {opts.rounds} --steps {opts.steps} "
        f"--batch {opts.batch} --seq-len {opts.seq_len} --out benchmarks/results/overhead.md`",
        "",
    ]
    publish(lines, opts.out)
    return 0


def publish(lines: list[str], out: Path | None) -> None:
    """Print a benchmark's Markdown table and write it to ``out`` (its committed result) when given."""
    text = "\n".join(lines)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
