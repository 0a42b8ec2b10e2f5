"""A word-level tokenizer built in memory (no hub): ``w0 … w{n-1}`` plus ``[PAD]`` and ``[EOS]``, for
TRL trainers in tests and benchmarks."""

from __future__ import annotations

from typing import Any


def word_tokenizer(words: int = 1000) -> Any:
    """A ``PreTrainedTokenizerFast`` over ``w0 … w{words-1}``; ``[PAD]`` is id ``words``, ``[EOS]`` ``words + 1``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(words)}
    vocab.update({"[PAD]": words, "[EOS]": words + 1})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", eos_token="[EOS]")


def byte_level_tokenizer(words: int = 1000) -> Any:
    """A ByteLevel BPE ``PreTrainedTokenizerFast`` (GPT-2 style: the 256-byte alphabet, no merges) with
    ``[PAD]`` id ``words`` and ``[EOS]`` ``words + 1``, ids below ``words + 2`` (GOLD's cross-tokenizer
    loss accepts only ByteLevel tokenizers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    vocab.update({"[PAD]": words, "[EOS]": words + 1})
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", eos_token="[EOS]")
