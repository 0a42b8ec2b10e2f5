"""Launched by ``tests/engines/test_zero_half.py`` with ``torchrun --nproc-per-node 2``: DeepSpeed ZeRO-1/2 in bf16.

Usage: ``DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 zero_bf16.py OUT_DIR``. Each rank writes
``zero_bf16.rank<N>.json`` into OUT_DIR (no assertion here: the test decides). Runs (test GPT-2, 32 tokens,
2 steps, the Trainer's ``bf16=True`` with the JSON's ``"bf16": {"enabled": "auto"}``: DeepSpeed casts the
module to bf16 and trains it without autocast), each under the profiler from the model's construction on,
``estimate(trainer)`` made before ``train()`` (no DeepSpeed engine yet; its leftovers taken out):

* ``zero1``, ``zero2``: micro-batch 4 x accumulation 2;
* ``zero2_ckpt``: micro-batch 2 x accumulation 2 with checkpointing (the kept gradient partition of the
  first micro-step lives through the second's backward).

ZeRO-3 in bf16 is left to ``benchmarks/sweep_ranks.py`` (its launch is the slowest here).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders
sys.path.insert(0, str(Path(__file__).resolve().parent))  # deepspeed_zero's helpers
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed picks its accelerator on first use
os.environ.setdefault("DS_BUILD_OPS", "0")

import torch  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from conftest import exit_at_once, freeze_imported_objects, gpt2_model, token_dataset, training_args  # noqa: E402
from deepspeed_zero import BUCKET, without_shm_comm  # noqa: E402
from transformers import Trainer  # noqa: E402

from hf_memwatch import estimate  # noqa: E402
from hf_memwatch.testing.truth import (  # noqa: E402
    StepMarker,
    alive_storages,
    cpu_memory_profile,
    left_alive,
    ops_unrecorded,
    step_peaks,
)

ESTIMATE_MARK = "zero_bf16.estimate"
# name: (ZeRO stage, micro-batch, accumulation, checkpointing)
RUNS = {"zero1": (1, 4, 2, False), "zero2": (2, 4, 2, False), "zero2_ckpt": (2, 2, 2, True)}


def deepspeed_config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": "auto"}}


def run(out: Path, name: str) -> dict:
    """One run of RUNS: the prediction before ``train()`` and the profiler's per-step truth on this rank."""
    stage, batch, accum, checkpointing = RUNS[name]
    args = training_args(out / name, per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
                         gradient_checkpointing=checkpointing, max_steps=2, bf16=True,
                         deepspeed=deepspeed_config(stage))
    dataset = token_dataset(64, 32, 1000)
    # the estimate as a user gets it: its bf16 products' oneDNN blocks are probed with the profiler (which a
    # probe cannot nest) not yet running (estimation/kernel_workspaces.py); the estimate inside reads them
    estimate(Trainer(model=gpt2_model(), args=args, train_dataset=dataset))
    AcceleratorState._reset_state()  # the measured run's Trainer makes its own accelerator, as the sweep's draws do
    profiler = cpu_memory_profile(record_shapes=True)
    profiler.start()
    trainer = Trainer(model=gpt2_model(), args=args, train_dataset=dataset, callbacks=[StepMarker()])
    predicted = ops_unrecorded(profiler, ESTIMATE_MARK)(estimate)(trainer)
    alive = None
    try:
        trainer.train()
    finally:
        profiler.stop()
        alive = alive_storages()
    left = left_alive(profiler, ESTIMATE_MARK)
    module = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
    return {"predicted": predicted.peak_bytes, "notes": predicted.notes, "phase_peaks": predicted.phase_peaks,
            "classes": predicted.classes, "branches": predicted.branches,
            "truth": step_peaks(profiler, -left, reconcile=True, alive=alive),
            "high": step_peaks(profiler, -left, reconcile=True, alive=alive, late=True),
            "param_dtypes": sorted({str(p.dtype) for p in module.parameters()})}


def main() -> None:
    out = Path(sys.argv[1])
    without_shm_comm()
    freeze_imported_objects()  # DeepSpeed imported too
    facts = {name: run(out, name) for name in RUNS}
    rank = torch.distributed.get_rank()
    (out / f"zero_bf16.rank{rank}.json").write_text(json.dumps(facts))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
    exit_at_once()  # conftest: no interpreter finalization after the facts are written
