"""The CPU target's estimates, byte for byte: a golden file that CUDA-side work must leave unchanged.

A CUDA target's replay differs from a CPU target's by design (CUDA's autocast lists, kernels,
optimizer implementations, allocator); a CPU target's figures are checked against the profiler
(``benchmarks/accuracy.py``) and must not move when the CUDA side changes. This writes, or checks,
the estimate of every case of the accuracy benchmark's zoo (``accuracy.cases()``: 7 architectures x 5
settings) on a CPU target: peak, peak phase, the split at the peak and the phase peaks.

Run: ``python benchmarks/cpu_golden.py --check`` (about a minute on 2 cores; exit 1 on any difference),
``--write`` after a change that is meant to move a CPU figure (and say why in the commit).
``tests/test_cpu_golden.py`` checks the first case of each architecture in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# oneDNN blocks a bf16 product by the CPU's instruction set, and the estimate probes that blocking
# (``kernel_workspaces.gemm_cpu_workspace``): on a host with AMX (``amx_bf16``) two bf16 backward phases
# differ from an AVX-512-BF16 host's, -24,064 B (bert b2 s128 adamw_bnb_8bit) and +35,584 B (llama b1 s64
# sgd, its peak 4,710,292 -> 4,745,876 B); capped at AVX-512 without BF16 they differ again (+31,104 B,
# +128,128 B). Both are right on their host (each probe is a real run). The golden file was written on an
# AVX512_CORE_BF16 host: its checks cap oneDNN there (read at oneDNN's first primitive, so before any
# product runs; ``tests/conftest.py`` sets it for the suite), and hold on any host that has that ISA.
ONEDNN_ISA = "AVX512_CORE_BF16"
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_ISA)

import torch  # noqa: E402
from accuracy import ZOO, cases  # noqa: E402

from hf_memwatch.estimation.estimate import estimate  # noqa: E402
from hf_memwatch.estimation.fake_model import auto_class  # noqa: E402

GOLDEN = Path(__file__).parents[1] / "tests" / "data" / "cpu_estimates.json"
# A CPU target's estimate depends on torch's thread count (the CPU flash-attention kernel's per-thread
# buffers, kernel_workspaces.sdpa_cpu_workspace): the golden file was written at 2 threads.
THREADS = 2


def case_key(case: dict) -> str:
    """One case's name in the golden file."""
    return (f"{case['name']} b{case['batch_size']} s{case['seq_len']} {case['precision']} "
            f"{'ckpt' if case['checkpointing'] else 'nockpt'} {case['optim']}")


def figures(case: dict) -> dict:
    """The CPU target's estimate of ``case``: what the golden file keeps."""
    task, make_config = ZOO[case["name"]]
    config = make_config()
    model = auto_class(task).from_config(config)
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.set_num_threads(THREADS)
        try:
            e = estimate(model, task=task, seq2seq_target_len=case["target_len"],
                         micro_batch_size=case["batch_size"], seq_len=case["seq_len"], precision=case["precision"],
                         activation_checkpointing=case["checkpointing"], optim=case["optim"], device="cpu")
        finally:
            torch.set_num_threads(threads)
    return dict(peak_bytes=e.peak_bytes, peak_phase=e.peak_phase, classes=e.classes, phase_peaks=e.phase_peaks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="compare with the golden file (the default)")
    action.add_argument("--write", action="store_true", help="write the golden file instead of checking it")
    args = parser.parse_args()
    got = {case_key(case): figures(case) for case in cases()}
    if args.write:
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(got)} cases to {GOLDEN}")
        return 0
    want = json.loads(GOLDEN.read_text())
    differ = [key for key in want if got.get(key) != want[key]]
    for key in differ:
        print(f"DIFFERS {key}: golden {want[key]['peak_bytes']:,} now {got[key]['peak_bytes']:,}")
    print(f"{len(want) - len(differ)} of {len(want)} CPU estimates byte-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
