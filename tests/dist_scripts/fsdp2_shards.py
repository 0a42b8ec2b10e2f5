"""Launched by ``tests/engines/test_distributed.py`` with ``torchrun --nproc-per-node 2`` (gloo, CPU).

Usage: ``torchrun --nproc-per-node 2 fsdp2_shards.py OUT_DIR``. A model sharded with FSDP2's
``fully_shard`` trains one step under a :class:`~hf_memwatch.measure.monitor.StepMonitor`; each rank writes
``fsdp2.rank<N>.json`` with the full model's bytes and the monitor's figures after the step. The suite
runs :func:`shards` at the end of ``ddp_trainer.py``'s launch, on its process group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from hf_memwatch.measure.backends import backend_for
from hf_memwatch.measure.monitor import StepMonitor


def shards(out: Path) -> None:
    """One FSDP2 step on the default process group; ``fsdp2.rank<N>.json`` into ``out``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    monitor = StepMonitor(backend_for(torch.device("cpu")), writer=None, rank=dist.get_rank())
    monitor.attach(model, optimizer)
    monitor.begin_step(1, full=True)
    model(torch.randn(8, 256)).sum().backward()
    monitor.snapshot("after_backward")
    optimizer.step()
    after_optimizer = monitor.snapshot("after_optimizer")
    monitor.end_step()
    result = {
        "rank": dist.get_rank(),
        "full_bytes": full_bytes,
        "param_type": type(next(model.parameters())).__name__,
        "local_param_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
        "tensors": len(list(model.parameters())),
        "after_optimizer": after_optimizer.to_dict(),  # the typed snapshot, as the timeline writes it
    }
    (out / f"fsdp2.rank{dist.get_rank()}.json").write_text(json.dumps(result))


def main() -> None:
    dist.init_process_group("gloo")
    shards(Path(sys.argv[1]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
