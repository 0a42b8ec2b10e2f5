"""The bf16/fp16 CPU GEMM workspace without a probe, checked against the probe on Qwen3-4B's shapes.

``kernel_workspaces.gemm_cpu_workspace`` skips the real profiler probe where ATen does not send the
product to oneDNN and both matrices are row- or column-major (the rule: 0 bytes). This script runs
the real probe (``_probe_gemm``, its 64 MiB operand cap lifted) on the products of a Qwen3-4B layer
(hidden 2560, q 4096, k/v 1024, MLP 9728; forward, input gradient and weight gradient, as the
backward lays them out) at 512, 2048 and 4096 tokens, plus layouts the rule must still probe (a
strided matrix, a permuted batch), and prints the rule's figure next to the probe's and the
probe's wall time.

Usage: ``python benchmarks/gemm_workspace_rule.py [--tokens 512,2048,4096] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from hf_memwatch.estimation import kernel_workspaces as kw

MM = torch.ops.aten.mm.default
BMM = torch.ops.aten.bmm.default
# (name, in features, out features) of a Qwen3-4B decoder layer's linear layers
LAYERS = [("q_proj", 2560, 4096), ("k_proj", 2560, 1024), ("o_proj", 4096, 2560), ("gate_proj", 2560, 9728),
          ("down_proj", 9728, 2560)]
# the layers run at each length: a 512 x 2560 x 9728 bf16 product takes 10-40 s on a loaded 2-core CPU
# without AVX-512 (the fallback kernel), so the longer lengths run the smallest layer
RUN = {512: ("k_proj", "o_proj", "gate_proj"), 2048: ("k_proj",), 4096: ("k_proj",)}


def layer_products(tokens: int, dtype: torch.dtype) -> list[tuple[str, object, tuple]]:
    """(label, op, operands) of each linear layer's forward, input-gradient and weight-gradient mm."""
    out = []
    for name, fan_in, fan_out in LAYERS:
        if name not in RUN.get(tokens, ()):
            continue
        x, weight = torch.empty(tokens, fan_in, dtype=dtype), torch.empty(fan_out, fan_in, dtype=dtype)
        grad = torch.empty(tokens, fan_out, dtype=dtype)
        out += [(f"{name} forward {tokens} x {fan_in} @ W.T", MM, (x, weight.t())),
                (f"{name} grad input {tokens} x {fan_out} @ W", MM, (grad, weight)),
                (f"{name} grad weight grad.T @ x ({fan_out} x {tokens} x {fan_in})", MM, (grad.t(), x))]
    return out


def odd_layouts(dtype: torch.dtype) -> list[tuple[str, object, tuple]]:
    wide = torch.empty(512, 1280, dtype=dtype)
    return [("strided matrix (512 x 640, column stride 2) @ 640 x 256", MM,
             (wide[:, ::2], torch.empty(640, 256, dtype=dtype))),
            ("bmm, permuted batch (32 x 128 x 64) @ (32 x 64 x 128)", BMM,
             (torch.empty(128, 32, 64, dtype=dtype).transpose(0, 1), torch.empty(32, 128, 64, dtype=dtype).mT))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="512,2048,4096")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    kw.GEMM_PROBE_MAX_BYTES = 2**40  # the truth at every size
    cases = [c for t in args.tokens.split(",") for c in layer_products(int(t), torch.bfloat16)]
    cases += odd_layouts(torch.bfloat16) + odd_layouts(torch.float16)
    lines = ["# bf16/fp16 CPU GEMM workspace: the rule against the real probe", "",
             f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
             f"{torch.get_num_threads()} threads; oneDNN for bf16: {kw.onednn_gemm(torch.bfloat16)}, for fp16: "
             f"{kw.onednn_gemm(torch.float16)}; load average {os.getloadavg()[0]:.1f} at the start. "
             "`python benchmarks/gemm_workspace_rule.py`", "",
             "| product | dtype | rule: bytes (probe skipped?) | real probe: bytes | probe wall s |",
             "|---|---|---:|---:|---:|"]
    worst = 0
    for label, op, operands in cases:
        dtype = operands[0].dtype
        skipped = not kw.onednn_gemm(dtype) and all(kw.blas_ready(t) for t in operands)
        kw._GEMM_WORKSPACES.clear()
        rule = kw.gemm_cpu_workspace(op, operands, {})
        start = time.perf_counter()
        truth = kw._probe_gemm(op, operands, {})
        wall = time.perf_counter() - start
        worst = max(worst, abs(rule - truth))
        lines.append(f"| {label} | {str(dtype)[6:]} | {rule:,} ({'skipped' if skipped else 'probed'}) | {truth:,} "
                     f"| {wall:.2f} |")
        print(lines[-1], flush=True)
    lines += ["", f"Largest difference, rule vs probe: {worst:,} bytes over {len(cases)} products."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
