"""The optimizer step of a CUDA target (estimation/cuda_optim.py): the Trainer's default optimizer, foreach's
copy of the group against fused's none, Adam's step counters on the host, fp16's GradScaler."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config

from hf_memwatch.core.categories import AFTER_OPTIMIZER, STEP_END
from hf_memwatch.estimation.cuda_optim import GRAD_SCALER, default_optim, trainer_default_optim
from hf_memwatch.estimation.estimate import estimate
from hf_memwatch.estimation.fake_model import fake_model
from hf_memwatch.estimation.optim import param_groups

BLOCK = 512
CONFIG = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
KW = dict(micro_batch_size=1, seq_len=16, device="cuda", gpu="A100")


def rounded(nbytes: int) -> int:
    return -(-nbytes // BLOCK) * BLOCK


@pytest.fixture(scope="module")
def params():
    """The trainable parameters as the replay's optimizer groups them (decay, no decay)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, _, _ = fake_model(CONFIG, "causal-lm", FakeTensorMode(allow_non_fake_inputs=True))
    return [group["params"] for group in param_groups(model)]


@pytest.fixture(scope="module")
def runs():
    return {(optim, precision): estimate(CONFIG, optim=optim, precision=precision, **KW)
            for optim in (None, "adamw_torch") for precision in ("fp32", "fp16")}


def test_the_default_is_the_trainers_own_for_a_cuda_target_only():
    from transformers import TrainingArguments

    assert trainer_default_optim() == TrainingArguments.__dataclass_fields__["optim"].default
    assert default_optim("cuda") == trainer_default_optim() and default_optim("cpu") == "adamw_torch"
    assert estimate(CONFIG, **KW).config["optim"] == "adamw_torch_fused"
    assert estimate(CONFIG, micro_batch_size=1, seq_len=16).config["optim"] == "adamw_torch"  # CPU: unchanged


def test_foreach_steps_on_a_copy_of_the_group_fused_in_place(params):
    """``_multi_tensor_adam``'s ``_foreach_sqrt(exp_avg_sq)``: one fp32 copy of the larger group, per tensor
    in its 512 B blocks; fused keeps its step counters on the card (one block per parameter), foreach on the host."""
    # without clipping, whose per-parameter norms would set fused's highest
    foreach, fused = (estimate(CONFIG, optim=optim, max_grad_norm=0.0, **KW) for optim in ("adamw_torch", None))
    copy = max(sum(rounded(p.numel() * 4) for p in group) for group in params)
    counters = BLOCK * sum(len(group) for group in params)
    assert foreach.peak_phase == AFTER_OPTIMIZER and foreach.classes["temporaries"] == copy
    assert foreach.classes["optimizer_states"] == 2 * sum(rounded(p.numel() * 4) for group in params for p in group)
    # fused's highest of the interval is its start (the loss and a batch still alive: two blocks), no copy
    assert foreach.phase_peaks[AFTER_OPTIMIZER] - fused.phase_peaks[AFTER_OPTIMIZER] == copy - counters - 2 * BLOCK


def test_adam_step_counters_live_on_the_host_unless_fused(runs, params):
    counters = BLOCK * sum(len(group) for group in params)
    at_end = {optim: runs[optim, "fp32"].phase_peaks[STEP_END] for optim in (None, "adamw_torch")}
    assert at_end[None] - at_end["adamw_torch"] == counters


def test_fp16_runs_accelerates_grad_scaler(runs):
    for optim in (None, "adamw_torch"):
        fp16, fp32 = runs[optim, "fp16"], runs[optim, "fp32"]
        assert fp16.details["other"][GRAD_SCALER] == 2 * BLOCK  # _scale (fp32) and _growth_tracker (int32)
        assert GRAD_SCALER not in fp32.details.get("other", {})
        # the step was taken (found_inf read 0): the foreach copy is there under the scaler too
        assert fp16.phase_peaks[AFTER_OPTIMIZER] > fp16.phase_peaks[STEP_END]
    scaled, plain = runs["adamw_torch", "fp16"], runs["adamw_torch", "fp32"]
    # unscale_'s found_inf kept to update() beside the step's highest, the scale and growth tracker
    assert scaled.phase_peaks[AFTER_OPTIMIZER] - plain.phase_peaks[AFTER_OPTIMIZER] == 3 * BLOCK


def test_no_scaler_for_bf16_or_a_cpu_target():
    assert GRAD_SCALER not in estimate(CONFIG, precision="bf16", **KW).details.get("other", {})
    assert GRAD_SCALER not in estimate(CONFIG, micro_batch_size=1, seq_len=16, precision="bf16").details.get("other", {})


def test_host_counters_only_inside_the_optimizer_step():
    """Outside a torch optimizer's step a ``torch.tensor`` is counted as ever (the loss accumulator)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_memwatch.estimation.cuda_optim import steps_on_host
    from hf_memwatch.estimation.fake_dispatch import EstimateTracker
    from hf_memwatch.measure.saved_tensors import SavedTensorRegistry

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        weight = torch.nn.Parameter(torch.empty(128, 128))
    optimizer = torch.optim.AdamW([weight], foreach=True)
    tracker = EstimateTracker("cpu", SavedTensorRegistry(), round_to=BLOCK)
    steps_on_host(optimizer, tracker)
    with mode, tracker:
        kept = torch.tensor(0.0)
        weight.grad = torch.zeros_like(weight)
        before = tracker.allocated
        optimizer.step()
        assert tracker.allocated - before == 2 * 128 * 128 * 4  # the moments; the step counter on the host
        assert tracker.allocated >= BLOCK + before
    del kept


def test_a_trainers_own_step_scales_its_loss_through_the_scaler(tmp_path):
    """``estimate(trainer, device="cuda", precision="fp16")``: the Trainer's ``training_step`` runs
    ``Accelerator.backward`` with the scaler installed, the Trainer's accelerator left as it was."""
    from conftest import gpt2_model, token_dataset, training_args
    from transformers import Trainer

    trainer = Trainer(model=gpt2_model(n_layer=1, n_embd=64), train_dataset=token_dataset(n=4, seq_len=16, vocab=1000),
                      args=training_args(tmp_path, per_device_train_batch_size=2, max_steps=1))
    assert trainer.accelerator.scaler is None  # a CPU Trainer: accelerate builds none
    result = estimate(trainer, device="cuda", precision="fp16", gpu="A100")
    assert result.details["other"][GRAD_SCALER] == 2 * BLOCK
    assert result.config["optim"] == "adamw_torch_fused"  # the Trainer's own (its arguments' default)
    assert trainer.accelerator.scaler is None


def test_a_cuda_target_takes_the_local_card_when_none_is_named(monkeypatch):
    from hf_memwatch.core import gpus
    from hf_memwatch.estimation.cuda_libs import CUBLAS_WORKSPACE, cublas_workspace_size

    local = gpus.gpu_spec("L4")
    monkeypatch.setattr(gpus, "local_gpu", lambda index=None: local)  # this machine's card, as torch reports it
    result = estimate(CONFIG, micro_batch_size=1, seq_len=16, device="cuda")
    assert result.config["gpu"]["name"] == "L4" and not any("assumed" in note for note in result.notes)
    assert result.details["other"][CUBLAS_WORKSPACE] == 2 * cublas_workspace_size(local)
