"""Start fast: ``hf-memwatch estimate CONFIG`` imports only what the request needs, probes no GEMM it can rule.

One fresh process runs the CLI on a bf16 ``config.json`` (a tiny Qwen3, as Qwen3-4B's says
``torch_dtype: bfloat16``), then ``estimate()`` on a config object, and reports which optional heavy modules it loaded and how many bf16 GEMM
workspace probes it ran. No timing: the figures are in ``benchmarks/results/start_fast.md``.

Not asserted, because torch or transformers import them for every estimate (measured, see the
benchmark): ``torch._dynamo`` (``FakeTensorMode.__init__``; and ``transformers.modeling_utils``
through ``@torch.compiler.disable`` at import), ``torch.distributed.tensor`` (through Dynamo, and
transformers' ``distributed.checkpoint``), ``scipy`` (transformers' object-detection losses).
"""

from __future__ import annotations

import json
import subprocess
import sys

# imported by paths a plain config estimate does not take (the Trainer, PEFT, quantization, engines)
HEAVY = ("transformers.trainer", "transformers.training_args", "peft", "bitsandbytes", "deepspeed", "trl",
         "datasets", "torch.utils.tensorboard", "wandb", "matplotlib")

CODE = r"""
import contextlib, io, json, sys
from hf_memwatch.cli.main import main
from hf_memwatch.estimation import kernel_workspaces as kw
import torch
from transformers import GPT2Config
from hf_memwatch import estimate
with contextlib.redirect_stdout(io.StringIO()):
    status = main(["estimate", sys.argv[1], "--micro-batch-size", "2", "--seq-len", "64"])
estimate(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100), micro_batch_size=1, seq_len=8)  # the Python API
print(json.dumps({"status": status, "heavy": [m for m in json.loads(sys.argv[2]) if m in sys.modules],
                  "probes": len(kw._GEMM_WORKSPACES), "onednn": kw.onednn_gemm(torch.bfloat16)}))
"""


def test_the_cli_on_a_bf16_config_imports_no_heavy_path_and_probes_what_it_must(tmp_path):
    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
                  torch_dtype="bfloat16", tie_word_embeddings=True)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-c", CODE, str(path), json.dumps(HEAVY)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["status"] == 0
    assert result["heavy"] == [], f"the estimate path imported {result['heavy']}"
    if not result["onednn"]:  # ATen's BLAS fallback: every GEMM of this model is ruled, none probed
        assert result["probes"] == 0
