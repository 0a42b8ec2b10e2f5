"""The optimizer step as it runs on CUDA: the Trainer's default optimizer, host step counters, fp16's GradScaler.

A CUDA target is replayed on fake CPU tensors (:mod:`.replay`); what differs on CUDA in the optimizer step,
read in torch 2.13, transformers 5.23 and accelerate 1.15:

* **The default optimizer.** ``TrainingArguments.optim`` defaults to ``adamw_torch_fused`` on torch >= 2.8
  (``training_args.py``: ``default_optim``, under ``pytorch_utils.is_torch_greater_or_equal_than_2_8``),
  ``adamw_torch`` before. An estimate without a Trainer and without ``optim`` takes
  :func:`trainer_default_optim` for a CUDA target. A CPU target keeps ``RunConfig``'s ``adamw_torch``: the
  fused CPU kernel (``_fused_adamw_``, in place) has no temporaries where the single-tensor loop
  ``_single_tensor_adam`` torch runs for CPU tensors holds one parameter's ``denom`` (measured: a 2-layer
  GPT-2, 1 x 16 tokens, ``after_optimizer`` 9,945,596 B with ``adamw_torch``, 8,921,824 B fused), so
  changing it would move every CPU figure.
* **The implementation torch picks** for CUDA tensors (``optimizer.py: _default_to_fused_or_foreach``):
  ``fused`` when asked (``adamw_torch_fused``), else ``foreach`` (all parameters on CUDA), where CPU
  tensors get neither (``foreach`` needs a device of ``_get_foreach_kernels_supported_devices``, which
  lists no CPU). ``_multi_tensor_adam`` (foreach) allocates ``_foreach_sqrt(exp_avg_sq)``, a copy of the
  whole (device, dtype) group in the states' dtype, alive until the update is applied: 4 B per trainable
  parameter of the larger group in fp32 (:func:`~hf_memwatch.estimation.optim.build_optimizer` asks for
  ``foreach=True`` for a CUDA target so that it is replayed). ``_fused_adam`` updates in place through one
  ``_fused_adamw_`` kernel: no temporary.
* **Step counters on the host.** Adam's ``_init_group`` keeps ``state["step"]`` on the CPU ("special
  device hosting for step": ``torch.tensor(0.0, device="cpu")``) unless ``fused`` or ``capturable``, and
  ``_multi_tensor_adam`` adds ``torch.tensor(1.0, device="cpu")`` to them: host memory, not the card's
  (one 512 B block per parameter the replay would otherwise count). Fused and capturable counters are
  ``torch.zeros((), device=p.device)``: on the card, counted. Within a torch optimizer's ``step`` for a
  CUDA target, a tensor made from Python data (``aten.lift_fresh``) is therefore not counted
  (:func:`steps_on_host`; RMSprop's ``torch.zeros((), dtype)`` counter is not covered).
* **GradScaler under fp16.** accelerate builds ``torch.amp.GradScaler("cuda")`` for fp16 mixed precision on
  CUDA (``Accelerator.__init__`` -> ``get_grad_scaler``; none on CPU) and runs ``scaler.scale(loss).backward()``
  (``Accelerator.backward``), ``scaler.unscale_(optimizer)`` before clipping (``unscale_gradients``),
  ``scaler.step(optimizer)`` and ``scaler.update()`` (``AcceleratedOptimizer.step``). Its tensors, all
  0-dim (one 512 B block each on the card): ``_scale`` (fp32) and ``_growth_tracker`` (int32), made at the
  first ``scale`` and kept; the scaled loss; in ``unscale_``: ``inv_scale`` through
  ``_scale.double().reciprocal().float()``, ``found_inf``, and the per-device copies
  ``_MultiDeviceReplicator`` makes of both (``.to(device, copy=True)``); the per-device ``found_inf`` kept in
  the optimizer's state until ``update()``; for a fused optimizer (``_step_supports_amp_scaling``) their
  ``sum`` handed to the kernel. ``_amp_foreach_non_finite_check_and_unscale_`` unscales the gradients in
  place. :class:`StepScaler` runs torch's own ``GradScaler`` (device ``"cpu"``: the same Python code, on
  the replay's fake tensors), a clean step (no inf: ``found_inf`` reads 0, the step is taken).

Example:
    >>> trainer_default_optim()
    'adamw_torch_fused'
    >>> default_optim("cpu"), default_optim("cuda")
    ('adamw_torch', 'adamw_torch_fused')
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from ..compat.torch_amp import (
    scaler_optimizer_state,
    scaler_replayable,
    scaler_tensors,
    steps_with_amp_scaling,
)

# The tensors the replay names in its details (class "other").
GRAD_SCALER = "grad_scaler"


def trainer_default_optim() -> str:
    """``TrainingArguments.optim``'s default for the installed versions (``training_args.py``:
    ``adamw_torch_fused`` when ``pytorch_utils.is_torch_greater_or_equal_than_2_8``, else ``adamw_torch``).

    Read through transformers' own flag, not ``TrainingArguments`` (importing ``training_args`` pulls in
    peft and bitsandbytes: seconds); tests/test_cuda_optim.py checks it against the dataclass default.
    """
    from transformers.pytorch_utils import is_torch_greater_or_equal_than_2_8

    return "adamw_torch_fused" if is_torch_greater_or_equal_than_2_8 else "adamw_torch"


def default_optim(device: str | None) -> str:
    """The optimizer an estimate assumes when none is given: the Trainer's default for a CUDA target,
    ``RunConfig``'s ``adamw_torch`` for a CPU one (its figures unchanged; see the module doc)."""
    from ..core.run_config import RunConfig

    return trainer_default_optim() if device == "cuda" else RunConfig.optim


def steps_on_host(optimizer: Any, tracker: Any) -> None:
    """For a CUDA target: tensors a torch optimizer's ``step`` makes from Python data are host tensors.

    Wraps this optimizer object's ``step`` (the instance, not the class) so that, within it, the tracker
    does not count ``aten.lift_fresh`` outputs (``tracker.host_scalars``): Adam's CPU ``step`` counters and
    the ``torch.tensor(1.0, device="cpu")`` added to them (see the module doc). Not for bitsandbytes'
    optimizers (their state lives on the parameters' device).
    """
    if not type(optimizer).__module__.startswith("torch.optim"):
        return
    step = optimizer.step

    @functools.wraps(step)
    def host_step(*args: Any, **kwargs: Any) -> Any:
        saved = tracker.host_scalars
        tracker.host_scalars = True
        try:
            return step(*args, **kwargs)
        finally:
            tracker.host_scalars = saved

    optimizer.step = host_step


class StepScaler:
    """accelerate's ``GradScaler`` of an fp16 CUDA run, replayed on the step's fake tensors (module doc).

    ``start()`` makes ``_scale`` and ``_growth_tracker`` (kept from the first step on); ``backward(loss)``
    is ``scaler.scale(loss).backward()``; ``unscale_`` and ``step`` are the scaler's, ``step`` followed by
    ``update()`` as ``AcceleratedOptimizer.step`` runs them. ``installed(trainer)``: the Trainer's own
    ``training_step`` scales its loss through this scaler (``Accelerator.backward``).
    """

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.scaler = torch.amp.GradScaler("cpu")  # the replay's device; the code is the CUDA scaler's

    def start(self, device: str) -> list[torch.Tensor]:
        """The scaler's persistent tensors, made as the first ``scale`` makes them; returned to be kept."""
        from .cuda_libs import name_held

        held = scaler_tensors(self.scaler, torch.device(device))
        name_held(self.tracker, held, GRAD_SCALER)
        return held

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: Any) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: Any) -> None:
        """``scaler.step(optimizer)`` of a clean step (every ``found_inf`` reads 0), then ``update()``."""
        state = scaler_optimizer_state(self.scaler, optimizer)
        for found_inf in state["found_inf_per_device"].values():
            self.tracker.reads_zero(found_inf)
        if state["stage"].name == "READY" and not steps_with_amp_scaling(optimizer):
            self.scaler.unscale_(optimizer)  # as step() would, then its found_inf read as clean
            for found_inf in state["found_inf_per_device"].values():
                self.tracker.reads_zero(found_inf)
        self.scaler.step(optimizer)
        self.scaler.update()

    @contextlib.contextmanager
    def installed(self, trainer: Any) -> Iterator[None]:
        """Within, ``trainer.accelerator`` scales the loss through this scaler (put back after)."""
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is None:
            yield
            return
        saved = accelerator.scaler
        accelerator.scaler = self.scaler
        try:
            yield
        finally:
            accelerator.scaler = saved


def step_scaler(request: Any, tracker: Any) -> StepScaler | None:
    """The GradScaler replay of an fp16 CUDA target without ZeRO/FSDP (accelerate's rule: DeepSpeed scales
    the loss itself, FSDP takes ``ShardedGradScaler``), None otherwise."""
    if request.device != "cuda" or request.precision != "fp16" or (request.shard or "none") != "none":
        return None
    return StepScaler(tracker) if scaler_replayable() else None  # compat.torch_amp.GRAD_SCALER: warned
