"""Launched by ``tests/engines/test_distributed.py`` with ``torchrun --nproc-per-node 2`` (gloo, no model).

Usage: ``torchrun --nproc-per-node 2 agreement.py OUT_DIR``. Each rank writes ``agreement.rank<N>.json``
with the outcome of every agreement scenario (the test asserts on them). The suite runs
:func:`scenarios` at the end of ``ddp_trainer.py``'s launch, on its process group (a launch of its own
cost ~12 s, the imports of two ranks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from hf_memwatch.measure.ranks import (
    PeerFailure,
    agree_plan,
    agree_unavailable,
    decide_across_ranks,
    gather_ints,
    max_over_ranks,
    share_failure,
    world,
)


def failing_scenario(rank: int, fail_on: int) -> dict:
    """Rank ``fail_on`` fails before agreeing; every rank must leave the agreement, none waits."""
    try:
        if rank == fail_on:
            error = ValueError("weights alone exceed the budget")
            share_failure(error, fatal=True)
            return {"outcome": "failed here"}
        agree_unavailable({})
        return {"outcome": "agreed"}
    except PeerFailure as exc:
        return {"outcome": "peer failure", "message": str(exc), "fatal": exc.fatal}


def scenarios(out: Path) -> None:
    """Every scenario on the default process group; ``agreement.rank<N>.json`` into ``out``."""
    rank, world_size = world()
    plan = {"micro_batch_size": 8 >> rank, "activation_checkpointing": rank == 1}
    result = {
        "world": [rank, world_size],
        "gather_ints": gather_ints(10 * (rank + 1)),
        "max_over_ranks": max_over_ranks(100 - rank),
        "max_with_none": max_over_ranks(None if rank == 0 else 7),
        # rank 1 must cut 5 bytes, rank 0 fits (negative need): rank 1 decides
        "agree_rank1_needs_more": agree_plan(plan, need_bytes=5 if rank == 1 else -100),
        "agree_rank0_needs_more": agree_plan(plan, need_bytes=5 if rank == 0 else -100),
        "agree_tie": decide_across_ranks(plan, need_bytes=3).__dict__,
        "unavailable": agree_unavailable({"8-bit AdamW": "bitsandbytes missing"} if rank == 1 else {}),
        "failure_rank1": failing_scenario(rank, fail_on=1),
        "after_failure": gather_ints(rank),  # the group still works, in step, after a failure
    }
    (out / f"agreement.rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    dist.init_process_group("gloo")
    scenarios(Path(sys.argv[1]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
