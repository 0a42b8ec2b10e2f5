"""Generation-based prediction (``Seq2SeqTrainer`` with ``predict_with_generate``): predicted and watched."""

from __future__ import annotations

import json

import torch
from conftest import gpt2_model, read_records, token_dataset
from transformers import BartConfig, BartForConditionalGeneration, Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_memwatch import MemWatch
from hf_memwatch.estimation import estimate, estimate_eval
from hf_memwatch.estimation.generation import GenerationSettings
from hf_memwatch.testing.estimate_truth import ListDataset, evaluate_peak


def _bart() -> BartForConditionalGeneration:
    torch.manual_seed(0)
    return BartForConditionalGeneration(BartConfig(
        d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=500, max_position_embeddings=128,
        decoder_start_token_id=2, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def test_generate_estimate_within_2_percent_of_a_real_seq2seq_evaluate():
    """Beam search to generation_max_length: the KV cache of max length x beams, the beams' bookkeeping, the
    generated tokens and padded labels kept by the loop. Without generation modelled the estimate is far off."""
    model = _bart()
    loop = dict(eval_batch_size=4, eval_samples=8, seq_len=12, seq2seq_target_len=8)
    predicted = estimate_eval(model, **loop, predict_with_generate=True, generation_max_length=20,
                              generation_num_beams=2)
    truth = evaluate_peak(model, task="seq2seq", batch_size=4, samples=8, seq_len=12, target_len=8,
                          generation=GenerationSettings(max_length=20, num_beams=2))
    assert abs(predicted.peak_bytes - truth) / truth <= 0.02, (predicted, truth)
    assert sum(predicted.classes.values()) == predicted.peak_bytes
    assert not any("not modelled" in note for note in predicted.notes)
    assert any("predict_with_generate" in note for note in predicted.notes)
    forward_only = estimate_eval(model, **loop)  # the loop as modelled before: the forward with labels
    assert abs(forward_only.peak_bytes - truth) / truth > 0.05


def test_generation_settings_come_from_the_trainer_and_the_cli_and_the_watch_sees_the_tokens(tmp_path, capsys):
    """Decoder-only greedy generation: ``estimate(trainer)`` reads Seq2SeqTrainingArguments, the CLI flags give the
    same figure, and the live eval record counts the generated tokens as outputs (prompt length kept)."""
    from hf_memwatch.cli.main import main

    model = gpt2_model(n_layer=1, n_embd=32, vocab=500)
    model.config.save_pretrained(tmp_path / "model")  # before the Trainer sets config.use_cache
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_eval_batch_size=4, predict_with_generate=True,
        generation_max_length=24, generation_num_beams=1, report_to=[], use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0)
    watch = MemWatch(detail="full", report=False, summary=False)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=token_dataset(8, 8, 500), callbacks=[watch])
    loop = dict(micro_batch_size=2, seq_len=8, eval_batch_size=4, eval_samples=8)
    from_trainer = estimate(trainer, **loop)
    given = estimate(model, **loop, predict_with_generate=True, generation_max_length=24)
    assert from_trainer.config["generation"] == {"max_length": 24, "num_beams": 1}  # read from the arguments
    assert from_trainer.eval_peak_bytes == given.eval_peak_bytes

    assert main(["estimate", str(tmp_path / "model"), "--micro-batch-size", "2", "--seq-len", "8", "--eval-batch-size", "4",
                 "--eval-samples", "8", "--predict-with-generate", "--generation-max-length", "24", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["eval_peak_bytes"] == given.eval_peak_bytes

    prompts = ListDataset([{"input_ids": row["input_ids"]} for row in token_dataset(8, 8, 500, seed=1).rows])
    model.generation_config.eos_token_id = None  # generate to the max length
    output = trainer.predict(prompts)
    (record,) = [r for r in read_records(tmp_path / "run") if r["event"] == "eval"]
    assert output.predictions.shape == (8, 24)
    assert record["stage"] == "predict" and record["outputs"] >= output.predictions.nbytes
    # No labels, so no loss forward after generate: the model's last call was a decoding step of one token.
    assert watch.last_seq_len == 8  # the prompt's length
