"""CUDA autocast's policy in a CUDA target's replay (hf_memwatch/estimation/cuda_autocast.py).

Each list's test checks an output dtype on fake CPU tensors under the CUDA policy, and the same call
under torch's own CPU autocast, which differs: a test of the CUDA policy fails under the CPU one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from hf_memwatch.estimation.cuda_autocast import (
    APPEND_DTYPE_REDISPATCH,
    CUDA_AUTOCAST_TABLES,
    OUTSIDE_HEADER,
    cuda_autocast_policy,
    policy_notes,
    policy_table,
    registered_ops,
    table_for,
    table_ops,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"


def under(policy: str, fn, dtype=BF16):
    """``fn()`` under CPU autocast at ``dtype``, casting as ``policy`` ("cuda" or "cpu") says, on fake tensors."""
    with FakeTensorMode(), torch.autocast("cpu", dtype=dtype):
        if policy == "cuda":
            with cuda_autocast_policy():
                return fn()
        return fn()


def both(fn, dtype=BF16):
    return under("cuda", fn, dtype), under("cpu", fn, dtype)


def x(dtype=BF16, *shape):
    return torch.randn(*(shape or (4, 8)), dtype=dtype)


# -- one test per list ----------------------------------------------------------------------------

def test_lower_precision_fp_casts_what_only_cuda_lists() -> None:
    # mv/addmv/addr are in AT_FORALL_LOWER_PRECISION_FP; AutocastCPU does not register them
    cuda, cpu = both(lambda: (torch.mv(x(FP32), x(FP32, 8)).dtype, torch.addr(x(FP32), x(FP32, 4), x(FP32, 8)).dtype))
    assert cuda == (BF16, BF16)
    assert cpu == (FP32, FP32)
    # the lists both keys share cast alike (linear, SDPA: the kernels below are another matter)
    q = lambda: x(FP32, 1, 2, 16, 8)  # noqa: E731
    cuda, cpu = both(lambda: (F.linear(x(FP32), x(FP32, 8, 8)).dtype, F.scaled_dot_product_attention(q(), q(), q()).dtype))
    assert cuda == cpu == (BF16, BF16)


def test_fp32_runs_norms_pow_exp_and_losses_in_fp32() -> None:
    def ops():
        h = x()
        return [F.layer_norm(h, (8,)).dtype, F.rms_norm(h, (8,)).dtype, torch.pow(h, 3.0).dtype, h.exp().dtype,
                h.rsqrt().dtype, F.softplus(h).dtype, torch.logsumexp(h, -1).dtype]
    cuda, cpu = both(ops)
    assert cuda == [FP32] * 7
    assert cpu == [BF16] * 7


def test_fp32_set_opt_dtype_sets_float_unless_a_dtype_is_passed() -> None:
    def ops():
        h = x()
        return [F.softmax(h, -1).dtype, F.log_softmax(h, -1).dtype, h.sum().dtype, h.sum(-1).dtype,
                h.cumsum(0).dtype, torch.linalg.vector_norm(h).dtype, F.softmax(h, -1, dtype=FP16).dtype]
    cuda, cpu = both(ops)
    assert cuda == [FP32] * 6 + [FP16]  # an explicit dtype is kept (set_opt_dtype)
    assert cpu == [BF16] * 6 + [FP16]
    # an ineligible first argument (an integer tensor) is left alone: sum of int64 stays int64
    assert under("cuda", lambda: torch.ones(4, dtype=torch.long).sum().dtype) == torch.long


def test_a_half_softmax_asked_for_float_runs_the_fused_half_to_float_kernel() -> None:
    """SoftMax.cpp: a CUDA half input with dtype=float runs _softmax(half_to_float=True), no fp32 input copy."""
    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    def run(policy: str) -> tuple[list[str], torch.dtype, torch.dtype]:
        with FakeTensorMode(), torch.autocast("cpu", dtype=FP16):
            h = x(FP16).requires_grad_()
            with cuda_autocast_policy() if policy == "cuda" else torch.autocast("cpu", dtype=FP16), Ops() as ops:
                y = F.softmax(h, -1, dtype=FP32)
            y.sum().backward()
            return ops.seen, y.dtype, h.grad.dtype

    seen, out, grad = run("cuda")
    assert "_to_copy.default" not in seen and "_softmax.default" in seen
    assert (out, grad) == (FP32, FP16)
    assert "_to_copy.default" in run("cpu")[0]


def test_fp32_append_dtype_redispatches_norm_with_float() -> None:
    cuda, cpu = both(lambda: (torch.norm(x()).dtype, torch.norm(x(), dim=1).dtype, torch.norm(x(), p=1).dtype))
    assert cuda == (FP32, FP32, FP32)
    assert cpu == (BF16, BF16, BF16)
    assert set(APPEND_DTYPE_REDISPATCH) == set(CUDA_AUTOCAST_TABLES[table_for(torch.__version__)[0]]["fp32_append_dtype"])


def test_promote_runs_in_the_widest_dtype() -> None:
    # dot/scatter_add of a bf16 and an fp32 tensor: promoted to fp32 under CUDA autocast ...
    cuda = under("cuda", lambda: (torch.dot(x(BF16, 8), x(FP32, 8)).dtype,
                                  x(BF16).scatter_add(0, torch.zeros(4, 8, dtype=torch.long), x(FP32)).dtype,
                                  torch.dot(x(BF16, 8), x(BF16, 8)).dtype))
    assert cuda == (FP32, FP32, BF16)
    # ... which CPU autocast does not register: the mixed dtypes are an error there
    with pytest.raises(RuntimeError):
        under("cpu", lambda: torch.dot(x(BF16, 8), x(FP32, 8)))
    # prioritize: the autocast dtype beside another half type is an error, as in C++
    with pytest.raises(RuntimeError, match="prioritize"):
        under("cuda", lambda: torch.dot(x(BF16, 8), x(FP16, 8)))


def test_binary_cross_entropy_is_banned_as_on_cuda() -> None:
    p = lambda: torch.rand(4, dtype=FP32)  # noqa: E731
    with pytest.raises(RuntimeError, match="banned under CUDA autocast"):
        under("cuda", lambda: F.binary_cross_entropy(p(), p()))
    assert under("cpu", lambda: F.binary_cross_entropy(p(), p()).dtype) == FP32


def test_an_op_only_cpu_registers_is_not_cast() -> None:
    # AutocastCPU runs cross_entropy_loss in fp32 (its input cast up front); CUDA has no kernel for it:
    # its inner ops are autocast each — log_softmax asked for the input's own dtype (LossNLL.cpp,
    # cross_entropy_loss: log_softmax(self, class_dim, self.scalar_type())) stays half, nll_loss (fp32)
    # casts its output
    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "aten":
                self.seen.append((func.__name__, args[0].dtype))
            return func(*args, **(kwargs or {}))

    def run(policy: str) -> list:
        with FakeTensorMode(), torch.autocast("cpu", dtype=FP16):
            logits, labels = x(FP16), torch.zeros(4, dtype=torch.long)
            mode = Ops()
            mode.seen = []
            with cuda_autocast_policy() if policy == "cuda" else torch.autocast("cpu", dtype=FP16), mode:
                F.cross_entropy(logits, labels)
            return mode.seen

    assert run("cuda") == [("_log_softmax.default", FP16), ("_to_copy.default", FP16), ("nll_loss_forward.default", FP32)]
    assert run("cpu") == [("_to_copy.default", FP16), ("_log_softmax.default", FP32), ("nll_loss_forward.default", FP32)]


# -- the weight cache -----------------------------------------------------------------------------

class _Copies(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.copies += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


def test_a_parameter_used_twice_is_cast_once_per_autocast_region() -> None:
    with FakeTensorMode():
        weight = torch.nn.Parameter(torch.randn(8, 8))
        h = torch.randn(4, 8)
        with cuda_autocast_policy() as cache:
            with torch.autocast("cpu", dtype=BF16), _Copies() as seen:
                F.linear(F.linear(h, weight), weight)
                with torch.autocast("cpu", enabled=False):  # an inner region's exit keeps the cache
                    pass
                F.linear(h, weight)
                cast = cache.casts[id(weight)][1]
            # activations cast each time (2), the weight once
            assert seen.copies == 3
            assert cache.casts == {}  # the outermost region's exit cleared it (torch.clear_autocast_cache)
            with torch.autocast("cpu", dtype=BF16):
                F.linear(h, weight)
                assert cache.casts[id(weight)][1] is not cast  # a new region casts anew


def test_checkpoint_recomputation_casts_as_cuda() -> None:
    dtypes: list[torch.dtype] = []

    def block(h: torch.Tensor) -> torch.Tensor:
        out = F.softmax(h @ h.T, -1)
        dtypes.append(out.dtype)
        return out

    with FakeTensorMode():
        h = torch.randn(4, 8, requires_grad=True)
        with cuda_autocast_policy(), torch.utils.checkpoint.set_checkpoint_early_stop(False):
            with torch.autocast("cpu", dtype=BF16):
                loss = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False).sum()
            loss.backward()  # recomputes under torch.autocast("cpu", ...) re-entered by checkpoint
    assert dtypes == [FP32, FP32]


# -- the restore ----------------------------------------------------------------------------------

def _tables() -> dict[str, str]:
    ops = registered_ops("AutocastCPU") | registered_ops("AutocastCUDA")
    return {op: torch._C._dispatch_dump(f"aten::{op}") for op in sorted(ops)}


def test_cpu_autocast_is_torchs_own_again_after_the_policy() -> None:
    before = _tables()
    clear = torch.clear_autocast_cache
    under("cuda", lambda: F.softmax(x(), -1))
    with pytest.raises(ValueError), cuda_autocast_policy():
        raise ValueError("the body fails")
    assert _tables() == before
    assert torch.clear_autocast_cache is clear
    assert under("cpu", lambda: (F.softmax(x(), -1).dtype, F.layer_norm(x(), (8,)).dtype)) == (BF16, BF16)


def test_the_policy_re_entered_keeps_the_outer_one() -> None:
    before = _tables()
    with cuda_autocast_policy() as outer:
        with cuda_autocast_policy() as inner:
            assert inner is outer
        assert under("cuda", lambda: F.softmax(x(), -1).dtype) == FP32  # still on
    assert _tables() == before


# -- the table and torch's lists --------------------------------------------------------------------

def _header_lists() -> dict[str, set[str]]:
    text = HEADER.read_text()
    lists = {}
    for macro, policy in (("AT_FORALL_LOWER_PRECISION_FP", "lower_precision_fp"), ("AT_FORALL_FP32", "fp32"),
                          ("AT_FORALL_FP32_SET_OPT_DTYPE", "fp32_set_opt_dtype"), ("AT_FORALL_PROMOTE", "promote")):
        body = re.search(rf"#define {macro}\(_\)(.*?)\n(?:\n|#)", text, re.S).group(1)
        lists[policy] = {".".join(part.strip() for part in entry.split(",")) for entry in re.findall(r"_\(([^)]*)\)", body)}
    body = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE\(_\)(.*?)\n\n", text, re.S).group(1)
    lists["fp32_append_dtype"] = set(re.findall(r'"([\w.]+)"', body))
    return lists


def test_the_table_is_the_installed_headers_lists() -> None:
    key, note = table_for(torch.__version__)
    assert note is None, f"no CUDA autocast table for torch {torch.__version__}: add one (cuda_autocast.py)"
    table = CUDA_AUTOCAST_TABLES[key]
    for policy, ops in _header_lists().items():
        assert set(table[policy]) - set(OUTSIDE_HEADER) == ops, policy
    # and exactly what the running build registers for AutocastCUDA (autocast_mode.cpp's additions too)
    assert table_ops(table) == registered_ops("AutocastCUDA")
    assert policy_table()[1] == ()


def test_an_unknown_torch_gets_a_named_table_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    newest = max(CUDA_AUTOCAST_TABLES, key=lambda k: tuple(map(int, k.split("."))))
    key, note = table_for("9.1.0")
    assert key == newest and "9.1.0" in note and newest in note
    key, note = table_for("2.0.1+cu118")  # older than every table: the newest, noted
    assert key == newest and "2.0.1+cu118" in note
    with caplog.at_level("WARNING", logger="hf_memwatch"):
        policy_table("9.1.0")
    assert any("9.1.0" in record.getMessage() for record in caplog.records)
    assert "9.1.0" in policy_notes("bf16", "9.1.0")[0]  # an estimate's notes carry it too
    assert policy_notes("fp32", "9.1.0") == () and policy_notes("bf16") == ()


# -- end to end -----------------------------------------------------------------------------------

def test_a_cuda_target_holds_gpt2s_gelu_new_in_fp32() -> None:
    from transformers import GPT2Config

    from hf_memwatch import estimate

    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000)

    def act_dtypes(device: str) -> set[str]:
        result = estimate(config, micro_batch_size=4, seq_len=64, device=device, precision="bf16", top_tensors=60,
                          extrapolate_layers=False)
        return {t.dtype for t in result.peak_tensors.tensors if t.module.endswith("mlp.act") and t.operator == "aten.tanh"}

    # gelu_new's pow (fp32 list) makes the rest of the activation fp32 on CUDA; CPU autocast keeps it bf16
    assert act_dtypes("cuda") == {"fp32"}
    assert act_dtypes("cpu") == {"bf16"}
