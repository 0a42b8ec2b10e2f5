"""A user's own ``Trainer`` subclass, shared by ``tests/test_custom_trainer.py`` and ``benchmarks/trl_accuracy.py``."""

from __future__ import annotations

from typing import Any

import torch


def masking_trainer() -> type:
    """A ``Trainer`` subclass with its own step: 15% of the input tokens masked in ``_prepare_inputs`` (torch's
    RNG), LM loss + 0.01 x every layer's hidden states' mean square in ``compute_loss``. Built on call, so that
    importing this module imports no ``transformers.trainer``."""
    from transformers import Trainer

    class MaskingTrainer(Trainer):
        def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
            inputs = super()._prepare_inputs(inputs)
            ids = inputs["input_ids"]
            keep = torch.rand(ids.shape, device=ids.device) > 0.15
            return {**inputs, "input_ids": torch.where(keep, ids, torch.zeros_like(ids))}

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
            outputs = model(**inputs, output_hidden_states=True)
            loss = outputs.loss + 0.01 * sum(h.pow(2).mean() for h in outputs.hidden_states)
            return (loss, outputs) if return_outputs else loss

    return MaskingTrainer
