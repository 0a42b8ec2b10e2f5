"""SDPA on a CUDA target (hf_memwatch.estimation.cuda_sdpa), on fake tensors.

Each test fails on the CPU path the replay took before: the CPU flash kernel, or the math path with
dropout (the fp32 attention matrix saved), and no kernel workspace.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_cuda_kernels import BF16, FP16, FP32, blocks, op_peak, qkv, replay
from torch.utils.checkpoint import checkpoint

from hf_memwatch.core.gpus import gpu_spec
from hf_memwatch.estimation import cuda_sdpa as ck

# -- SDPA backend selection (sdp_utils.cpp) ------------------------------------------------------

@pytest.mark.parametrize("gpu, dtype, kwargs, backend", [
    ("A100", BF16, dict(dropout_p=0.1, is_causal=True), ck.FLASH),  # GPT-2 training on sm80
    ("H100", BF16, dict(dropout_p=0.1, is_causal=True), ck.FLASH),  # cuDNN: dropout not a multiple of 1/16
    ("H100", BF16, dict(is_causal=True), ck.CUDNN),  # cuDNN preferred on sm90
    ("H100", BF16, dict(dropout_p=0.125), ck.CUDNN),
    ("L4", BF16, dict(is_causal=True), ck.FLASH),  # sm89: no cuDNN preference
    ("T4", FP16, dict(dropout_p=0.1, is_causal=True), ck.EFFICIENT),  # sm75: no flash
    ("T4", BF16, dict(dropout_p=0.1), ck.MATH),  # no bf16 kernel below sm80
    ("V100", FP16, dict(dropout_p=0.1), ck.EFFICIENT),
    ("A100", FP32, dict(dropout_p=0.1), ck.EFFICIENT),  # flash: fp16/bf16 only
])
def test_backend_as_sdp_utils_picks(gpu, dtype, kwargs, backend):
    q, k, v = qkv(2, 12, 256, 64, dtype)
    assert ck.sdp_backend(gpu_spec(gpu), q, k, v, **kwargs) == backend


def test_explicit_mask_goes_to_memory_efficient():
    q, k, v = qkv(2, 12, 256, 64)
    mask = torch.ones(2, 1, 256, 256, dtype=torch.bool)
    assert ck.sdp_backend(gpu_spec("A100"), q, k, v, mask, dropout_p=0.1) == ck.EFFICIENT
    assert ck.sdp_backend(gpu_spec("H100"), q, k, v, mask, dropout_p=0.0) == ck.CUDNN
    q, k, v = qkv(2, 12, 256, 68)  # flash pads 68 to 72; memory-efficient needs multiples of 8
    assert ck.sdp_backend(gpu_spec("A100"), q, k, v, mask) == ck.MATH
    assert ck.sdp_backend(gpu_spec("A100"), q, k, v) == ck.FLASH


def test_grouped_query_and_sm86_head_dims():
    q, k, v = qkv(2, 16, 256, 64, FP16, kv_heads=4)
    assert ck.sdp_backend(gpu_spec("A100"), q, k, v, enable_gqa=True) == ck.FLASH
    assert ck.sdp_backend(gpu_spec("T4"), q, k, v, enable_gqa=True) == ck.MATH  # memory-efficient: no GQA
    q, k, v = qkv(2, 4, 256, 256)  # training, head dim 256 with dropout: not flash on sm86
    assert ck.sdp_backend(gpu_spec("A10G"), q, k, v, dropout_p=0.1) == ck.EFFICIENT
    assert ck.sdp_backend(gpu_spec("A100"), q, k, v, dropout_p=0.1) == ck.FLASH


# -- what each backend saves -----------------------------------------------------------------------

def sdpa_saved(gpu: str | None, seq: int, dtype=BF16, **kwargs) -> tuple[int, int]:
    """Bytes saved by one training SDPA (GPT-2's heads) beyond q, k, v, and the bytes of q."""
    with replay(gpu) as (_, saved):
        q, k, v = qkv(2, 12, seq, 64, dtype)
        before = saved.total()
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: F841 - its graph holds the saved
        return saved.total() - before, q.numel() * q.element_size()


def test_flash_saves_output_and_logsumexp():
    saved, size = sdpa_saved("A100", 1000, dropout_p=0.1, is_causal=True)
    # q, k, v, the output, the fp32 log-sum-exp [B, H, L], the RNG seed (2 x uint64) and offset
    assert saved == 4 * size + 2 * 12 * 1000 * 4 + 16 + 8
    cpu, _ = sdpa_saved(None, 1000, dropout_p=0.1, is_causal=True)
    assert cpu > 2 * 12 * 1000 * 1000 * 4  # the CPU math path keeps the fp32 attention matrix


def test_memory_efficient_pads_the_logsumexp():
    saved, size = sdpa_saved("T4", 1000, FP16, dropout_p=0.1, is_causal=True)
    # kAlignLSE: the log-sum-exp padded to a multiple of 32 rows (1000 -> 1024); seed and offset int64
    assert saved == 4 * size + 2 * 12 * 1024 * 4 + 8 + 8


def test_checkpoint_recomputes_the_same_paths():
    # the replaced functions hold inside the recomputation (a function mode would not: a different
    # number of saved tensors, which torch's checkpoint refuses)
    with replay("A100"):
        w = torch.empty(256, 256, dtype=BF16, requires_grad=True)

        def layer(x):
            q = (x @ w).view(2, 128, 4, 64).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
            return F.dropout(out, 0.1, True).sum()

        for reentrant in (False, True):
            checkpoint(layer, torch.empty(2, 128, 256, dtype=BF16, requires_grad=True),
                       use_reentrant=reentrant).backward()
        assert w.grad.shape == (256, 256)


def test_flash_backward_dq_accum_and_softmax_d():
    b, h, seq, d = 2, 12, 1000, 64

    def run(q, k, v, out, lse, grad):
        return ck.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, None, None, seq, seq, 0.1, True, torch.empty(2, dtype=torch.uint64),
            torch.empty((), dtype=torch.uint64))

    def setup():
        q, k, v = (t.detach() for t in qkv(b, h, seq, d))
        out = torch.empty(b, seq, h, d, dtype=BF16).transpose(1, 2)
        return q, k, v, out, torch.empty(b, h, seq), torch.empty(b, seq, h, d, dtype=BF16).transpose(1, 2)

    run.setup = setup
    workspace = blocks(4 * b * h * 1024) + blocks(4 * b * 1024 * h * 64)  # softmax_d, dq_accum (mha_bwd)
    assert op_peak("A100", run) - op_peak(None, run) == workspace


def test_flash_backward_gqa_expands_dk_dv():
    q, k, v = qkv(2, 16, 512, 64, kv_heads=4)
    grad = torch.empty(2, 512, 16, 64, dtype=BF16).transpose(1, 2)
    args = (grad, q, k, v, grad, torch.empty(2, 16, 512))
    dense = ck.flash_backward_workspace((grad, q, q, q, grad, args[5]))
    assert ck.flash_backward_workspace(args) - dense == 2 * blocks(2 * 512 * 16 * 64 * 2)


def test_memory_efficient_backward_workspace():
    q, k, v = qkv(2, 12, 1000, 64, FP16)
    grad = torch.empty(2, 1000, 12, 64, dtype=FP16).transpose(1, 2)
    args = (grad, q, k, v, None, grad, torch.empty(2, 12, 1024), None, None, 0.0)
    # T4 fp16, K = 64: the 64x64 k64 kernel (cutlassB.h); delta [B, H, M] fp32, and per batch and head
    # the dQ tiles: ceil(1000 / 64) x ceil(64 / 64) x (4 + 64 * 64) floats
    per_head = 16 * 1 * (4 + 64 * 64)
    assert ck.efficient_backward_workspace(args, gpu_spec("T4").sm) == blocks(4 * 2 * 12 * 1000) + blocks(
        2 * 12 * per_head * 4)
    assert ck.efficient_backward_kernel(80, True, 128, True, 1024, 1024)[:3] == (128, 128, 128)
    assert ck.efficient_backward_kernel(75, True, 128, False, 1024, 1024)[:3] == (128, 64, 128)


def test_memory_efficient_forward_accumulator_past_head_dim_128():
    q, k, v = qkv(2, 4, 256, 256, FP16)
    assert ck.efficient_forward_workspace((q, k, v)) == blocks(4 * 2 * 256 * 4 * 256)
    q, k, v = qkv(2, 4, 256, 128, FP16)
    assert ck.efficient_forward_workspace((q, k, v)) == 0




def test_math_path_drops_out_with_a_bool_mask():
    # T4 in bf16: no fused kernel, the math path with its fp32 upcast; its dropout is CUDA's fused one
    saved, size = sdpa_saved("T4", 256, dropout_p=0.1)
    matrix = 2 * 12 * 256 * 256
    fp32 = 2 * size  # one of q, k, v upcast to fp32
    # the first matmul's scaled q and k, the softmax output and the dropped weights (fp32, kept by the
    # second matmul with v), and the dropout's 1-byte mask
    assert saved == 3 * fp32 + 2 * matrix * 4 + matrix
    cpu, _ = sdpa_saved(None, 256, dropout_p=0.1)
    assert cpu - saved == matrix * 3  # the CPU dropout's mask in fp32


def test_cudnn_backward_workspace_from_the_frontend_graph():
    """cuDNN's backward takes its graph's workspace from the caching allocator: the frontend's fp32
    dQ_accum and softmax_sum (none on the CPU path)."""
    b, h, seq, d = 2, 16, 1000, 64

    def run(q, k, v, out, lse, grad):
        return ck.aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse, torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64),
            torch.empty(0), None, None, seq, seq, 0.0, True)

    def setup():
        q, k, v = (t.detach() for t in qkv(b, h, seq, d))
        out = torch.empty(b, seq, h, d, dtype=BF16).transpose(1, 2)
        return q, k, v, out, torch.empty(b, h, seq, 1), torch.empty(b, seq, h, d, dtype=BF16).transpose(1, 2)

    run.setup = setup
    workspace = blocks(4 * b * h * seq * d + 4 * b * h * seq)  # dQ_accum + softmax_sum, one allocation
    assert op_peak("H100", run) - op_peak(None, run) == workspace
