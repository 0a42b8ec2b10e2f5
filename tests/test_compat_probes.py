"""The probes of the private names moved into hf_memwatch/compat/ (issue #33, the migration): each holds
on the installed stack, and each, failed — the upstream name removed, or the probe's check made to
fail where removing the name would break the library itself — is one WARNING naming the library, its
release and what is off, one ``meta.degraded`` entry, and only its feature's documented fallback; the
figures of everything else stay as they were."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch
import transformers
from conftest import gpt2_model, token_dataset, training_args
from transformers import Trainer

from hf_memwatch import MemWatchConfigError, estimate
from hf_memwatch.compat import accelerate as compat_accelerate
from hf_memwatch.compat import bitsandbytes as compat_bnb
from hf_memwatch.compat import datasets as compat_datasets
from hf_memwatch.compat import generation as compat_generation
from hf_memwatch.compat import (
    probes,
    torch_amp,
    torch_compile,
    torch_cuda_memory,
    torch_dispatcher,
    torch_frames,
    torch_internals,
    torch_ops,
    trainer_methods,
    versions,
)
from hf_memwatch.compat import trainer as compat_trainer
from hf_memwatch.measure import unperturbed
from hf_memwatch.planning.lengths import arrow_lengths, scan_lengths

FIVE = int(transformers.__version__.split(".")[0]) >= 5
PROBES = [torch_ops.OPS, torch_ops.CUDA_OPS, torch_dispatcher.AUTOCAST_DISPATCH, torch_amp.GRAD_SCALER,
          torch_internals.STORAGE_KEY, torch_internals.PYTHON_TLS, torch_frames.REFERENCES, torch_compile.COMPILED,
          torch_cuda_memory.SNAPSHOT, torch_cuda_memory.HISTORY, trainer_methods.NUM_ITEMS,
          trainer_methods.PREPARE_INPUT, trainer_methods.UNUSED_COLUMNS, trainer_methods.OUTPUT_DIR,
          compat_trainer.WANDB_MODULE, compat_generation.LOOP_GUARD, compat_accelerate.SHARED_STATE,
          compat_accelerate.ORIGINAL_FORWARD, compat_bnb.CPU_OPTIMIZER_KERNELS, compat_bnb.GEMM_4BIT,
          compat_datasets.INDICES]


pytestmark = pytest.mark.usefixtures("fresh_probes")


def one_warning(caplog, probe) -> None:
    """One WARNING and one ``degraded`` entry, the probe's (besides those this stack always has: the masks on 4.x)."""
    expected = set() if FIVE else {compat_trainer.MASKS.entry()}
    found = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "hf-memwatch" in r.getMessage()
             and not any(entry in r.getMessage() for entry in expected)]
    assert found == [f"hf-memwatch: {probe.entry()} (this release of {probe.library} is not verified: docs/compat.md)"]
    assert [entry for entry in probes.degraded() if entry not in expected] == [probe.entry()]
    assert f"{probe.library} {versions.installed(probe.library)}" in found[0]


def failing(monkeypatch, module, name: str):
    """``module.<name>`` (a probe) with its check failing, as on a release that moved the thing."""
    probe = dataclasses.replace(getattr(module, name), check=lambda: False)
    monkeypatch.setattr(module, name, probe)
    return probe


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.guards.split(" ")[0])
def test_each_migrated_probe_holds_on_the_installed_stack(probe) -> None:
    assert probe.check() is True


# -- torch --------------------------------------------------------------------------------------------
def test_a_storage_identity_not_as_verified_stops_at_first_use_in_one_line(monkeypatch) -> None:
    def gone(storage):
        raise AttributeError("'UntypedStorage' object has no attribute '_cdata'")

    monkeypatch.setattr(torch_internals, "storage_key", gone)
    with pytest.raises(MemWatchConfigError) as raised:
        estimate(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100), micro_batch_size=1, seq_len=8)
    message = str(raised.value)
    assert "\n" not in message and f"torch {torch.__version__}" in message and "UntypedStorage._cdata" in message


def test_the_stack_check_stops_memwatch_on_a_storage_identity_not_as_verified(monkeypatch) -> None:
    """``compat.stack.check_stack`` (run by ``MemWatch()`` and ``estimate``) checks torch's internals after
    the versions: the same one line at the callback's construction."""
    from hf_memwatch import MemWatch
    from hf_memwatch.compat.stack import check_stack

    check_stack()  # the installed stack: nothing to say
    monkeypatch.setattr(torch_internals, "storage_key", lambda storage: (_ for _ in ()).throw(AttributeError("_cdata")))
    probes.forget()
    with pytest.raises(MemWatchConfigError) as raised:
        MemWatch()
    assert "\n" not in str(raised.value) and "UntypedStorage._cdata" in str(raised.value)


def test_without_the_callers_dispatch_state_the_kernel_runs_as_called_loudly(monkeypatch, caplog) -> None:
    monkeypatch.delattr(torch._C, "_RestorePythonTLSSnapshot")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch_internals.autocast_devices_of_caller(("cpu",)) == []
        assert torch_internals.autocast_devices_of_caller(("cpu",)) == []
    one_warning(caplog, torch_internals.PYTHON_TLS)


def test_without_reference_counts_the_engine_accumulation_runs_as_called_loudly(monkeypatch, caplog) -> None:
    def gone(tensor):
        raise AttributeError("'Tensor' object has no attribute '_use_count'")

    monkeypatch.setattr(torch_frames, "references", gone)
    unperturbed._handler_references.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
            unperturbed.prepare()
            old, new = torch.zeros(3), torch.ones(3)
            assert unperturbed._engine_accumulates_in_place(old, new) is False  # out of place, as under a mode
    finally:
        unperturbed._handler_references.cache_clear()
    one_warning(caplog, torch_frames.REFERENCES)
    assert torch_frames.frames_named()  # gather_backward's replay (the other probe) stays on


def test_without_the_allocator_snapshot_the_post_mortem_has_no_blocks_loudly(monkeypatch, caplog) -> None:
    monkeypatch.delattr(torch.cuda.memory, "_snapshot")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert torch_cuda_memory.allocator_snapshot() is None and torch_cuda_memory.allocator_snapshot() is None
    one_warning(caplog, torch_cuda_memory.SNAPSHOT)


def test_without_the_history_recorder_no_history_is_started_loudly(monkeypatch, caplog) -> None:
    monkeypatch.delattr(torch.cuda.memory, "_record_memory_history")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert torch_cuda_memory.record_history(10) is False
        torch_cuda_memory.stop_history()
    one_warning(caplog, torch_cuda_memory.HISTORY)


def test_a_compiled_model_that_cannot_be_told_is_taken_for_eager_loudly(monkeypatch, caplog) -> None:
    from hf_memwatch.integration.compiled import compiled_in_place, is_compiled_module

    model = torch.nn.Linear(2, 2)
    model.compile()
    assert compiled_in_place(model) and is_compiled_module(model)
    probes.forget()
    probe = failing(monkeypatch, torch_compile, "COMPILED")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert not compiled_in_place(model) and not is_compiled_module(model)
    one_warning(caplog, probe)


# -- transformers' Trainer and generation --------------------------------------------------------------
def tiny_trainer(out) -> Trainer:
    return Trainer(model=gpt2_model(), args=training_args(out, per_device_train_batch_size=2),
                   train_dataset=token_dataset(8, 32, 1000))


def test_without_the_trainers_item_count_the_loss_counts_its_tokens_loudly(tmp_path, monkeypatch, caplog) -> None:
    trainer = tiny_trainer(tmp_path)
    monkeypatch.delattr(Trainer, "_get_num_items_in_batch")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        result = estimate(trainer)
    assert result.peak_bytes > 0
    one_warning(caplog, trainer_methods.NUM_ITEMS)


def test_a_trainer_placing_inputs_otherwise_is_left_alone_and_the_figures_stay(tmp_path, monkeypatch, caplog) -> None:
    trainer = tiny_trainer(tmp_path)
    verified = estimate(trainer)
    probes.forget()
    monkeypatch.setattr(Trainer, "_prepare_inputs", lambda self, inputs: inputs)  # places through another name
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        degraded = estimate(trainer)
    one_warning(caplog, trainer_methods.PREPARE_INPUT)
    assert "_prepare_input" not in vars(trainer)
    assert (degraded.peak_bytes, degraded.classes) == (verified.peak_bytes, verified.classes)  # a CPU target: no move


def test_without_the_column_removal_every_column_is_kept_loudly(tmp_path, monkeypatch, caplog) -> None:
    datasets = pytest.importorskip("datasets")
    trainer = tiny_trainer(tmp_path)
    table = datasets.Dataset.from_dict({"input_ids": [[1, 2]], "extra": ["x"]})
    monkeypatch.delattr(Trainer, "_remove_unused_columns")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert trainer_methods.without_unused_columns(trainer, table) is table
    assert trainer_methods.collator_without_unused_columns(trainer, trainer.data_collator) is trainer.data_collator
    one_warning(caplog, trainer_methods.UNUSED_COLUMNS)


def test_without_the_trial_folder_name_one_folder_is_used_loudly(tmp_path, monkeypatch, caplog) -> None:
    trainer = tiny_trainer(tmp_path)
    monkeypatch.delattr(Trainer, "_get_output_dir")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert trainer_methods.trial_output_dir(trainer, {"lr": 1}) is None
    one_warning(caplog, trainer_methods.OUTPUT_DIR)


def test_without_the_wandb_module_the_scalars_are_left_to_the_callback_loudly(monkeypatch, caplog) -> None:
    from transformers.integrations import WandbCallback

    monkeypatch.setattr(WandbCallback, "setup", lambda self, *a, **k: None)  # logs through another name
    callback = object.__new__(WandbCallback)
    callback._wandb = type("wandb", (), {"run": object()})
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert compat_trainer.wandb_run(callback) is None
    one_warning(caplog, compat_trainer.WANDB_MODULE)


def test_a_generate_loop_guarded_otherwise_is_one_line_and_warned(monkeypatch, caplog) -> None:
    from transformers.generation.utils import GenerationMixin

    monkeypatch.delattr(GenerationMixin, "_has_unfinished_sequences")
    model = torch.nn.Module()
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"), pytest.raises(MemWatchConfigError) as raised:
        compat_generation.replace_loop_guard(model, lambda *a: False)
    assert "\n" not in str(raised.value) and "_has_unfinished_sequences" in str(raised.value)
    assert not hasattr(model, "_has_unfinished_sequences")
    one_warning(caplog, compat_generation.LOOP_GUARD)


def test_the_generation_defaults_are_read_on_4x_and_5x() -> None:
    """5.x: ``GenerationConfig._get_default_generation_params()``; 4.x has none (read before: an
    AttributeError), a fresh ``GenerationConfig()`` holds them (``make test-stack2`` runs this on 4.57)."""
    assert compat_generation.default_generation_param("max_length") == 20
    assert compat_generation.default_generation_param("num_beams") == 1


# -- accelerate -----------------------------------------------------------------------------------------
def test_without_accelerates_shared_state_the_state_is_not_kept_loudly(monkeypatch, caplog) -> None:
    from accelerate.state import PartialState

    probe = failing(monkeypatch, compat_accelerate, "SHARED_STATE")
    marker = "_hf_memwatch_probe_marker"
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        with compat_accelerate.accelerate_state_kept():
            PartialState._shared_state[marker] = 1
    try:
        assert PartialState._shared_state.pop(marker) == 1  # not put back: the fallback keeps nothing
    finally:
        PartialState._shared_state.pop(marker, None)
    one_warning(caplog, probe)


def test_a_forward_wrapped_otherwise_is_not_recognised_loudly(monkeypatch, caplog) -> None:
    model = torch.nn.Linear(2, 2)
    model._original_forward = model.forward
    assert compat_accelerate.forward_wrapped_for_mixed_precision(model)
    probes.forget()
    probe = failing(monkeypatch, compat_accelerate, "ORIGINAL_FORWARD")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert not compat_accelerate.forward_wrapped_for_mixed_precision(model)
    one_warning(caplog, probe)


def test_accelerates_environment_is_left_as_found() -> None:
    """transformers 4.x writes ``ACCELERATE_MIXED_PRECISION`` in ``TrainingArguments.__post_init__``."""
    before = {k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_", "FSDP_"))}
    with compat_accelerate.accelerate_environment_kept():
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
        os.environ["FSDP_HF_MEMWATCH_TEST"] = "1"
    assert {k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_", "FSDP_"))} == before


def test_a_bf16_truth_run_leaves_the_next_fp32_run_in_fp32(tmp_path, monkeypatch) -> None:
    """On transformers 4.57.6 a bf16 ``TrainingArguments`` left ``ACCELERATE_MIXED_PRECISION=bf16`` and the
    next fp32 Trainer of the process ran under bf16 autocast (DeBERTa-v2: 3,407,576 B instead of 3,929,584)."""
    from hf_memwatch.testing.estimate_truth import trainer_peak
    from hf_memwatch.testing.families import build_family_model

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)  # an earlier test's 4.x Trainer may have set it
    before = os.environ.get("ACCELERATE_MIXED_PRECISION")
    trainer_peak(build_family_model("albert"), task="seq-cls", micro_batch_size=2, seq_len=16, precision="bf16", steps=1)
    assert os.environ.get("ACCELERATE_MIXED_PRECISION") == before
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert Trainer(model=gpt2_model(), args=args).accelerator.mixed_precision == "no"


# -- bitsandbytes, datasets -----------------------------------------------------------------------------
def test_without_bitsandbytes_cpu_kernels_the_op_is_replayed_bare_loudly(monkeypatch, caplog) -> None:
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.backends.cpu import ops

    assert compat_bnb.cpu_optimizer_kernel("optimizer_update_32bit") is ops._optimizer_update_32bit_cpu
    probes.forget()
    monkeypatch.delattr(ops, "_optimizer_update_32bit_cpu")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert compat_bnb.cpu_optimizer_kernel("optimizer_update_32bit") is None
        assert compat_bnb.cpu_optimizer_kernel("optimizer_update_8bit_blockwise") is None
    one_warning(caplog, compat_bnb.CPU_OPTIMIZER_KERNELS)
    assert compat_bnb.gemm_4bit_composite() is not None  # the 4-bit matmul's kernel (another probe) stays


def test_without_the_row_mapping_lengths_are_read_item_by_item_the_same(monkeypatch, caplog) -> None:
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in (3, 9, 5, 7)]}).select([3, 1, 0])
    fast = arrow_lengths(table, k=2)
    probes.forget()
    probe = failing(monkeypatch, compat_datasets, "INDICES")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert arrow_lengths(table, k=2) is None
    slow = scan_lengths(table, k=2, seconds=10)
    assert (slow.index, slow.length, sorted(slow.top)) == (fast.index, fast.length, sorted(fast.top)) == (1, 9, [7, 9])
    one_warning(caplog, probe)


def test_a_renamed_aten_operator_drops_only_its_rule_loudly(monkeypatch, caplog) -> None:
    """``aten::_grouped_mm`` renamed: warned at the first estimate, its rule off; a GPT-2 (no grouped
    matmul) gives the same figures."""
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    verified = estimate(config, micro_batch_size=2, seq_len=16)
    probes.forget()
    versions.check_versions.cache_clear()
    real = torch_ops.aten_default
    monkeypatch.setattr(torch_ops, "aten_default", lambda name: None if name == "_grouped_mm" else real(name))
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        degraded = estimate(config, micro_batch_size=2, seq_len=16)
        estimate(config, micro_batch_size=2, seq_len=16)
    one_warning(caplog, torch_ops.OPS)
    assert (degraded.peak_bytes, degraded.classes) == (verified.peak_bytes, verified.classes)
    assert torch_ops.present(torch_ops.aten_default("_grouped_mm"), torch_ops.SOFTMAX) == {torch_ops.SOFTMAX}


# -- the CUDA replay's torch internals (a CUDA target, replayed on the CPU) ------------------------------
def cuda_estimate(**kwargs):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    return estimate(config, micro_batch_size=2, seq_len=128, device="cuda", gpu="A100-80GB", **kwargs)


def test_without_the_dispatcher_internals_a_cuda_target_takes_cpu_autocast_loudly(monkeypatch, caplog) -> None:
    cpu_target = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    before = estimate(cpu_target, micro_batch_size=2, seq_len=16, precision="bf16")
    verified = cuda_estimate(precision="bf16")
    probes.forget()
    monkeypatch.delattr(torch._C, "_dispatch_get_registrations_for_dispatch_key")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        degraded = cuda_estimate(precision="bf16")
        after = estimate(cpu_target, micro_batch_size=2, seq_len=16, precision="bf16")
    one_warning(caplog, torch_dispatcher.AUTOCAST_DISPATCH)
    assert degraded.peak_bytes < verified.peak_bytes  # CUDA's fp32 copies (softmax, layer_norm...) not kept
    assert (after.peak_bytes, after.classes) == (before.peak_bytes, before.classes)  # a CPU target: untouched


def test_without_the_grad_scalers_internals_fp16_is_replayed_without_it_loudly(monkeypatch, caplog) -> None:
    from hf_memwatch.estimation.cuda_optim import step_scaler

    request = type("Request", (), {"device": "cuda", "precision": "fp16", "shard": None})()
    assert step_scaler(request, tracker=None) is not None
    probes.forget()
    probe = failing(monkeypatch, torch_amp, "GRAD_SCALER")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert step_scaler(request, tracker=None) is None
        assert cuda_estimate(precision="fp16").peak_bytes > 0
    one_warning(caplog, probe)


def test_without_cudas_attention_kernels_a_cuda_target_takes_the_math_path_loudly(monkeypatch, caplog) -> None:
    probe = failing(monkeypatch, torch_ops, "CUDA_OPS")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert cuda_estimate(precision="bf16").peak_bytes > 0
    one_warning(caplog, probe)


def test_without_the_4bit_matmuls_python_kernel_the_op_is_replayed_bare_loudly(monkeypatch, caplog) -> None:
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.backends.default import ops

    monkeypatch.delattr(ops, "_gemm_4bit_default_impl")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert compat_bnb.gemm_4bit_composite() is None and compat_bnb.gemm_4bit_composite() is None
    one_warning(caplog, compat_bnb.GEMM_4BIT)


def test_a_torch_without_a_required_dispatch_name_is_one_line_at_import() -> None:
    """``_disable_current_modes`` removed from torch before hf-memwatch is imported (a subprocess)."""
    import subprocess
    import sys

    code = ("import torch.utils._python_dispatch as d; del d._disable_current_modes\n"
            "from hf_memwatch.core.errors import MemWatchConfigError\n"
            "try:\n    import hf_memwatch.compat.torch_internals\nexcept MemWatchConfigError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and len(lines) == 1, (done.stdout, done.stderr[-2000:])
    assert lines[0].startswith(f"torch {torch.__version__}: ") and "_disable_current_modes" in lines[0]
