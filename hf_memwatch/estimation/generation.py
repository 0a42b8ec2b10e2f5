"""Generation-based prediction (``Seq2SeqTrainer`` with ``predict_with_generate``), replayed on a fake model.

:func:`generation_prediction_step` mirrors ``Seq2SeqTrainer.prediction_step`` (transformers 5.x) on the
generate path: the model's own ``generate()`` runs on fake tensors (the encoder pass, the prefill,
every decoding step with the KV cache growing by ``torch.cat`` — old and new cache briefly together —,
the beams' bookkeeping and cache reordering), the generated tokens are padded to the generation
config's ``max_length`` when shorter, the loss forward with labels runs while they are held, and the
labels are padded as the Trainer pads them.

Generation on fake tensors has no values, so its data-dependent decisions are answered with the
worst case for memory, as a run whose sequences never end early (no EOS) has them:

* the decoding loop runs until ``max_length`` (``generation_max_length``): the loop's guard
  (``GenerationMixin._has_unfinished_sequences``) is answered per call, on this fake copy only,
  from the number of tokens still to generate;
* values read back from tensors answer as a clean batch's do
  (:meth:`~hf_memwatch.estimation.fake_dispatch.EstimateTracker.reading_a_clean_batch`): an integer (beam
  search's "longest generated beam") is ``max_length``, so every slice it bounds keeps its whole
  length; the validity checks (negative ids, right padding, an all-ones mask) pass.

The batches are full rows without padding (the estimator's assumption everywhere): the attention
mask ``generate`` builds is all ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..compat.generation import default_generation_param as generation_default
from ..compat.generation import replace_loop_guard, restore_loop_guard
from ..core.errors import MemWatchConfigError


@dataclass(frozen=True)
class GenerationSettings:
    """``Seq2SeqTrainingArguments``' generation fields as the estimate uses them.

    ``max_length``: ``generation_max_length`` (None: the model's generation config, else transformers'
    default); ``num_beams``: ``generation_num_beams`` (None: the model's generation config).
    """

    max_length: int | None = None
    num_beams: int | None = None

    def max_length_for(self, model: torch.nn.Module) -> int:
        """The length ``generate`` stops at: the setting, else the model's generation config, else the default."""
        return self.max_length or int(generation_config_value(model, "max_length"))

    def gen_kwargs(self) -> dict[str, Any]:
        """The keywords ``Seq2SeqTrainer.evaluate``/``predict`` hand ``generate`` (``synced_gpus`` off: one rank)."""
        kwargs: dict[str, Any] = {"synced_gpus": False}
        if self.max_length is not None:
            kwargs["max_length"] = self.max_length
        if self.num_beams is not None:
            kwargs["num_beams"] = self.num_beams
        return kwargs


def default_generation_param(name: str) -> Any:
    """transformers' default for a generation field the model's config leaves unset (``max_length``: 20)."""
    # The defaults ``Seq2SeqTrainer.prediction_step`` and ``generate`` apply; one source, transformers'.
    return generation_default(name)


def generation_config_value(model: torch.nn.Module, name: str) -> Any:
    """A field of ``model.generation_config`` with transformers' default when unset."""
    value = getattr(getattr(model, "generation_config", None), name, None)
    return default_generation_param(name) if value is None else value


def check_generation(model: torch.nn.Module, settings: GenerationSettings, seq_len: int) -> None:
    """Fail fast, with one line, where generation cannot run as configured."""
    if not hasattr(model, "generate"):
        raise MemWatchConfigError(f"{type(model).__name__} cannot generate: predict_with_generate needs a generative model")
    for name, value in (("generation_max_length", settings.max_length), ("generation_num_beams", settings.num_beams)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise MemWatchConfigError(f"{name} must be a positive integer; got {value!r}")
    if getattr(model.config, "is_encoder_decoder", False):
        return
    max_length = settings.max_length_for(model)
    if seq_len >= max_length:
        raise MemWatchConfigError(
            f"a decoder-only model generates after its prompt: generation_max_length ({max_length}) must exceed the "
            f"eval sequence length ({seq_len})")


def tokens_to_generate(model: torch.nn.Module, inputs: dict[str, torch.Tensor], settings: GenerationSettings) -> int:
    """Decoding steps until ``max_length``: after the prompt (decoder-only) or the decoder start token."""
    max_length = settings.max_length_for(model)
    start = 1 if getattr(model.config, "is_encoder_decoder", False) else inputs["input_ids"].shape[-1]
    return max(max_length - start, 0)


@contextlib.contextmanager
def generating_to_max_length(model: torch.nn.Module, tracker: Any, steps: int, max_length: int) -> Iterator[None]:
    """Within: ``model.generate`` decodes ``steps`` tokens; read-backs answer as a clean batch's, at ``max_length``.

    The loop guard is replaced on this (fake) instance only: on fake tensors the stopping criteria's
    ``unfinished_sequences.max() == 0`` has no value to read.
    """
    remaining = [steps]

    def has_unfinished_sequences(this_peer_finished: bool, synced_gpus: bool, device: Any) -> bool:
        remaining[0] -= 1
        return remaining[0] >= 0

    from transformers.utils import logging as hf_logging

    replace_loop_guard(model, has_unfinished_sequences)
    verbosity = hf_logging.get_verbosity()
    # generate's advice about the fake batch (a right-padding guess it cannot check) is not the user's
    hf_logging.set_verbosity_error()
    try:
        with tracker.reading_a_clean_batch(max_length):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        restore_loop_guard(model)


def _pad_to(tensor: torch.Tensor, length: int, pad_token_id: int) -> torch.Tensor:
    """``Seq2SeqTrainer._pad_tensors_to_max_len``: the same operators, so the same allocations."""
    padded = pad_token_id * torch.ones((tensor.shape[0], length), dtype=tensor.dtype, device=tensor.device)
    padded[:, : tensor.shape[-1]] = tensor
    return padded


def pad_token_id_of(model: torch.nn.Module) -> int:
    """The id ``Seq2SeqTrainer`` pads generated tokens and labels with (no tokenizer: the model config's)."""
    pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        raise MemWatchConfigError("predict_with_generate pads with the model config's pad_token_id, which is unset")
    return int(pad)


def generation_prediction_step(model: torch.nn.Module, inputs: dict[str, torch.Tensor], tracker: Any,
                               settings: GenerationSettings) -> tuple[Any, torch.Tensor, Any]:
    """``Seq2SeqTrainer.prediction_step`` with ``predict_with_generate``: (loss or None, tokens, labels or None)."""
    has_labels = "labels" in inputs
    # The batches carry no decoder_input_ids, so the Trainer hands generate every input, labels included.
    generation_inputs = dict(inputs)
    steps = tokens_to_generate(model, inputs, settings)
    with generating_to_max_length(model, tracker, steps, settings.max_length_for(model)):
        generated = model.generate(**generation_inputs, **settings.gen_kwargs())
    del generation_inputs
    # The Trainer pads to the *model's* generation config's max_length (not the gen kwargs'), when shorter.
    pad_length = generation_config_value(model, "max_length")
    if generated.shape[-1] < pad_length:
        generated = _pad_to(generated, pad_length, pad_token_id_of(model))
    with torch.no_grad():
        if has_labels:
            outputs = model(**inputs)
            loss = (outputs["loss"] if isinstance(outputs, dict) else outputs[0]).detach().mean()
        else:
            outputs, loss = None, None
    labels = None
    if has_labels:
        labels = inputs["labels"]
        if labels.shape[-1] < pad_length:
            labels = _pad_to(labels, pad_length, pad_token_id_of(model))
    del outputs  # a local of the Trainer's step: it lives until the step returns
    return loss, generated, labels


@dataclass(frozen=True)
class _Layout:
    """Where a returned tensor lives: its storage's size and its view of it (None: the batch's own labels)."""

    numel: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Layout:
        storage = tensor.untyped_storage()
        return cls(storage.nbytes() // tensor.element_size(), tensor.dtype, tuple(tensor.shape),
                   tuple(tensor.stride()), tensor.storage_offset())

    def rebuild(self) -> torch.Tensor:
        """A fresh storage of the same size, viewed the same way (beam search returns a view of its buffer)."""
        return torch.empty(self.numel, dtype=self.dtype).as_strided(self.shape, self.stride, self.offset)


@dataclass
class _StepRecord:
    peak_above_start: int
    loss: _Layout | None
    tokens: _Layout
    labels: _Layout | None
    labels_are_the_batchs: bool


@dataclass
class GenerationReplay:
    """The generation steps of one eval loop: each batch size's step replayed once, later ones repeated.

    A step's memory does not depend on what the loop already holds (the tracker counts storages), so
    a batch of a size already replayed is its record: the returned tensors allocated afresh (same
    storages, same views) and the step's highest bytes above its start as one transient. The peak is
    the replayed one; at it, the returned tensors count as ``other`` and the rest of the step as
    ``temporaries``. Replaying ``generate`` on fake tensors costs a model call per token and beam
    search step: this keeps a loop's estimate to one or two of them.
    """

    settings: GenerationSettings
    _records: dict[int, _StepRecord] = field(default_factory=dict)

    def step(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor],
             tracker: Any) -> tuple[Any, torch.Tensor, Any]:
        """``Seq2SeqTrainer.prediction_step`` for ``inputs`` (call with the tracker's peak reset)."""
        size = int(inputs["input_ids"].shape[0])
        start = tracker.allocated
        record = self._records.get(size)
        if record is None:
            loss, tokens, labels = generation_prediction_step(model, inputs, tracker, self.settings)
            own_labels = labels is not None and labels is inputs.get("labels")
            self._records[size] = _StepRecord(
                tracker.peak - start, None if loss is None else _Layout.of(loss), _Layout.of(tokens),
                None if labels is None or own_labels else _Layout.of(labels), own_labels)
            return loss, tokens, labels
        loss = None if record.loss is None else record.loss.rebuild()
        tokens = record.tokens.rebuild()
        labels = inputs["labels"] if record.labels_are_the_batchs else (
            None if record.labels is None else record.labels.rebuild())
        tracker.transient(start + record.peak_above_start - tracker.allocated)
        return loss, tokens, labels
