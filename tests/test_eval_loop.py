"""hf_memwatch.estimation.eval_loop: what the replayed containers hold, with and without flushing."""

from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import GPT2Config

from hf_memwatch.estimation.eval_loop import EVAL_CLASSES, EvalInputs, simulate_eval
from hf_memwatch.estimation.fake_model import fake_model
from hf_memwatch.estimation.request import EstimateRequest

CFG = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
SAMPLES, BATCH, SEQ = 12, 2, 16


def _simulate(**changes):
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, config, task = fake_model(CFG, None, fake_mode)
    request = EstimateRequest(seq_len=SEQ, task=task, eval_batch_size=BATCH, eval_samples=SAMPLES,
                              **changes).resolved(None)
    return simulate_eval(model, fake_mode, request, EvalInputs(config=config))


def test_without_accumulation_steps_every_logit_stays_until_the_gather():
    loop = _simulate()
    assert list(loop.classes) == list(EVAL_CLASSES)
    assert loop.peak_bytes == sum(loop.classes.values())
    assert loop.host_bytes == 0  # nothing left torch memory
    every_logit = SAMPLES * SEQ * CFG.vocab_size * 4  # fp32 logits of the whole loop, concatenated
    assert loop.classes["outputs"] >= every_logit


def test_flushing_moves_outputs_to_the_host_and_lowers_the_peak():
    held = _simulate()
    flushed = _simulate(eval_accumulation_steps=2)
    assert flushed.host_bytes > 0 and any("numpy memory" in note for note in flushed.notes)
    assert flushed.classes["outputs"] < held.classes["outputs"]
    assert flushed.peak_bytes < held.peak_bytes
