"""TRL's Online DPO (completions sampled inside the step, scored by a reward model, a reference model):
``estimate(trainer)`` agrees with PyTorch's own accounting.

Its log-probabilities are ``logits[:, prompt - 1:-1].log_softmax(-1)``: a strided slice, which ATen's
CPU softmax kernel copies to a contiguous buffer inside itself, invisible to dispatch; without that
copy the estimate was 3.98% under the profiler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_trl_online import prompts, resident, reward_model

from hf_memwatch import estimate
from hf_memwatch.testing.tokenizers import word_tokenizer
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak


def online_dpo(out: Path) -> Any:
    from test_equivalence import llama
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    tokenizer = word_tokenizer()
    args = OnlineDPOConfig(output_dir=str(out), per_device_train_batch_size=4, max_new_tokens=8, max_steps=2,
                           logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                           dataloader_num_workers=0)
    return OnlineDPOTrainer(model=llama(), ref_model=llama(seed=1), reward_funcs=[reward_model()], args=args,
                            train_dataset=prompts(), processing_class=tokenizer, reward_processing_classes=[tokenizer])


def test_online_dpo_estimate_counts_the_softmax_kernels_copy(tmp_path: Path) -> None:
    trainer = online_dpo(tmp_path)
    predicted = estimate(trainer)
    with cpu_memory_profile() as prof:
        trainer.train()
    truth = window_peak(prof, resident(trainer))
    assert abs(predicted.peak_bytes - truth) <= 0.005 * truth, (predicted.peak_bytes, truth)
