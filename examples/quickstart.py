import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from hf_memwatch import MemWatch

model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0))
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 1000, (64, 128))]
args = TrainingArguments("quickstart-output", max_steps=4, per_device_train_batch_size=8, use_cpu=True,
                         report_to=[], disable_tqdm=True, logging_steps=4, save_strategy="no")
Trainer(model=model, args=args, train_dataset=data, callbacks=[MemWatch()]).train()
