"""CPU kernels' internal buffers: the bf16/fp16 GEMM workspace rule against the real profiler probe.

``gemm_cpu_workspace`` skips the probe where ATen's CPU BLAS fallback runs the product (no oneDNN for
the dtype) and both matrices are row- or column-major; these small products (above oneDNN's 16^3
threshold, each a few milliseconds) check that the skipped figure is the one the probe measures,
on whatever CPU runs the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hf_memwatch.estimation import kernel_workspaces as kw

MM, ADDMM, BMM = torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default


def _mat(rows: int, cols: int, transposed: bool, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(cols, rows).to(dtype).t() if transposed else torch.randn(rows, cols).to(dtype)


def _cases(dtype: torch.dtype) -> list[tuple[str, object, tuple]]:
    cases = []
    for ta in (False, True):
        for tb in (False, True):
            a, b = _mat(96, 80, ta, dtype), _mat(80, 112, tb, dtype)
            cases.append((f"mm ta={ta} tb={tb}", MM, (a, b)))
            cases.append((f"addmm ta={ta} tb={tb}", ADDMM, (torch.randn(112).to(dtype), a, b)))
    cases.append(("bmm q @ k.T", BMM, (torch.randn(4, 64, 32).to(dtype), torch.randn(4, 64, 32).to(dtype).mT)))
    cases.append(("mm, a strided matrix", MM, (torch.randn(96, 160).to(dtype)[:, ::2], _mat(80, 112, False, dtype))))
    return cases


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_gemm_workspace_rule_is_the_probe_s_figure(dtype: torch.dtype) -> None:
    for label, op, operands in _cases(dtype):
        kw._GEMM_WORKSPACES.clear()
        assert kw.gemm_cpu_workspace(op, operands, {}) == kw._probe_gemm(op, operands, {}), label


def test_a_matrix_blas_cannot_take_is_still_probed() -> None:
    strided = torch.empty(8, 12)[:, ::2]
    assert not kw.blas_ready(strided)
    assert kw.blas_ready(torch.empty(6, 8).t()) and kw.blas_ready(torch.empty(3, 6, 8).mT)


def _onednn_bf16() -> bool:
    return kw.onednn_gemm(torch.bfloat16)


@pytest.mark.skipif(not _onednn_bf16(), reason="bf16 products run ATen's BLAS fallback here: no workspace")
def test_a_probe_under_a_running_profiler_is_not_remembered() -> None:
    """A live run under the profiler (the sweep's truth) cannot probe (no nested profiler): 0 then, but
    not cached, or every later estimate of that layout would read 0 too."""
    a, b = torch.randn(96, 80).bfloat16(), torch.randn(112, 80).bfloat16().t()
    kw._GEMM_WORKSPACES.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert kw.gemm_cpu_workspace(MM, (a, b), {}) == 0
    assert not kw._GEMM_WORKSPACES
    assert kw.gemm_cpu_workspace(MM, (a, b), {}) == kw._probe_gemm(MM, (a, b), {}) > 0


@pytest.mark.skipif(not _onednn_bf16(), reason="bf16 products run ATen's BLAS fallback here: no workspace")
def test_the_live_tracker_counts_what_a_bf16_product_allocates_inside_itself() -> None:
    """MemWatch's live CPU tracker (``session.live_backend``) against the profiler on a bf16 product whose
    oneDNN packed blocks set the peak: equal to the byte (the tracker alone missed them: the sweep's live
    outliers, 2.67% on ALBERT 4 x 64 bf16)."""
    from hf_memwatch.integration.session import live_backend
    from hf_memwatch.testing.truth import cpu_memory_profile

    a, b = torch.randn(256, 192).bfloat16().t(), torch.randn(256, 320).bfloat16()  # a transposed: repacked
    kw._GEMM_WORKSPACES.clear()
    kw.gemm_cpu_workspace(MM, (a, b), {})  # probed outside the profiler (the estimate does, before the run)
    tracker = live_backend(torch.device("cpu")).tracker
    tracker.register([a, b])
    tracker.reset_peak()
    with cpu_memory_profile() as prof, tracker:
        out = torch.mm(a, b)
    cpu = torch.autograd.DeviceType.CPU
    running = peak = 0
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if event.name() == "[memory]" and event.device_type() == cpu:
            running += event.nbytes()
            peak = max(peak, running)
    assert peak > out.nbytes  # the kernel allocated more than its output
    assert tracker.peak - (a.nbytes + b.nbytes) == peak, (tracker.peak, peak)


class _Dispatched(torch.utils._python_dispatch.TorchDispatchMode):
    """Every operator that reaches the dispatcher beneath the tracker (what the live hook runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not _onednn_bf16(), reason="bf16 products run ATen's BLAS fallback here: no workspace")
def test_a_watched_product_is_measured_on_its_own_call_and_allocates_nothing_more() -> None:
    """The live hook, on a layout never measured: the one product the step asked for runs, once, and
    nothing else (a probe on copies inside the step ran ``empty_strided``/``zero_`` and a second product,
    holding up to 2 x 64 MiB next to the step's live set); its workspace is the probe's figure."""
    from hf_memwatch.integration.session import live_backend

    a, b = torch.randn(256, 192).bfloat16().t(), torch.randn(256, 320).bfloat16()
    kw._GEMM_WORKSPACES.clear()
    tracker = live_backend(torch.device("cpu")).tracker
    tracker.register([a, b])
    tracker.reset_peak()
    with _Dispatched() as beneath, tracker:
        out = torch.mm(a, b)
    assert beneath.ops == [MM], beneath.ops
    measured = tracker.peak - (a.nbytes + b.nbytes + out.nbytes)
    assert measured > 0
    assert list(kw._GEMM_WORKSPACES.values()) == [measured]
    kw._GEMM_WORKSPACES.clear()
    assert kw._probe_gemm(MM, (a, b), {}) == measured


_RSS_SCRIPT = """
import sys
import torch
from hf_memwatch.integration.session import live_backend
a = torch.randn(2048, 2048, dtype=torch.bfloat16).t()  # transposed: oneDNN repacks it
b = torch.randn(2048, 4096, dtype=torch.bfloat16)
tracker = live_backend(torch.device("cpu")).tracker
tracker.register([a, b])
with tracker:  # the mode's first entry and the profiler's first start, in both runs
    torch.ones(3) + 1
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
    torch.mm(torch.ones(64, 64, dtype=torch.bfloat16), torch.ones(64, 64, dtype=torch.bfloat16))
def status(key):  # kB
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set (VmHWM) reset to the current one
before = status("VmRSS")
if sys.argv[1] == "watched":
    with tracker:
        out = torch.mm(a, b)
else:
    out = torch.mm(a, b)
print((status("VmHWM") - before) * 1024)
"""


@pytest.mark.skipif(not _onednn_bf16() or not os.path.exists("/proc/self/clear_refs"),
                    reason="no oneDNN bf16 product here, or no resettable peak resident set (Linux)")
def test_a_watched_product_raises_the_process_peak_no_higher_than_the_unwatched_one() -> None:
    """The operating system's peak resident set (``VmHWM``, reset before the step) of one
    2048 x 2048 x 4096 bf16 product (24 MiB of operands, a 16 MiB output), watched for the first time
    vs unwatched, each in a fresh process: measured a rise of 19,906,560 vs 19,959,808 B; with the
    probe on copies inside the step 62,074,880 vs 20,148,224 B (its copies and second output next to
    the step's own)."""
    def peak_rise(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, mode], capture_output=True, text=True,
                              env=dict(os.environ), timeout=300, check=True)
        return int(done.stdout.split()[-1])

    unwatched, watched = peak_rise("plain"), peak_rise("watched")
    assert unwatched > 16 * 2**20  # the product's output, at least: the measure sees the step
    assert watched - unwatched < 4 * 2**20, (watched, unwatched)
