"""Launched by ``tests/test_distributed.py`` with ``torchrun --nproc-per-node 2``: DeepSpeed ZeRO via the Trainer.

Usage: ``DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 deepspeed_zero.py OUT_DIR``. DeepSpeed's CPU
accelerator falls back to gloo without oneCCL. Each rank writes ``deepspeed.rank<N>.json`` into
OUT_DIR with what DeepSpeed itself holds on that rank (read from its ZeRO optimizer and parameters,
not through hf_memwatch) at the first step's ``step_begin``, first micro-step end (gradient
accumulation 2, so gradients are still held) and ``step_end``; the test compares MemWatch's
timeline of the same run with them. Runs, each in OUT_DIR/<name>: ``zero1``, ``zero2``, ``zero3``
with MemWatch full; ``zero2_plain`` without it (the loss history must not change).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed picks its accelerator on first use

import torch  # noqa: E402
from conftest import gpt2_model, loss_history, token_dataset, training_args  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from hf_memwatch import MemWatch  # noqa: E402

# Small buckets: DeepSpeed's default reduce bucket (5e8 elements) would allocate 2 GB per rank.
BUCKET = 100_000


def deepspeed_config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=BUCKET, stage3_param_persistence_threshold=0)
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "zero_allow_untested_optimizer": True}


def storage_bytes(tensors) -> int:
    """Bytes of the unique storages behind ``tensors`` (nested lists/dicts; None skipped)."""
    unique: dict[int, int] = {}
    stack = [tensors]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            unique[item.untyped_storage().data_ptr()] = item.untyped_storage().nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sum(unique.values())


class DeepSpeedHoldings(TrainerCallback):
    """What the ZeRO optimizer and the parameters hold, by DeepSpeed's own attributes, on step 1."""

    def __init__(self) -> None:
        self.engine = None
        self.records: dict[str, dict] = {}

    def _record(self, point: str, model) -> None:
        zero = self.engine.optimizer
        master = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat
        record = {
            "master_bytes": storage_bytes(master),
            "master_numel": sum(t.numel() for t in master),
            "adam_state_bytes": storage_bytes(list(zero.optimizer.state.values())),
            "adam_state_tensors": sum(1 for s in zero.optimizer.state.values() for v in s.values()
                                      if isinstance(v, torch.Tensor)),
        }
        # Gradients wherever DeepSpeed keeps them: the parameters' .grad (ZeRO-1 keeps them whole
        # between micro-steps), ZeRO-1/2's accumulated partition, ZeRO-3's flat gradient partition,
        # the flat partition the step consumes, and the reduce buckets.
        holders = [[p.grad for p in model.parameters()], [b.buffer for b in zero.ipg_buckets.values()],
                   list(zero.averaged_gradients.values()) if isinstance(zero.averaged_gradients, dict)
                   else zero.averaged_gradients]
        if hasattr(zero, "bit16_groups_flat"):  # ZeRO-1/2: every rank holds the whole model
            record["weight_bytes"] = storage_bytes(zero.bit16_groups_flat)
            holders.append(list(zero.all_grad_tensors.values()))
        else:  # ZeRO-3: each parameter's partition
            record["weight_bytes"] = storage_bytes([p.ds_tensor for p in model.parameters()])
            holders.append(zero.grad_partitions_flat_buffer)
        record["gradient_bytes"] = storage_bytes(holders)
        self.records[point] = record

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from hf_memwatch.integration.callback import find_trainer

        self.engine = find_trainer().model_wrapped

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            self._record("step_begin", model)

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            self._record("after_backward_micro0", model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            self._record("step_end", model)


def run(out: Path, name: str, stage: int, watch: bool) -> dict:
    model = gpt2_model()
    args = training_args(out / name, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         max_steps=2, deepspeed=deepspeed_config(stage))
    holdings = DeepSpeedHoldings()
    callbacks = [MemWatch(detail="full", report=False, summary=False)] if watch else []
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(64, 32, 1000),
                      callbacks=callbacks + [holdings])
    trainer.train()
    return {"losses": loss_history(trainer), "deepspeed": holdings.records,
            "full_param_numel": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())}


def main() -> None:
    out = Path(sys.argv[1])
    facts = {f"zero{stage}": run(out, f"zero{stage}", stage, watch=True) for stage in (1, 2, 3)}
    facts["zero2_plain"] = run(out, "zero2_plain", 2, watch=False)
    rank = torch.distributed.get_rank()
    facts["world"] = [rank, torch.distributed.get_world_size()]
    (out / f"deepspeed.rank{rank}.json").write_text(json.dumps(facts))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
