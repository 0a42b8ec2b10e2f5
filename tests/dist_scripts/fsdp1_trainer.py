"""Launched by ``tests/engines/test_fsdp1.py`` with ``torchrun --nproc-per-node 2``: FSDP1 through the Trainer on gloo.

accelerate builds FSDP for accelerator devices only, and hands FSDP1 a ``device_id`` torch's FSDP1 refuses
on a CPU rank: :func:`hf_memwatch.testing.fsdp_cpu.allow_fsdp1_on_cpu_ranks` flips the one switch and names
the CPU as FSDP1 expects; the rest is accelerate's FSDP1 (``FullyShardedDataParallel``, ``full_shard
auto_wrap`` on every ``GPT2Block``), its gloo all-gathers and reduce-scatters, the Trainer's loop. One run
under the profiler (the reconciled per-step truth, ``hf_memwatch.testing.truth``), with the estimate made on
the Trainer before ``train()``. Each rank writes ``fsdp1.rank<N>.json`` into OUT_DIR (the test decides).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders
sys.path.insert(0, str(Path(__file__).resolve().parent))  # fsdp2_trainer's run helper

from conftest import gpt2_model, token_dataset, training_args  # noqa: E402
from fsdp2_trainer import train  # noqa: E402
from transformers import Trainer  # noqa: E402

from hf_memwatch.testing.fsdp_cpu import allow_fsdp1_on_cpu_ranks  # noqa: E402
from hf_memwatch.testing.truth import StepMarker, cpu_memory_profile  # noqa: E402

FSDP_CONFIG = {"fsdp_version": 1, "sync_module_states": False, "transformer_layer_cls_to_wrap": ["GPT2Block"]}


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    allow_fsdp1_on_cpu_ranks()
    args = training_args(out / "full_shard", max_steps=2, per_device_train_batch_size=4,
                         fsdp="full_shard auto_wrap", fsdp_config=FSDP_CONFIG)
    profiler = cpu_memory_profile()
    profiler.start()  # the truth's window opens before the model is built
    trainer = Trainer(model=gpt2_model(), args=args, train_dataset=token_dataset(32, 64, 1000),
                      callbacks=[StepMarker()])
    facts = train(trainer, profiler, predict=True)
    facts["wrapped"] = type(trainer.model_wrapped).__name__
    (out / f"fsdp1.rank{rank}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
