"""CUDA libraries' allocations by the target's card (estimation/cuda_libs.py): cuBLAS workspaces per
architecture and thread, bitsandbytes' CUDA routing of the 4-bit GEMM; the card as an input (``--gpu``)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GPT2Config

from hf_memwatch.cli.main import main
from hf_memwatch.core.gpus import GPUS, card_fits, gpu_spec
from hf_memwatch.estimation.cuda_libs import (
    CUBLAS_WORKSPACE,
    bnb_gemm_4bit_cuda,
    cublas_workspace_size,
    cublaslt_own_workspace_size,
    uses_custom_kernel,
)
from hf_memwatch.estimation.estimate import estimate

CONFIG = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0,
                    architectures=["GPT2LMHeadModel"])
DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # torch's ":4096:2:16:8"


def test_workspace_size_by_architecture_and_environment():
    assert [cublas_workspace_size(gpu_spec(name), {}) for name in ("V100", "T4", "A100", "L4", "H100", "H200")] == \
        [DEFAULT] * 4 + [32 << 20] * 2
    assert cublas_workspace_size(gpu_spec("H100"), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 << 20
    assert cublas_workspace_size(gpu_spec("H100"), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 << 10
    assert cublas_workspace_size(gpu_spec("T4"), {"CUBLAS_WORKSPACE_CONFIG": "junk"}) == DEFAULT  # torch warns
    assert cublaslt_own_workspace_size({}) == 0  # unified with cuBLAS' by default
    assert cublaslt_own_workspace_size({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}) == 1 << 20


def test_a_step_holds_two_workspaces_of_its_card_cpu_none():
    for name in ("T4", "H100"):
        result = estimate(CONFIG, micro_batch_size=1, seq_len=16, device="cuda", gpu=name)
        assert result.details["other"][CUBLAS_WORKSPACE] == 2 * cublas_workspace_size(gpu_spec(name))
        assert result.config["gpu"]["name"] == gpu_spec(name).name
    cpu = estimate(CONFIG, micro_batch_size=1, seq_len=16)
    assert CUBLAS_WORKSPACE not in cpu.details.get("other", {}) and "gpu" not in cpu.config


def test_fits_without_a_budget_is_the_cards_memory():
    small = estimate(CONFIG, micro_batch_size=1, seq_len=16, device="cuda", gpu="T4")
    assert small.budget is None and small.fits is True
    if small.device_bytes is None:
        assert small.reserved_bytes <= gpu_spec("T4").memory
        assert any(note.startswith("fits: the predicted reserve against the T4") for note in small.notes)
    assert estimate(CONFIG, micro_batch_size=1, seq_len=16).fits is None  # a CPU target: no card



def test_a_cards_memory_is_what_cuda_gives_a_process_not_nvidia_smis_total():
    """``fits`` and the allocator's limit take cudaMemGetInfo's total (torch's ``total_memory``), below
    nvidia-smi's "Total" by the framebuffer the driver keeps: a T4 step between the two does not fit.
    With nvidia-smi's totals in GpuSpec.memory (before), it did."""
    for spec in GPUS:
        assert spec.memory <= spec.smi_total, spec.name
        assert spec.published or spec.memory == spec.smi_total, spec.name
    assert sum(spec.memory < spec.smi_total for spec in GPUS) >= 8
    t4 = gpu_spec("T4")
    between = (t4.memory + t4.smi_total) // 2
    assert t4.memory < between < t4.smi_total
    assert card_fits(t4, None, between, []) is False and card_fits(t4, None, t4.memory, []) is True
    l4 = estimate(CONFIG, micro_batch_size=1, seq_len=16, device="cuda", gpu="L4")
    assert l4.fits is True and any("the L4's CUDA total is not published" in note for note in l4.notes)
    h100 = estimate(CONFIG, micro_batch_size=1, seq_len=16, device="cuda", gpu="H100")
    assert not any("not published" in note for note in h100.notes)

# -- bitsandbytes' 4-bit GEMM ------------------------------------------------------------------
def _gemm_peak(gpu, rows: int, k: int = 256, n: int = 512) -> tuple[int, int, int]:
    """Bytes above the inputs inside ``gemm_4bit`` of a (rows x k) bf16 input, as the tracker replays it;
    the output's and the dequantized weight's bytes."""
    pytest.importorskip("bitsandbytes")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_memwatch.estimation.fake_dispatch import EstimateTracker
    from hf_memwatch.measure.saved_tensors import SavedTensorRegistry

    tracker = EstimateTracker("cpu", SavedTensorRegistry())
    tracker.gpu = gpu
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        a = torch.empty(rows, k, dtype=torch.bfloat16)
        packed = torch.empty(n * k // 2, 1, dtype=torch.uint8)
        absmax = torch.empty(n * k // 64, dtype=torch.float32)
        tracker.reset_peak()
        before = tracker.allocated
        out = torch.ops.bitsandbytes.gemm_4bit.default(a, packed, [n, k], absmax, 64, "nf4")
        peak = tracker.peak - before
    del out
    return peak, rows * n * 2, n * k * 2


def test_small_inputs_run_the_fused_kernel_on_cuda_large_ones_dequantize():
    h100 = gpu_spec("H100")
    peak, out, weight = _gemm_peak(h100, rows=4)  # M <= 4: bitsandbytes' custom kernel, always
    assert peak == out
    peak, out, weight = _gemm_peak(h100, rows=2048)  # past 1536 rows: dequantize, then F.linear
    assert peak == out + weight
    peak, out, weight = _gemm_peak(None, rows=4)  # a CPU target: bitsandbytes' CPU composite dequantizes
    assert peak == out + weight


def test_the_routing_is_bitsandbytes_own_heuristic_by_card():
    pytest.importorskip("bitsandbytes")
    # past its custom range and with K off the block size: the fallback on every card
    assert uses_custom_kernel(gpu_spec("T4"), torch.float16, 2048, 4096, 4096, 64) is False
    assert uses_custom_kernel(gpu_spec("H100"), torch.bfloat16, 64, 4096, 4000, 64) is False
    # fp32 has no MMA kernel: custom only below 8 rows (bitsandbytes' rule), on any card
    assert uses_custom_kernel(gpu_spec("A100"), torch.float32, 6, 4096, 4096, 64) is True
    assert uses_custom_kernel(gpu_spec("A100"), torch.float32, 16, 4096, 4096, 64) is False
    # the card decides in between: a large weight at 100 rows is custom on sm89 (the 4090's tiers: up to 128
    # rows near a wave), not on sm90 (up to 32 rows at one to two waves)
    m, n, k = 100, 14336, 4096
    assert uses_custom_kernel(gpu_spec("H100"), torch.bfloat16, m, n, k, 64) is False
    assert uses_custom_kernel(gpu_spec("RTX-4090"), torch.bfloat16, m, n, k, 64) is True
    assert bnb_gemm_4bit_cuda(gpu_spec("T4")) is not None


def test_bitsandbytes_optimizer_steps_allocate_nothing_on_cuda_their_cpu_kernels_fp32_temporaries():
    """bitsandbytes' CUDA optimizer kernels update in place; the CPU ones dequantize into fp32 temporaries.
    A Llama whose word embeddings (32,000 x 256 = 8,192,000 elements, 32-bit states: the Trainer's
    override for embeddings) dominate: on a CUDA target the optimizer step rises above the step's end by
    the bias-correction scalars only, on a CPU target by the CPU kernel's 5 x 4 B a element
    (163,840,000 B). Before the CUDA target stopped running the CPU kernel, it counted those too."""
    pytest.importorskip("bitsandbytes")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=512, vocab_size=32000)
    common = dict(task="causal-lm", micro_batch_size=1, seq_len=16, precision="bf16", optim="adamw_bnb_8bit")
    embedding = 32000 * 256
    on_cuda = estimate(config, device="cuda", gpu="H100", **common).phase_peaks
    on_cpu = estimate(config, device="cpu", **common).phase_peaks
    assert 0 <= on_cuda["after_optimizer"] - on_cuda["step_end"] < 64 * 1024
    assert on_cpu["after_optimizer"] - on_cpu["step_end"] >= 5 * 4 * embedding


# -- the CLI: --gpu ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gpt2-gpu")
    CONFIG.save_pretrained(path)
    return path


def test_cli_gpu_changes_the_architecture_dependent_workspace(model_dir, capsys):
    found = {}
    for name in ("T4", "H100"):
        assert main(["estimate", str(model_dir), "--micro-batch-size", "1", "--seq-len", "16", "--device", "cuda",
                     "--gpu", name, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        found[name] = data["details"]["other"][CUBLAS_WORKSPACE]
        assert data["config"]["gpu"]["name"] == gpu_spec(name).name and data["fits"] is True
        assert data["config"]["optim"] == "adamw_torch_fused"  # the Trainer's default on CUDA
    assert found == {"T4": 2 * DEFAULT, "H100": 2 * (32 << 20)}
    assert main(["estimate", str(model_dir), "--micro-batch-size", "1", "--seq-len", "16", "--device", "cuda",
                 "--gpu", "T4"]) == 0
    assert "GPU T4 (sm_75" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "cuda", "--gpu", "X99"], "unknown GPU 'X99'; choose one of H200, H100-80GB"),
    (["--gpu", "T4"], "--gpu T4 is for a CUDA target: add --device cuda"),
])
def test_cli_gpu_errors_are_one_line(model_dir, capsys, argv, message):
    assert main(["estimate", str(model_dir), "--micro-batch-size", "1", "--seq-len", "16", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
