"""Shared builders for tests: small real models, datasets and Trainer runs (no mocks)."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# oneDNN capped at the ISA the CPU golden figures were written on (benchmarks/cpu_golden.ONEDNN_ISA: an AMX
# host blocks bf16 products differently); read at oneDNN's first primitive, none has run yet.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
# Two cores: one thread per pytest-xdist worker (two workers), else two.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))

# After the environment: importing it imports transformers and huggingface_hub, which read it.
from hf_memwatch.compat.trainer import checkpointing_argument  # noqa: E402
from hf_memwatch.testing.estimate_truth import ListDataset  # noqa: E402


def token_dataset(n: int, seq_len: int, vocab: int, *, labels: str = "lm", num_labels: int = 2, seed: int = 0):
    """Random token sequences; ``labels='lm'`` copies inputs, ``'cls'`` draws a class per example."""
    gen = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq_len,), generator=gen)
        label = ids.clone() if labels == "lm" else torch.randint(0, num_labels, (), generator=gen)
        items.append({"input_ids": ids, "labels": label})
    return ListDataset(items)


def gpt2_model(n_layer: int = 2, n_embd: int = 128, vocab: int = 1000, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab, n_positions=512,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return GPT2LMHeadModel(config)


def bert_model(num_layers: int = 2, hidden: int = 128, vocab: int = 1000, seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=4,
        intermediate_size=4 * hidden, max_position_embeddings=512, num_labels=2, pad_token_id=0,
    )
    return BertForSequenceClassification(config)


def training_args(output_dir: Path | str, **overrides: Any):
    from transformers import TrainingArguments

    values: dict[str, Any] = dict(
        output_dir=str(output_dir), per_device_train_batch_size=4, max_steps=3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
        disable_tqdm=True,
    )
    values.update(overrides)
    return TrainingArguments(**values)


TORCHRUN = Path(sys.executable).parent / "torchrun"
LAUNCH_TIMEOUT_S = 240


def benchmark_script(name: str) -> Any:
    """``benchmarks/<name>.py`` imported as the module ``name`` (registered: its dataclasses resolve it by name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(script: Path, out: Path, timeout_s: int = LAUNCH_TIMEOUT_S) -> str:
    """Run ``script OUT`` on 2 local ranks; fail the test on a non-zero exit or a hang."""
    out.mkdir(parents=True, exist_ok=True)
    scratch = out.parent / f"{out.name}-tmp"  # torch elastic's folders (torchelastic_*, its log dir), not /tmp's
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline", TMPDIR=str(scratch))
    command = [str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), str(script), str(out)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks: the group this test started
        output, _ = proc.communicate()
        pytest.fail(f"{script.name} did not finish within {timeout_s} s (a rank hung?):\n{output[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{script.name} exited with {proc.returncode}:\n{output[-4000:]}")
    return output


def rank_timeline(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    """The records one rank of a torchrun launch wrote under ``run_dir/memwatch`` (every line must parse)."""
    from hf_memwatch.core.timeline import TIMELINE_DIRNAME, timeline_filename

    path = run_dir / TIMELINE_DIRNAME / timeline_filename(rank)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rank_step_peaks(run_dir: Path, rank: int) -> list[int]:
    """MemWatch's peak of each optimizer step on one rank (its ``step`` records)."""
    return [r["peak"] for r in rank_timeline(run_dir, rank) if r["event"] == "step"]


def read_records(output_dir: Path | str, name: str = "timeline.jsonl") -> list[dict[str, Any]]:
    path = Path(output_dir) / "memwatch" / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# A plan record's fields -> the TrainingArguments a user sets to configure that run by hand.
HAND_CONFIGURED = {"micro_batch_size": "per_device_train_batch_size",
                   "gradient_accumulation_steps": "gradient_accumulation_steps",
                   "activation_checkpointing": checkpointing_argument(), "optim": "optim"}  # 4.x: gradient_


def hand_configured(plan: Any, *, leave: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``TrainingArguments`` keywords of the hand-configured run of ``plan`` (a ``plan`` record as
    read from the timeline, or its ``PlanRecord``): micro-batch, accumulation, checkpointing and
    optimizer as a user would type them, read from the record, not from the library's own apply code.
    ``leave``: plan fields the caller's run sets itself (left out)."""
    record = plan if isinstance(plan, dict) else plan.to_dict()
    return {argument: record[field] for field, argument in HAND_CONFIGURED.items() if field not in leave}


def loss_history(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


# Every timeline record the suite writes is checked against its typed definition (the README's
# contract, hf_memwatch.core.records); tests/test_zz_timeline_contract.py reads the verdict.
WRITTEN_RECORDS: dict[str, int] = {}  # event -> records written by this process's tests
RECORD_PROBLEMS: list[str] = []  # what the current test wrote that does not match core/records.py
# Where each pytest process leaves the kinds it wrote (pytest-xdist workers inherit it from the
# controller), so the check that the suite wrote every kind sees the whole suite, in any order.
RECORDS_DIR_ENV = "HF_MEMWATCH_TEST_RECORDS_DIR"


@pytest.fixture
def fresh_probes():
    """Every compat probe runs again in the test, and no failure of the test's making outlives it."""
    from hf_memwatch.compat import probes, versions

    probes.forget()
    versions.check_versions.cache_clear()
    yield
    probes.forget()
    versions.check_versions.cache_clear()


@pytest.fixture(autouse=True, scope="session")
def check_every_timeline_record():
    """Every record any test writes is validated against its typed definition (see the per-test check)."""
    from hf_memwatch.core.records import Record, validate_record
    from hf_memwatch.core.timeline import TimelineWriter

    original = TimelineWriter.write

    def write(self, record):
        if not isinstance(record, Record):  # records travel typed; only the writer serialises (issue #34)
            RECORD_PROBLEMS.append(f"a {type(record).__name__} handed to TimelineWriter.write, not a typed record")
            return original(self, record)
        data = record.to_dict()
        WRITTEN_RECORDS[str(data.get("event"))] = WRITTEN_RECORDS.get(str(data.get("event")), 0) + 1
        RECORD_PROBLEMS.extend(validate_record(data))
        return original(self, record)

    TimelineWriter.write = write
    yield
    TimelineWriter.write = original


@pytest.fixture(autouse=True)
def records_match_their_definitions(check_every_timeline_record):
    """The test that wrote a record unlike its definition fails (MemWatch's guard would swallow a raise)."""
    RECORD_PROBLEMS.clear()
    yield
    problems, RECORD_PROBLEMS[:] = sorted(set(RECORD_PROBLEMS)), []
    if problems:
        pytest.fail(f"timeline records unlike core/records.py: {problems[:20]}", pytrace=False)


# Heaviest files first (CPU/wall s per file, fresh-clone CI of 2026-12-01 and this branch's reruns), so that
# pytest-xdist's --dist loadfile ends on small files: with --no-loadscope-reorder (Makefile) it hands files out
# in this order; its default order (most tests first) put the one- and two-test TRL auto files last, where a
# worker holding the next file while the other one idles is the tail. A file not named keeps its place after
# these (Python's sort is stable); a new file of more than ~15 s belongs here.
SLOWEST_FIRST = (
    "test_deepspeed_zero.py", "test_distributed.py", "test_gpu_check.py", "test_auto.py", "test_trl_trainers.py",
    "test_estimate.py", "test_trl_auto_more.py", "test_safety_net.py", "test_online_dpo.py", "test_eval.py",
    "test_example.py", "test_equivalence.py", "test_memwatch.py", "test_auto_prediction.py", "test_gkd_auto.py",
    "test_trl_online.py", "test_bad_input.py", "test_kto_auto.py", "test_qlora.py", "test_cli_estimate.py",
    "test_compile.py", "test_rloo_auto.py", "test_oom.py", "test_measured_fallback.py",
    "test_checkpointing_as_configured.py", "test_perturbation.py", "test_planner.py", "test_sinks.py",
    "test_timeline_golden.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def freeze_imported_objects() -> None:
    """Take every object alive now (the imported libraries: ~520,000 in a worker) out of the collector's
    reach (``gc.freeze``). accelerate's ``free_memory()`` runs a full ``gc.collect()`` at every
    ``Trainer.train()``, DeepSpeed's ZeRO-3 ``defragment`` and the profiler's truth one more: 0.27 s a call
    in a worker, 0.39 s in a ZeRO rank, where it scanned those objects every time (13 of a rank's 91
    profiled seconds). Objects made later — every model, tensor and Trainer of a test — are collected as
    before; ``gc.get_objects()`` (``truth.alive_storages``) lists them, not the frozen ones."""
    gc.freeze()


def pytest_collection_finish(session):
    freeze_imported_objects()  # every test module imported: torch, transformers, TRL, PEFT, ...


def pytest_configure(config):
    if not hasattr(config, "workerinput") and RECORDS_DIR_ENV not in os.environ:  # the controller
        import tempfile

        os.environ[RECORDS_DIR_ENV] = config._hf_memwatch_records = tempfile.mkdtemp(prefix="hf-memwatch-records-")


def pytest_unconfigure(config):
    """The controller removes the records folder it made (after every process's ``pytest_sessionfinish``)."""
    folder = getattr(config, "_hf_memwatch_records", None)
    if folder is not None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(RECORDS_DIR_ENV, None)


def pytest_sessionfinish(session, exitstatus):
    """Each process leaves the kinds it wrote; the controller checks, on a whole-suite run, that the
    suite wrote every kind of record it can (oom and oom_recovered are written in subprocesses)."""
    folder = Path(os.environ.get(RECORDS_DIR_ENV, ""))
    if not folder.is_dir():
        return
    worker = getattr(session.config, "workerinput", {}).get("workerid", "main")
    (folder / f"{worker}.json").write_text(json.dumps(WRITTEN_RECORDS))
    if hasattr(session.config, "workerinput") or not _whole_suite(session):
        return
    from hf_memwatch.core.records import RECORDS

    written = set()
    for path in folder.glob("*.json"):
        written |= set(json.loads(path.read_text()))
    missing = set(RECORDS) - {"oom", "oom_recovered"} - written
    if missing and session.exitstatus == 0:
        session.config.get_terminal_writer().line(f"the suite wrote no {sorted(missing)} record", red=True)
        session.exitstatus = 1


def _whole_suite(session) -> bool:
    options = session.config.option
    return session.testscollected > 300 and not options.keyword and not options.markexpr and not getattr(options, "lf", False)


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def module_calls(model: torch.nn.Module, **inputs) -> tuple[list[str], list[list[int]]]:
    """Each module call of ``model``'s forward (names) with its own parameters' indices, as the pre-forward
    hooks DeepSpeed installs see them."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    names, trace = [], []

    def called(name: str, module: torch.nn.Module, *_) -> None:
        names.append(name)
        trace.append(sorted({index[id(p)] for p in module.parameters(recurse=False)}))

    hooks = [m.register_forward_pre_hook(lambda module, args, name=name: called(name, module))
             for name, m in model.named_modules()]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return names, trace


def exit_at_once() -> None:
    """End a torchrun rank after its ``main()`` returned (its facts written, its process groups destroyed)
    without the interpreter's finalization: flush and ``os._exit(0)``.

    DeepSpeed launches on 2 gloo ranks aborted after their last line a few times under load ("terminate called
    without an active exception", SIGABRT on rank 0: 2026-12-05, 2026-12-06 twice, about 1 in 10-40 loaded
    launches, MemWatch's tracker polling or calling back alike), which made the launch's tests error with
    every figure already written. pytorch/pytorch#179291 describes the same abort: gloo's worker threads still
    holding works whose tensors need the GIL while the interpreter is torn down. The cause here is not traced;
    an exception inside ``main()`` still exits non-zero (this is not reached).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
