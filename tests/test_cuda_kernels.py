"""The CUDA kernel paths of a CUDA target's replay (hf_memwatch.estimation.cuda_kernels), on fake tensors.

Each test fails on the CPU path the replay took before: the dropout mask in the input's dtype, no
kernel workspaces. The helpers here (a CUDA target's replay frame) serve tests/test_cuda_sdpa.py too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_memwatch.core.gpus import gpu_spec
from hf_memwatch.estimation import cuda_kernels as ck
from hf_memwatch.estimation.fake_dispatch import CUDA_BLOCK, EstimateTracker
from hf_memwatch.estimation.replay import tracked
from hf_memwatch.measure.saved_tensors import SavedTensorRegistry

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def blocks(nbytes: int) -> int:
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK


@contextlib.contextmanager
def replay(gpu: str | None) -> Iterator[tuple[EstimateTracker, SavedTensorRegistry]]:
    """A CUDA target's replay frame on ``gpu`` (None: the frame without the CUDA paths)."""
    saved = SavedTensorRegistry()
    tracker = EstimateTracker("cpu", saved, round_to=CUDA_BLOCK)
    tracker.gpu = gpu_spec(gpu) if gpu else None
    with tracked(FakeTensorMode(), tracker):
        saved.start()
        try:
            yield tracker, saved
        finally:
            saved.stop()


def qkv(b: int, h: int, seq: int, d: int, dtype: torch.dtype = BF16, kv_heads: int | None = None) -> list:
    """Leaf q, k, v ``[B, H, L, D]`` laid out as transformers makes them (a transposed ``[B, L, H, D]``)."""
    heads = (h, kv_heads or h, kv_heads or h)
    return [torch.empty(b, seq, n, d, dtype=dtype).transpose(1, 2).requires_grad_() for n in heads]


# -- dropout ---------------------------------------------------------------------------------------

def dropout_saved(gpu: str | None, **kwargs) -> int:
    with replay(gpu) as (_, saved):
        x = torch.empty(64, 1024, dtype=BF16, requires_grad=True)
        y = F.dropout(x * 2, **kwargs)  # noqa: F841 - its graph holds what is saved
        return saved.total()


def test_fused_dropout_saves_a_bool_mask():
    # Dropout.cpp: native_dropout on CUDA, its autograd keeps a 1-byte mask; the CPU path a bf16 one
    assert dropout_saved("A100", p=0.1, training=True) == 64 * 1024
    assert dropout_saved(None, p=0.1, training=True) == 64 * 1024 * 2


@pytest.mark.parametrize("kwargs", [dict(p=0.1, training=False), dict(p=0.0, training=True),
                                    dict(p=0.1, training=True, inplace=True)])
def test_unfused_dropout_untouched(kwargs):
    # not fused on CUDA either: evaluation, p == 0, dropout_ (in place)
    assert dropout_saved("A100", **kwargs) == dropout_saved(None, **kwargs)


def test_paths_put_back_and_cpu_target_untouched():
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention
    with replay(None):
        assert F.dropout is dropout and F.scaled_dot_product_attention is sdpa
    with replay("H100"):
        assert F.dropout is not dropout and F.scaled_dot_product_attention is not sdpa
    assert F.dropout is dropout and F.scaled_dot_product_attention is sdpa


# -- workspaces ------------------------------------------------------------------------------------

def op_peak(gpu: str | None, run) -> int:
    """The tracker's high while ``run()`` runs, above what was allocated before."""
    with replay(gpu) as (tracker, _):
        tensors = run.setup()
        tracker.reset_peak()
        base = tracker.allocated
        run(*tensors)
        return tracker.peak - base


@pytest.mark.parametrize("tokens", [3072, 4096])
def test_embedding_backward_segments(tokens):
    vocab, hidden = 50257, 768

    def run(weight, ids, grad):
        return ck.aten.embedding_dense_backward(grad, ids, vocab, -1, False)

    run.setup = lambda: (None, torch.zeros(tokens, dtype=torch.long), torch.empty(tokens, hidden, dtype=BF16))
    extra = op_peak("A100", run) - op_peak(None, run)
    if tokens <= ck.EMBEDDING_DIRECT_MAX:
        assert extra == 0  # the direct kernel
        return
    partials = tokens // 10 + tokens
    idx = blocks(tokens * 8)
    assert extra == 3 * idx + 2 * idx + blocks(partials * 8) + blocks(partials * hidden * 4) + 2 * blocks(8)


def test_cublas_copies_operands_in_neither_layout():
    def run(a, b):
        return torch.mm(a, b)

    run.setup = lambda: (torch.empty(64, 512)[:, ::2], torch.empty(256, 32))
    assert op_peak("A100", run) - op_peak(None, run) == blocks(64 * 256 * 4)
    run.setup = lambda: (torch.empty(256, 64).t(), torch.empty(256, 32))  # column-major: taken as is
    assert op_peak("A100", run) == op_peak(None, run)


def test_cuda_softmax_copies_a_strided_input():
    def run(x):
        return torch.log_softmax(x, -1)

    run.setup = lambda: (torch.empty(8, 100, 1000)[:, 1:],)
    assert op_peak("A100", run) - op_peak(None, run) == blocks(8 * 99 * 1000 * 4)
