"""What one ``estimate(trainer)`` costs, in CPU seconds, with and without the device-query shortcut.

Every plan the auto mode weighs is one estimate (a replay of the step on fake tensors), so its cost is
the planning's. C++ code asks a fake tensor its device (``prim.device``) through every dispatch mode on
the stack: 72% of a 2-layer GPT-2 replay's dispatches. :class:`~hf_memwatch.estimation.fake_dispatch.
EstimateTracker` answers it at the top of its mode with the tensor's own answer; the ``without`` variant
sends it down the tracker and ``FakeTensorMode`` as before. Both variants run interleaved in one process,
after one warm-up round, on the same Trainers, and must predict the same bytes.

    python benchmarks/estimate_cost.py --out benchmarks/results/estimate_cost.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the suite's small real models
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from conftest import gpt2_model, token_dataset, training_args  # noqa: E402
from overhead import publish  # noqa: E402
from transformers import Trainer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_memwatch import estimate  # noqa: E402
from hf_memwatch.estimation import fake_dispatch  # noqa: E402


def gpt2_trainer(out: str) -> Trainer:
    args = training_args(out, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    return Trainer(model=gpt2_model(), args=args, train_dataset=token_dataset(16, 128, 1000))


def online_dpo_trainer(out: str) -> Trainer:
    from test_online_dpo import LONG, SHALLOW, online_dpo

    return online_dpo(Path(out), **SHALLOW, **LONG)


# (label, Trainer builder, estimate keywords): a plain step, and a TRL step that generates inside it.
CASES = [
    ("GPT-2 2x128, 4 x 128 tokens, AdamW", gpt2_trainer, {}),
    ("GPT-2 2x128, 8 x 128 tokens, checkpointing, 8-bit AdamW", gpt2_trainer,
     {"micro_batch_size": 8, "activation_checkpointing": True, "optim": "adamw_bnb_8bit"}),
    ("Online DPO, 1-layer Llama, 12 new tokens, checkpointing, 8-bit AdamW", online_dpo_trainer,
     {"activation_checkpointing": True, "optim": "adamw_bnb_8bit"}),
]


@contextlib.contextmanager
def without_shortcut():
    """The device query sent down the modes, as before the shortcut (its operator never matches)."""
    kept = fake_dispatch._DEVICE_QUERY
    fake_dispatch._DEVICE_QUERY = object()
    try:
        yield
    finally:
        fake_dispatch._DEVICE_QUERY = kept


def timed(trainer: Trainer, kwargs: dict, shortcut: bool) -> tuple[float, int]:
    """(CPU seconds, predicted peak bytes) of one estimate."""
    with contextlib.nullcontext() if shortcut else without_shortcut():
        start = time.process_time()
        peak = estimate(trainer, **kwargs).peak_bytes
        return time.process_time() - start, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args()
    hf_logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, (label, build, kwargs) in enumerate(CASES):
            trainer = build(f"{tmp}/{index}")
            seconds: dict[bool, list[float]] = {True: [], False: []}
            peaks = {timed(trainer, kwargs, shortcut)[1] for shortcut in (True, False)}  # warm-up
            for round_index in range(opts.rounds):
                for shortcut in (True, False) if round_index % 2 == 0 else (False, True):
                    cpu, peak = timed(trainer, kwargs, shortcut)
                    seconds[shortcut].append(cpu)
                    peaks.add(peak)
            if len(peaks) != 1:
                raise SystemExit(f"{label}: the variants predicted different peaks {sorted(peaks)}")
            with_s, without_s = statistics.median(seconds[True]), statistics.median(seconds[False])
            rows.append(f"| {label} | {peaks.pop():,} | {without_s:.3f} | {with_s:.3f} | {with_s / without_s:.2f} |")
    lines = [
        "# CPU cost of one estimate (CPU)",
        "",
        f"`estimate(trainer)` medians over {opts.rounds} interleaved rounds after one warm-up, CPU time of "
        f"this process; torch {torch.__version__}, 1 thread, {platform.machine()}, load average "
        f"{os.getloadavg()[0]:.1f} at the end on {os.cpu_count()} CPUs. Both variants predicted the same "
        "bytes in every round (the benchmark stops otherwise).",
        "",
        "| step | predicted peak (B) | CPU s without the shortcut | CPU s with it | ratio |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    publish(lines, opts.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
