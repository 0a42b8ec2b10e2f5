"""The optimizer step DeepSpeed ZeRO runs (engines/zero/step.py) against the real optimizer on real
flat partitions, measured with the profiler (issue 19: 8-bit AdamW under ZeRO)."""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_model

from hf_memwatch.engines.zero.step import flat_step, rank_partitions
from hf_memwatch.estimation.optim import optimizer_class_and_kwargs
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak


def _real_flat_step(partitions: tuple[int, ...], optim: str) -> tuple[int, int]:
    """(states, step high above the resident set) of the real optimizer on real flat partitions, by the profiler."""
    cls, kwargs = optimizer_class_and_kwargs(optim, None)
    flats = [torch.nn.Parameter(torch.randn(n)) for n in partitions]
    optimizer = cls([{"params": [flat]} for flat in flats], **kwargs)
    for flat in flats:
        flat.grad = torch.randn_like(flat)
    optimizer.step()  # creates the states
    states = sum(v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor))
    prof = cpu_memory_profile()
    prof.start()
    optimizer.step()
    prof.stop()
    return states, window_peak(prof, 0)  # the high above what was live before the step


@pytest.mark.parametrize("optim", ["adamw_bnb_8bit", "adamw_torch"])
def test_flat_step_matches_the_real_optimizer_on_flat_partitions(optim):
    """States and step temporaries of the Trainer's optimizer on ZeRO's flat partitions (2 ranks)."""
    if optim == "adamw_bnb_8bit":
        pytest.importorskip("bitsandbytes")
    model = gpt2_model()
    partitions = rank_partitions(model, 2)  # the Trainer's decay / no-decay groups, each halved
    assert len(partitions) == 2 and sum(partitions) >= sum(p.numel() for p in model.parameters()) // 2
    predicted = flat_step(model, 2, optim)
    assert predicted.partitions == partitions
    states, temporaries = _real_flat_step(partitions, optim)
    assert abs(predicted.states - states) <= 0.01 * states, (predicted, states)
    assert abs(predicted.temporaries - temporaries) <= 0.01 * temporaries, (predicted, temporaries)
