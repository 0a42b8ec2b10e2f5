"""torch.compile: MemWatch compiles the same graphs as a run without it, in every detail mode.

Dynamo's own counters (frames compiled, graph breaks, unique graphs) are read for a tiny Llama
``Trainer`` run with and without MemWatch. The backend is ``aot_eager``: Dynamo and AOTAutograd trace
exactly as with the default ``inductor`` (graph breaks and recompiles are decided there), without
inductor's C++ code generation, which takes about 60 s for this model on a 2-core CPU.
"""

from __future__ import annotations

import pytest
import torch
from conftest import loss_history, read_records, token_dataset, training_args
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM, Trainer

from hf_memwatch import MemWatch

BACKEND = "aot_eager"


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def compiled_run(out_dir, watch: MemWatch | None, *, compiled_by: str = "trainer") -> tuple[dict, list[float]]:
    """Dynamo's counters and the losses of a 3-step run compiled by the Trainer (``torch_compile``),
    by the user wrapping the model (``torch.compile(model)``) or compiling it in place (``model.compile()``)."""
    torch._dynamo.reset()
    counters.clear()
    model = tiny_llama()
    if compiled_by == "wrapper":
        model = torch.compile(model, backend=BACKEND)
        # The wrapper's forward takes (*args, **kwargs): the Trainer cannot tell which columns it uses.
        args = training_args(out_dir, per_device_train_batch_size=2, remove_unused_columns=False)
    elif compiled_by == "in_place":
        model.compile(backend=BACKEND)
        args = training_args(out_dir, per_device_train_batch_size=2)
    else:
        args = training_args(out_dir, per_device_train_batch_size=2, torch_compile=True,
                             torch_compile_backend=BACKEND)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(6, 16, 64),
                      callbacks=[] if watch is None else [watch])
    trainer.train()
    seen = {
        "frames": dict(counters["frames"]),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompiles": sum(counters["recompiles"].values()),
    }
    return seen, loss_history(trainer)


@pytest.fixture(scope="module")
def without_memwatch(tmp_path_factory) -> tuple[dict, list[float]]:
    return compiled_run(tmp_path_factory.mktemp("plain"), None)


@pytest.mark.parametrize("detail", ["auto", "full", "light"])
def test_memwatch_compiles_the_same_graphs_in_every_mode(without_memwatch, detail, tmp_path):
    expected, expected_losses = without_memwatch
    assert expected["frames"].get("ok", 0) >= 1 and expected["graph_breaks"] == 0  # the run does compile

    seen, losses = compiled_run(tmp_path, MemWatch(detail=detail, report=False, summary=False))

    assert seen == expected
    assert losses == expected_losses  # compiled numerics, bit for bit
    records = read_records(tmp_path)
    steps = [r for r in records if r["event"] == "step"]
    assert len(steps) == 3
    snapshots = [r for r in records if r["event"] == "snapshot"]
    # The forward hook sits on the compiled wrapper, outside the graph: one after_forward per step.
    assert sum(s["phase"] == "after_forward" for s in snapshots) == 3
    if detail != "light":
        # The CPU tracker's dispatch mode would stop Dynamo: fully tracked steps say what they are.
        compiled = [s for s in snapshots if s["detail"] == "compiled"]
        assert compiled and all(s["allocated"] is None for s in compiled)
        assert all(s["live"]["weights"] > 0 for s in compiled)
        assert not any(s["detail"] == "full" for s in snapshots)


@pytest.mark.parametrize("compiled_by", ["wrapper", "in_place"])
def test_a_model_compiled_by_the_user_keeps_its_graph(without_memwatch, compiled_by, tmp_path):
    expected, expected_losses = without_memwatch
    seen, losses = compiled_run(tmp_path, MemWatch(report=False, summary=False), compiled_by=compiled_by)
    assert seen == expected
    assert losses == expected_losses
    snapshots = [r for r in read_records(tmp_path) if r["event"] == "snapshot"]
    assert sum(s["phase"] == "after_forward" for s in snapshots) == 3  # the hooks ran, outside Dynamo
