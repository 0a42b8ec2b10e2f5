"""``benchmarks/cuda_published.py`` (issue #32, point 5): its table of published CUDA measurements is
well-formed, and one cheap case runs end to end. Not the accuracy goal: the figures are in
``benchmarks/results/cuda_published.md``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import benchmark_script

from hf_memwatch.core.gpus import gpu_spec
from hf_memwatch.core.optimizers import SUPPORTED_OPTIMS
from hf_memwatch.estimation.request import PRECISIONS, TASKS


@pytest.fixture(scope="module")
def bench():
    return benchmark_script("cuda_published")


def test_cases_are_well_formed(bench):
    cases = bench.CASES
    assert len(cases) >= 8 and len({c.source for c in cases}) >= 3
    assert len({c.key for c in cases}) == len(cases)
    for case in cases:
        assert case.source and case.model and case.versions and case.settings and case.explanation, case.key
        assert gpu_spec(case.gpu).name == case.gpu, case.key
        assert case.kind in bench.KINDS and case.loop in bench.LOOPS, case.key
        assert case.task in TASKS and case.precision in PRECISIONS, case.key
        assert case.optim is None or case.optim in SUPPORTED_OPTIMS, case.key
        assert case.batch > 0 and case.seq > 0 and case.accum > 0 and case.measured > 0, case.key
        assert case.attn in ("eager", "sdpa"), case.key
        # a published context only beside a device-wide figure; the script protocol has no optimizer
        assert case.context is None or case.kind == "nvidia-smi", case.key
        assert (case.loop == "logits_sum") == (case.optim is None), case.key
        bench.explanation(case)  # its computed terms format


def test_models_take_the_runs_attention(bench):
    """The builders give the attention implementation each run used (eager before BERT had SDPA)."""
    for case in {c.attn + c.loop: c for c in bench.CASES}.values():
        if case.loop == "logits_sum":
            model = bench.logits_sum_model(case).inner
            assert next(model.parameters()).dtype == torch.float16
        else:
            from hf_memwatch.estimation.fake_model import auto_class

            with torch.device("meta"):
                model = auto_class(case.task).from_config(bench.build_config(case))
        assert model.config._attn_implementation == case.attn, case.key


def test_like_for_like_basis(bench):
    """Each kind is compared with its own figure; a published context is added to the reserve."""
    est = type("Est", (), {"peak_bytes": 100, "reserved_bytes": 120, "device_bytes": None})()
    by_kind = {c.kind: c for c in bench.CASES}
    assert bench.compare(by_kind["allocated"], est, 0.0).predicted == 100
    smi = next(c for c in bench.CASES if c.kind == "nvidia-smi" and c.context is not None)
    assert bench.compare(smi, est, 0.0).predicted == 120 + smi.context
    without = bench.Case(**{**smi.__dict__, "context": None})
    assert bench.compare(without, est, 0.0).basis == "reserved (context unknown)"
    est.device_bytes = 500
    assert bench.compare(without, est, 0.0).predicted == 500


def test_one_case_end_to_end(bench, tmp_path):
    """The cheapest case through estimate(device="cuda") and the report, as `make bench` runs it."""
    out = tmp_path / "cuda_published.md"
    assert bench.main(["--only", "distilbert-sdpa-eager-4x256", "--out", str(out)]) == 0
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `distilbert-sdpa-eager-4x256`"))
    assert "594 MB" in row and "peak allocated" in row and "%" in row


def test_neox_as_4_42_ran_it(bench):
    """The NeoX cases replay 4.42's data flow: fp32 rotary buffers make the cached key fp32, the cached value
    is a view that keeps the whole fused qkv output, and each layer holds its 2048-wide bool causal mask;
    LogitsSum keeps the logits and every layer's present as the script's ``outputs`` does."""
    from cuda_published_models import gpt_neox_4_42
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, rotary_pct=0.25, max_position_embeddings=16)
    for attn in ("sdpa", "eager"):
        config._attn_implementation = attn
        model = GPTNeoXForCausalLM(config).to(torch.float16)
        step = bench.LogitsSum(model, gpt_neox_4_42(model, attn))
        ids = torch.randint(0, 64, (2, 8))
        step(input_ids=ids)["loss"].backward()
        logits, *presents = step.held
        assert logits.shape == (2, 8, 64) and len(presents) == 2
        key, value = presents[0]
        assert key.dtype == torch.float32 and key.shape == (2, 4, 8, 8)
        assert value.dtype == torch.float16 and value.untyped_storage().nbytes() == 2 * 8 * 3 * 32 * 2
        assert model.gpt_neox.layers[0].attention.bias.shape == (1, 1, 16, 16)


def test_trainer_4_16_keeps_the_gradients(bench):
    """The 2022 cases replay 4.16's ``model.zero_grad()`` on torch 1.10 (set_to_none=False): inside
    ``gradients_kept`` the replay's ``zero_grad(set_to_none=True)`` zeroes in place; torch's own is back after."""
    from cuda_published_models import gradients_kept

    assert {c.modelling for c in bench.CASES if c.loop == "trainer" and c.source == bench.PERF_GUIDE} == \
        {bench.TRAINER_4_16}
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters())
    for owner in (layer, optimizer):
        layer(torch.ones(1, 2)).sum().backward()
        with gradients_kept():
            owner.zero_grad(set_to_none=True)
        assert layer.weight.grad is not None and not layer.weight.grad.any()
        owner.zero_grad(set_to_none=True)
        assert layer.weight.grad is None


def test_torch_1_10_softmax_saves_its_input(bench):
    """torch 1.10's softmax node saved its input beside its output (2.13's saves the output only): inside
    ``softmax_keeps_input`` autograd packs both, through saved-tensor hooks a checkpoint would drop."""
    from cuda_published_models import softmax_keeps_input

    def saved(softmax_call):
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
            out = softmax_call()
        out.pow(2).sum().backward()
        return len(packed)

    x = torch.randn(2, 3, 4, requires_grad=True)
    assert saved(lambda: torch.nn.functional.softmax(x, dim=-1)) == 1
    grad_2_13, x.grad = x.grad, None
    with softmax_keeps_input():
        assert saved(lambda: torch.nn.functional.softmax(x, dim=-1)) == 2
    assert torch.allclose(x.grad, grad_2_13, atol=1e-6)  # the same gradient
    assert saved(lambda: torch.nn.functional.softmax(x, dim=-1)) == 1  # torch's own back


def test_2022_adamw_steps_per_parameter(bench):
    """4.16's AdamW looped over the parameters: inside ``per_parameter_adamw`` the replay's foreach=True
    AdamW is built single-tensor; torch's own constructor is back after."""
    from cuda_published_models import per_parameter_adamw

    params = [torch.nn.Parameter(torch.ones(2))]
    with per_parameter_adamw():
        assert torch.optim.AdamW(params, foreach=True).defaults["foreach"] is False
    assert torch.optim.AdamW(params, foreach=True).defaults["foreach"] is True


def test_the_device_total_subset_is_summarized(bench):
    """The summary names the device-wide cases (reserved or nvidia-smi) apart: cases, sources, median, worst."""
    by_kind = {c.kind: c for c in bench.CASES}
    smi, allocated = by_kind["nvidia-smi"], by_kind["allocated"]
    other = bench.Case(**{**smi.__dict__, "key": "other", "source": "another source"})
    rows = [bench.Row(case, 1, "", error, None, None, None, 0.0)
            for case, error in ((smi, -2.0), (other, 4.0), (allocated, 30.0))]
    line = next(line for line in bench.summary(rows) if line.startswith("- device total"))
    assert line == "- device total (reserved or nvidia-smi): 2 cases, 2 sources, median |error| 3.0%, worst +4.0%"


def test_2023_rerun_replays_its_adamw_per_parameter(bench):
    """The RTX 3090 rerun's AdamW cases run under per_parameter_adamw (transformers 4.30's adamw_hf), and only them."""
    rerun = [c for c in bench.CASES if c.key.startswith("3090-")]
    assert len(rerun) >= 8 and all(c.kind == "nvidia-smi" and c.context == 1276 * bench.MiB for c in rerun)
    assert {c.modelling for c in rerun if c.optim == "adamw_torch"} == {bench.TRAINER_4_30}
    assert {c.modelling for c in rerun if c.optim != "adamw_torch"} == {""}


def test_4_48_causal_lm_loss(bench):
    """[F]'s runs used 4.48's ForCausalLMLoss: the same loss as 5.23's, through a contiguous fp32 copy of the
    shifted logits (one more logits-size fp32 tensor than 5.23 makes); swapped in for the duration only."""
    from cuda_published_models import LOSS_4_48, causal_lm_loss_4_48
    from transformers.loss.loss_utils import LOSS_MAPPING

    assert {c.modelling for c in bench.CASES if c.key.startswith("fms-")} == {LOSS_4_48}
    today = LOSS_MAPPING["ForCausalLM"]
    logits = torch.randn(2, 6, 11, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (2, 6))
    with causal_lm_loss_4_48():
        old = LOSS_MAPPING["ForCausalLM"]
        assert old is not today
        loss = old(logits, labels, vocab_size=11)
    assert LOSS_MAPPING["ForCausalLM"] is today
    torch.testing.assert_close(loss, today(logits, labels, vocab_size=11))

    def logits_copies(fn):
        with torch.profiler.profile(record_shapes=True) as prof:
            fn(logits, labels, vocab_size=11)
        return [e for e in prof.events() if e.name == "aten::clone" and [2, 5, 11] in e.input_shapes]

    assert logits_copies(old) and not logits_copies(today)
