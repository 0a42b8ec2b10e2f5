"""Tiny configs of the decoder and encoder families transformers ships, for accuracy checks.

Every family builds in well under a second on a CPU (hidden 64, 2 layers, vocabulary 1000) and
runs a real ``Trainer`` step in about one; ``benchmarks/accuracy.py`` measures the estimator on
each against the profiler, ``tests/test_estimate.py`` on a handful.

Usage:
    >>> task, make_config = FAMILIES["gpt_neox"]      # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_config(make_config())   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SPECIAL = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
VOCAB = 1000
# the keyword names Llama-style configs share (Mistral, Qwen2, Phi-3, Gemma, OLMo, StableLM, ...)
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, **SPECIAL)
ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               vocab_size=VOCAB, pad_token_id=0)


def _config(name: str, **kwargs: Any) -> Callable[[], Any]:
    """A factory of ``transformers.<name>(**kwargs)`` (the import waits until it is called)."""

    def make() -> Any:
        import transformers

        return getattr(transformers, name)(**kwargs)

    return make


FAMILIES: dict[str, tuple[str, Callable[[], Any]]] = {
    # causal LMs: rotary, ALiBi, learned positions; fused and separate QKV; MHA, GQA, MQA
    "gpt_neox": ("causal-lm", _config("GPTNeoXConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=VOCAB, **SPECIAL)),
    "phi3": ("causal-lm", _config("Phi3Config", **LLAMA_LIKE)),
    "phi": ("causal-lm", _config("PhiConfig", **LLAMA_LIKE)),
    "opt": ("causal-lm", _config("OPTConfig", hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                 word_embed_proj_dim=64, max_position_embeddings=512, vocab_size=VOCAB, **SPECIAL)),
    "falcon": ("causal-lm", _config("FalconConfig", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    vocab_size=VOCAB, **SPECIAL)),
    "gemma": ("causal-lm", _config("GemmaConfig", head_dim=16, **LLAMA_LIKE)),
    "gemma2": ("causal-lm", _config("Gemma2Config", head_dim=16, **LLAMA_LIKE)),
    "gemma3_text": ("causal-lm", _config("Gemma3TextConfig", head_dim=16, **LLAMA_LIKE)),
    "bloom": ("causal-lm", _config("BloomConfig", hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB, **SPECIAL)),
    "gptj": ("causal-lm", _config("GPTJConfig", n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=512,
                                  vocab_size=VOCAB, **SPECIAL)),
    "gpt_neo": ("causal-lm", _config("GPTNeoConfig", hidden_size=64, num_layers=2, num_heads=4,
                                     attention_types=[[["global", "local"], 1]], max_position_embeddings=512,
                                     vocab_size=VOCAB, **SPECIAL)),
    "codegen": ("causal-lm", _config("CodeGenConfig", n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=512,
                                     n_ctx=512, vocab_size=VOCAB, **SPECIAL)),
    "gpt_bigcode": ("causal-lm", _config("GPTBigCodeConfig", n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                         vocab_size=VOCAB, **SPECIAL)),
    "mpt": ("causal-lm", _config("MptConfig", d_model=64, n_heads=4, n_layers=2, max_seq_len=512, vocab_size=VOCAB,
                                 **SPECIAL)),
    "stablelm": ("causal-lm", _config("StableLmConfig", **LLAMA_LIKE)),
    "mistral": ("causal-lm", _config("MistralConfig", **LLAMA_LIKE)),
    "qwen2": ("causal-lm", _config("Qwen2Config", **LLAMA_LIKE)),
    "olmo": ("causal-lm", _config("OlmoConfig", **LLAMA_LIKE)),
    "olmo2": ("causal-lm", _config("Olmo2Config", **LLAMA_LIKE)),
    "starcoder2": ("causal-lm", _config("Starcoder2Config", **LLAMA_LIKE)),
    # mixtures of experts
    "mixtral": ("causal-lm", _config("MixtralConfig", num_local_experts=4, num_experts_per_tok=2, **LLAMA_LIKE)),
    "qwen2_moe": ("causal-lm", _config("Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                       shared_expert_intermediate_size=64, **LLAMA_LIKE)),
    # encoders
    "distilbert": ("seq-cls", _config("DistilBertConfig", dim=64, hidden_dim=128, n_layers=2, n_heads=4,
                                      vocab_size=VOCAB, pad_token_id=0)),
    "electra": ("masked-lm", _config("ElectraConfig", embedding_size=32, **ENCODER)),
    "albert": ("seq-cls", _config("AlbertConfig", embedding_size=32, **ENCODER)),
    "deberta_v2": ("seq-cls", _config("DebertaV2Config", **ENCODER)),
    "xlm_roberta": ("masked-lm", _config("XLMRobertaConfig", max_position_embeddings=520,
                                         **{**ENCODER, "bos_token_id": 0, "eos_token_id": 0})),
}

# families whose model class refuses activation checkpointing (the real Trainer raises too)
NO_CHECKPOINTING = frozenset({"albert"})


def build_family_model(name: str) -> Any:
    """A randomly initialised model of family ``name`` for its task (seed 0)."""
    import torch

    from ..estimation.fake_model import auto_class

    task, make_config = FAMILIES[name]
    torch.manual_seed(0)
    return auto_class(task).from_config(make_config())
