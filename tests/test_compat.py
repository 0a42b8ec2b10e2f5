"""hf_memwatch.compat: the verified versions, checked at first use; each probe's contract with the
installed upstream (the private thing is there and does what we rely on), and the degradation when a
probe fails — the upstream name removed for the test — as one WARNING, ``meta.degraded`` and only its
feature off (issue #33)."""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from conftest import gpt2_model, read_records, token_dataset, training_args
from transformers import GPT2Config, Trainer
from transformers.integrations import TensorBoardCallback

from hf_memwatch import MemWatch, MemWatchConfigError, estimate
from hf_memwatch.cli.main import main
from hf_memwatch.compat import deepspeed as compat_deepspeed
from hf_memwatch.compat import probes, torch_frames, versions
from hf_memwatch.compat import trainer as compat_trainer
from hf_memwatch.integration.apply import apply_plan
from hf_memwatch.integration.eval_watch import registering_containers
from hf_memwatch.measure import unperturbed
from hf_memwatch.planning.plan import Plan
from hf_memwatch.reporting.sinks import exact_name_routes

LIGHT = {"detail": "light", "report": False, "summary": False}
FIVE = int(transformers.__version__.split(".")[0]) >= 5
PROBES = [pytest.param(compat_trainer.MASKS, marks=pytest.mark.skipif(not FIVE, reason="4.x: off, loudly")),
          compat_trainer.TRAIN_BATCH_SIZE, compat_trainer.TENSORBOARD_WRITER, compat_trainer.EVAL_CONTAINER,
          torch_frames.FRAMES]


pytestmark = pytest.mark.usefixtures("fresh_probes")


def tiny_trainer(out: Path, callbacks=(), **args) -> Trainer:
    return Trainer(model=gpt2_model(), args=training_args(out, **args), train_dataset=token_dataset(16, 32, 1000),
                   callbacks=list(callbacks))


def one_warning(caplog, *words: str) -> str:
    found = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "hf-memwatch" in r.getMessage()]
    assert len(found) == 1, found
    assert all(word in found[0] for word in words), found[0]
    return found[0]


# -- versions ----------------------------------------------------------------------------------------
def test_the_installed_stack_is_within_the_verified_ranges() -> None:
    installed = {name: versions.installed(name) for name in versions.VERIFIED}
    assert versions.unsupported(installed) == [] and versions.unsupported(installed, required=False) == []
    versions.check_versions()


def test_every_tested_release_is_at_or_above_its_floor() -> None:
    for name, verified in versions.VERIFIED.items():
        for release in verified.tested:
            assert versions.unsupported({name: release}, required=verified.required) == []


@pytest.fixture
def old_transformers(monkeypatch):
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: "4.46.3" if name == "transformers" else real(name))


def test_an_old_transformers_fails_fast_in_one_line_naming_the_range(old_transformers, tmp_path, capsys) -> None:
    expected = "transformers 4.46.3 is older than the oldest verified release (supported: transformers>=4.57"
    with pytest.raises(MemWatchConfigError, match=r"^transformers 4\.46\.3 .*>=4\.57") as error:
        MemWatch()
    assert str(error.value).startswith(expected) and "\n" not in str(error.value)
    with pytest.raises(MemWatchConfigError, match=">=4.57"):
        estimate(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100), micro_batch_size=1, seq_len=8)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100).to_dict()))
    assert main(["estimate", str(config), "--micro-batch-size", "1", "--seq-len", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err


def test_an_old_torch_runs_only_when_asked_and_then_says_so_once(monkeypatch, caplog) -> None:
    """The lent GPU machines hold torch 2.11 and cannot install another: HF_MEMWATCH_UNVERIFIED=1 runs there
    with one WARNING naming the range; without it the check fails fast, saying how to ask."""
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: "2.11.0+cu130" if name == "torch" else real(name))
    monkeypatch.delenv(versions.UNVERIFIED_ENV, raising=False)
    with pytest.raises(MemWatchConfigError, match=r"^torch 2\.11\.0\+cu130 is older .* HF_MEMWATCH_UNVERIFIED=1"):
        versions.check_versions()
    monkeypatch.setenv(versions.UNVERIFIED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        versions.check_versions()
        versions.check_versions()
    one_warning(caplog, "torch 2.11.0+cu130", "supported: torch>=2.13", "unverified")
    versions.check_versions.cache_clear()


def test_an_old_optional_library_is_one_warning(monkeypatch, caplog) -> None:
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: "0.20.0" if name == "trl" else real(name))
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        versions.check_versions()
        versions.check_versions()
    one_warning(caplog, "trl 0.20.0", "supported: trl>=0.24")


# -- contracts with the installed upstream -----------------------------------------------------------
@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.guards.split(" ")[0])
def test_each_probe_holds_on_the_installed_stack(probe) -> None:
    assert probe.check() is True


def test_the_cached_batch_size_is_what_the_dataloader_reads(tmp_path) -> None:
    trainer = tiny_trainer(tmp_path, per_device_train_batch_size=4)
    apply_plan(trainer, Plan(2, 2, False, "adamw_torch"))
    assert len(next(iter(trainer.get_train_dataloader()))["input_ids"]) == 2


def test_the_eval_loop_builds_its_containers_through_the_swapped_name(tmp_path) -> None:
    trainer = tiny_trainer(tmp_path, per_device_eval_batch_size=4)
    found: list = []
    with registering_containers(found):
        trainer.evaluate(token_dataset(8, 32, 1000))
    assert len(found) == 4 and all(hasattr(c, "tensors") and hasattr(c, "arrays") for c in found)


# -- a failed probe: one WARNING, meta.degraded, its feature off -----------------------------------
def test_a_renamed_cached_batch_size_is_warned_once_and_not_written(tmp_path, monkeypatch, caplog) -> None:
    trainer = tiny_trainer(tmp_path, per_device_train_batch_size=4)
    monkeypatch.setattr(Trainer, "get_train_dataloader", lambda self: None)  # reads another name now
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert compat_trainer.set_cached_train_batch_size(trainer, 2) is False
        apply_plan(trainer, Plan(2, 2, False, "adamw_torch"))
    assert trainer._train_batch_size == 4 and trainer.args.per_device_train_batch_size == 2
    one_warning(caplog, f"transformers {transformers.__version__}", "Trainer._train_batch_size", "micro-batch")
    assert probes.degraded() == [compat_trainer.TRAIN_BATCH_SIZE.entry()]


def test_a_gone_eval_container_leaves_outputs_as_other_loudly(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.delattr(transformers.trainer, "EvalLoopContainer")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        for _ in range(2):
            found: list = []
            with registering_containers(found):
                assert not hasattr(transformers.trainer, "EvalLoopContainer")  # nothing swapped in
    one_warning(caplog, f"transformers {transformers.__version__}", "EvalLoopContainer", "counted as other")


def test_a_gone_tensorboard_writer_leaves_the_scalars_to_the_callback(monkeypatch, caplog) -> None:
    callback = TensorBoardCallback()
    assert [route[0] for route in exact_name_routes([callback])] == [callback]
    probes.forget()
    monkeypatch.setattr(TensorBoardCallback, "on_log", lambda self, *a, **k: None)  # writes through another name
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert exact_name_routes([callback]) == [] and exact_name_routes([callback]) == []
        assert compat_trainer.tensorboard_writer(callback) is None
    one_warning(caplog, "TensorBoardCallback.tb_writer", "train/memory/*")


def test_renamed_cpp_frames_turn_the_unperturbed_replay_off_loudly(monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch_frames, "GATHER_BACKWARD_CALLER", "renamed_gather_backward(")
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        unperturbed.prepare()
        unperturbed.prepare()
    one_warning(caplog, f"torch {torch.__version__}", "gather_backward(", "unperturbed")
    # the operators then run as called (None), whatever their caller
    assert unperturbed.run_unperturbed(torch.ops.aten.scatter_add.default, (torch.zeros(2), 0, torch.zeros(1, dtype=torch.long), torch.ones(1)), {}) is None


def test_masks_the_estimate_cannot_take_as_real_are_warned_once_and_in_meta(tmp_path, monkeypatch, caplog) -> None:
    """transformers 4.x has no ``masking_utils.fast_all``/``is_tracing`` (on 5.x: removed for the test)."""
    from transformers import masking_utils

    if FIVE:
        monkeypatch.delattr(masking_utils, "fast_all")
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        estimate(config, micro_batch_size=1, seq_len=8)
        estimate(config, micro_batch_size=1, seq_len=8)
    one_warning(caplog, f"transformers {transformers.__version__}", "masking_utils", "masks")
    assert probes.degraded() == [compat_trainer.MASKS.entry()]


def test_zero_optimizers_assign_their_partitions_under_the_verified_names() -> None:
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        assert compat_deepspeed._probe(cls).check() is True


def test_a_renamed_zero_partition_is_warned_once(tmp_path, monkeypatch, caplog) -> None:
    """A DeepSpeed-shaped module whose stage-1/2 optimizer keeps its fp32 partitions under another name."""
    import importlib.util

    source = tmp_path / "renamed_stage.py"
    source.write_text("class DeepSpeedZeroOptimizer:\n    def __init__(self):\n"
                      "        self.bit16_groups_flat = []\n        self.fp32_partitions = []\n"
                      "        self.averaged_gradients = {}\n")
    spec = importlib.util.spec_from_file_location("deepspeed.runtime.zero.renamed_stage", source)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    with caplog.at_level(logging.WARNING, logger="hf_memwatch"):
        assert not compat_deepspeed.zero_partitions_named(module.DeepSpeedZeroOptimizer())
        assert not compat_deepspeed.zero_partitions_named(module.DeepSpeedZeroOptimizer())
    one_warning(caplog, "deepspeed", "single_partition_of_fp32_groups", "ZeRO's partitions")


def test_the_meta_record_names_what_is_off(tmp_path, monkeypatch) -> None:
    tiny_trainer(tmp_path / "whole", [MemWatch(**LIGHT)], max_steps=1).train()
    [meta] = [r for r in read_records(tmp_path / "whole") if r["event"] == "meta"]
    assert "degraded" not in meta
    probes.forget()  # a process probes once: a new one, with the name gone
    monkeypatch.delattr(transformers.trainer, "EvalLoopContainer")
    tiny_trainer(tmp_path / "degraded", [MemWatch(**LIGHT)], max_steps=1).train()
    [meta] = [r for r in read_records(tmp_path / "degraded") if r["event"] == "meta"]
    assert meta["degraded"] == [compat_trainer.EVAL_CONTAINER.entry()]


# -- point 4: no deprecation warning of ours under the pinned versions -------------------------------
def test_memwatch_and_the_auto_mode_add_no_deprecation_warning(tmp_path) -> None:
    """A tiny Trainer as given, then under ``MemWatch(auto=True)`` with a budget that needs a remedy
    (checkpointing and another optimizer written into its arguments): a DeprecationWarning or
    FutureWarning raised from our code is an error, and the run under MemWatch warns nothing the run
    as given does not (one triggered by an argument we set). A first watched run warms the imports: a
    library's import-time warning (torch's ``jit.script_method`` on 4.x) is not ours."""
    categories = (DeprecationWarning, FutureWarning, PendingDeprecationWarning)

    def deprecations(out: Path, callbacks=()) -> set[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for category in categories:
                warnings.filterwarnings("error", category=category, module=r"hf_memwatch")
            trainer = tiny_trainer(out, callbacks, per_device_train_batch_size=8, max_steps=2)
            trainer.train()
        return {f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, categories)}

    peak = estimate(tiny_trainer(tmp_path / "e", per_device_train_batch_size=8)).peak_bytes
    deprecations(tmp_path / "warm", [MemWatch(auto=True, budget=int(peak * 0.6), **LIGHT)])
    given = deprecations(tmp_path / "given")
    watched = deprecations(tmp_path / "auto", [MemWatch(auto=True, budget=int(peak * 0.6), **LIGHT)])
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert plan["activation_checkpointing"] is True  # the arguments we set were exercised
    assert watched - given == set()
