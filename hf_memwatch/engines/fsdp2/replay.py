"""FSDP2's memory on one rank, replayed in the estimate's fake step (``fully_shard``, torch 2.13).

The fake model's parameters are swapped for the rank's shards for the whole replay (the padded
dim-0 chunk of :mod:`~hf_memwatch.engines.fsdp2.units`, so the optimizer is built on, and steps,
the shards), and module hooks do on fake tensors what ``torch/distributed/fsdp/_fully_shard``
allocates and frees, at the moment it does (``_fsdp_param_group.py``, ``_fsdp_collectives.py``,
``_fsdp_param.py``, ``_fsdp_state.py``), each unit of accelerate's wrapping:

- *all-gather* (``foreach_all_gather``): a flat output of the unit's padded numel x N (fp32: the
  all-gather input is the shard itself, copied into the output's slice; bf16, accelerate's
  ``MixedPrecisionPolicy(param_dtype=reduce_dtype=bf16)``: each shard cast to a bf16 copy first,
  ``FSDPParam.all_gather_inputs``, freed after the copy-in, and a bf16 output).
  Under gloo ``all_gather_single`` (``c10d::_allgather_base_``) allocates a second buffer of that
  size and frees it, then gloo's worker allocates one and frees it (both in the profiler's
  record), so the all-gather peaks at twice the flat output for a moment;
- *copy-out* (``foreach_all_gather_copy_out``): each parameter's unsharded storage (its padded numel
  x N) allocated, the first time by ``torch.empty``, later by ``storage.resize_(n)``; the unsharded
  parameter is a view of it. In forward the flat output is kept (``all_gather_state``) and the
  previous unit's is freed once this copy-out is done; in backward it is freed at once;
- *reshard* (``free_storage``: ``resize_(0)``): after each forward where ``reshard_after_forward``
  (not the root, not the tail group), and after each backward; the saved activations that view the
  parameter see its storage emptied, as on the rank;
- *backward prefetch*: a unit's pre-backward all-gathers the unit before it in post-forward order,
  whose flat output is held until that unit's own pre-backward copies it out;
- *post-backward* (after the unit's inputs' gradients, or in the root's final callback for units
  whose inputs need none — the embeddings): reshard, free the previous unit's reduce-scatter input,
  allocate this one's (the gradients' padded numel), copy the unsharded gradients in and drop them,
  allocate the output (numel / N) — the sharded gradients are views of it, or are added to the
  kept ones — and, under gloo, ``reduce_scatter_tensor``'s clone of the input (allocated and freed
  inside the collective). In bf16 the unsharded gradients, the input and the output are bf16, and the
  output is cast to the fp32 sharded gradients (``_to_dtype_if_needed``). The last input is freed by the
  final callback;
- *gloo's race* (CPU ranks): a finished work keeps its buffers (all-gather output, reduce-scatter input
  and output) until its worker resets it, before or after the training thread drops them; the estimate
  is the worst branch, each of gloo's 2 workers holding its last work (:meth:`Fsdp2Flow._issued`), a
  direct estimate gives the other beside it (:mod:`~hf_memwatch.estimation.branches`);
- gradient accumulation: accelerate's ``no_sync`` (``set_requires_gradient_sync(False)``, where the
  accelerator reports ``is_fsdp2``) keeps the *unsharded* gradients across micro-steps, and the
  replayed last micro-step starts with them resident; where it does not (an accelerator whose
  ``no_sync`` is DDP's, a no-op on FSDP2: measured so before ``hf_memwatch.testing.fsdp_cpu`` kept the
  state FSDP through ``train()``), every micro-step reduce-scatters and the sharded gradients are kept.

Measured on 2 gloo ranks (test GPT-2, 4 x 32 tokens, 2 steps; ``benchmarks/fsdp2_accuracy.py``):
the step peak is at the backward prefetch of ``h.0`` inside ``h.1``'s backward, 11,675,612 B on both
ranks, where the division rule (states, gradients and weights / N + 2 x the largest layer)
predicted 11,195,724 B (-4.1%). bf16 (``tests/engines/test_fsdp_replay.py``, tiny Llama on a fake group
of 2, accelerate's policy and autocast): 7,080,972 B predicted, 7,077,920 B measured (+0.04%); before, bf16
fell back to the division rule: +35.9% (the sweep's 2-rank bf16 draws: +12.2..+21.0%). Not modelled: fp16
and other policies (a ``reduce_dtype`` or ``output_dtype`` of its own), CPU offload, HSDP, explicit
prefetching, ``reshard_after_forward`` as an int.
"""

from __future__ import annotations

from typing import Any

import torch

from ...compat.fsdp import replay_supported, set_parameter
from ...compat.torch_internals import (
    current_dispatch_modes,
    in_backward,
    queue_backward_callback,
    storage_key,
    tree_flatten,
    tree_unflatten,
)
from ...estimation.branches import race_held, report_race
from ...estimation.classify import refs
from ...estimation.fake_dispatch import EstimateTracker
from ..gloo_staging import HELD_WORKS, gloo_ranks
from .units import (
    FsdpUnit,
    build_units,
    chunk_rows,
    padded_rows,
    reshards_after_forward,
    state_order,
    wrap_policy,
)

IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = "idle", "forward", "pre_backward", "post_backward"
# FSDP2's implicit backward prefetch (its default); off only to show what the replay owes to it.
BACKWARD_PREFETCH = True


def fsdp_applies(engine: Any, model: torch.nn.Module, precision: str = "fp32") -> bool:
    """Whether :class:`Fsdp2Flow` replays this engine: FSDP2 sharding over 2+ ranks, fp32 or bf16 (fp32
    weights: accelerate's bf16 ``MixedPrecisionPolicy``), no offload, a model not sharded yet (planning
    happens before ``train()`` wraps it)."""
    if engine is None or engine.kind != "fsdp" or engine.shard != "fsdp" or engine.world_size < 2:
        return False
    if (engine.fsdp_version or 1) != 2 or engine.fsdp_cpu_offload or precision == "fp16":
        return False
    params = list(model.parameters())
    # already sharded (a model fully_shard wrapped, DTensor parameters): not replayed a second time
    if not (bool(params) and all(p.dtype == torch.float32 and type(p).__name__ != "DTensor" for p in params)):
        return False
    return replay_supported()  # torch's and accelerate's private names it needs (probed, warned once)


class _Param:
    """One managed parameter: where it lives, its full fake tensor, its shard and its unsharded view."""

    def __init__(self, owner: torch.nn.Module, attr: str, full: torch.nn.Parameter, world: int, rank: int) -> None:
        self.owner, self.attr, self.full = owner, attr, full
        dim0 = full.shape[0] if full.dim() else 1
        rest = full.numel() // dim0 if dim0 else 0
        self.padded_numel = padded_rows(dim0, world) * rest
        self.full_numel = self.padded_numel * world  # the unsharded storage, padding included
        rows = chunk_rows(dim0, world, rank)
        storage = full.new_empty(self.padded_numel)
        shape = (rows, *full.shape[1:]) if full.dim() else (rows,)
        self.shard = torch.nn.Parameter(storage[: rows * rest].view(shape), requires_grad=full.requires_grad)
        self.unsharded: torch.nn.Parameter | None = None
        self.pending_grad: torch.Tensor | None = None  # the unsharded gradient kept by no_sync


class Fsdp2Flow:
    """The context that replays FSDP2 on ``model`` (see the module doc); ``prefetch=False`` leaves the
    backward prefetch out; ``gloo``: the collectives' own copies gloo makes (not NCCL's, not a fake group);
    ``no_sync``: the micro-steps before the last keep unsharded gradients (else they reduce-scatter too)."""

    def __init__(self, model: torch.nn.Module, units: list[FsdpUnit], world_size: int, rank: int = 0,
                 prefetch: bool = True, gloo: bool = True, no_sync: bool = True,
                 param_dtype: torch.dtype | None = None) -> None:
        self.model, self.units, self.world, self.prefetch, self.gloo = model, units, world_size, prefetch, gloo
        self.no_sync = no_sync
        self.param_dtype = param_dtype  # MixedPrecisionPolicy's param_dtype = reduce_dtype (accelerate's bf16)
        self.params: dict[int, list[_Param]] = {}
        self.rank = rank
        self.order = state_order(model, units)
        self._handles: list[Any] = []
        self._reset()

    def _reset(self) -> None:
        self.state = {id(u): IDLE for u in self.units}
        self.sharded = {id(u): True for u in self.units}
        self.pending: dict[int, torch.Tensor] = {}  # unit -> its all-gather output, not yet copied out
        self.to_run: dict[int, set[int]] = {id(u): set() for u in self.units}
        self.post_forward_order: list[FsdpUnit] = []
        self.indices: dict[int, list[int]] = {id(u): [] for u in self.units}
        self.all_gather_state: torch.Tensor | None = None
        self.rs_inputs: list[torch.Tensor] = []
        self.callback_queued = False
        self.work_held: list[list[torch.Tensor]] = []  # the last collectives' tensors gloo's workers hold (a race)
        self.largest_held = 0  # bytes of the largest block the race holds

    # -- the context --------------------------------------------------------------------------
    def __enter__(self) -> Fsdp2Flow:
        seen: dict[int, _Param] = {}
        for unit in self.units:
            managed: list[Any] = []
            for owner, attr, full in unit.params:
                if id(full) in seen:  # tied: the same shard on every owner
                    param: Any = _Alias(seen[id(full)], owner, attr)
                else:
                    param = seen[id(full)] = _Param(owner, attr, full, self.world, self.rank)
                managed.append(param)
                _set(owner, attr, param.shard)
            self.params[id(unit)] = managed
            for module in unit.modules:
                self._handles.append(module.register_forward_pre_hook(
                    self._pre_forward_hook(unit, module), prepend=True, with_kwargs=True))
                self._handles.append(module.register_forward_hook(
                    self._post_forward_hook(unit, module), always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.largest_held:  # the race of :meth:`_issued`
            report_race(f"fsdp2: the last collectives' buffers (up to {self.largest_held:,} bytes), which gloo's "
                        "worker threads let go after or before the training thread's next allocations")
        for managed in self.params.values():
            for param in managed:
                _set(param.owner, param.attr, param.full)
        self.params = {}
        self._reset()

    # -- forward --------------------------------------------------------------------------------
    def _pre_forward_hook(self, unit: FsdpUnit, module: torch.nn.Module) -> Any:
        def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
            if not self.to_run[id(unit)]:
                self.to_run[id(unit)].update(id(m) for m in unit.modules)
            if unit.root and self.state[id(unit)] != PRE_BACKWARD and self.no_sync:
                self._resident_gradients()
            if self.state[id(unit)] == PRE_BACKWARD:  # activation checkpointing's recomputation
                if self.sharded[id(unit)]:
                    self._unshard(unit)
                    self._wait_for_unshard(unit)
                return args, kwargs
            entering = self.state[id(unit)] != FORWARD
            self.state[id(unit)] = FORWARD
            self._unshard(unit)
            self._wait_for_unshard(unit)
            if entering:
                return self._register_post_backward(unit, args, kwargs)
            return args, kwargs
        return hook

    def _post_forward_hook(self, unit: FsdpUnit, module: torch.nn.Module) -> Any:
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> Any:
            remaining = self.to_run[id(unit)]
            if id(module) in remaining:
                remaining.discard(id(module))
                if remaining:
                    return output  # a group's module before its last
            if self.state[id(unit)] == PRE_BACKWARD:
                return output
            if not in_backward():  # not a recomputation inside a backward
                if unit.reshard_after_forward:
                    self._reshard(unit)
                self.indices[id(unit)].append(len(self.post_forward_order))
                self.post_forward_order.append(unit)
            self._register_pre_backward(unit, output)
            self.state[id(unit)] = IDLE
            if unit.root:
                self.all_gather_state = None  # the last all-gather output, freed at the root's post-forward
            return output
        return hook

    def _unshard(self, unit: FsdpUnit) -> None:
        """``foreach_all_gather``: the flat output (and gloo's momentary second buffer), held until the copy-out."""
        if id(unit) in self.pending or not self.sharded[id(unit)] or not self.params[id(unit)]:
            return
        owners = _owners(self.params[id(unit)])
        numel = sum(p.full_numel for p in owners)
        # under a MixedPrecisionPolicy each shard is cast first (FSDPParam.all_gather_inputs), freed after the copy-in
        inputs = [p.shard.to(self.param_dtype) for p in owners] if self.param_dtype is not None else []
        output = _gathered(owners[0].shard.new_empty(numel, dtype=self.param_dtype))
        del inputs
        if self.gloo:
            staging = torch.empty_like(output)  # c10d::_allgather_base_ under gloo, then gloo's own: one at a time
            del staging
        self._issued(output)
        self.pending[id(unit)] = output

    def _wait_for_unshard(self, unit: FsdpUnit) -> None:
        """``foreach_all_gather_copy_out``: the unsharded storages, then the flat output's release."""
        output = self.pending.pop(id(unit), None)
        if output is None:
            return
        previous = None
        if self.state[id(unit)] == FORWARD:
            previous, self.all_gather_state = self.all_gather_state, None
        for param in _owners(self.params[id(unit)]):
            if param.unsharded is None:
                storage = _gathered(param.shard.new_empty(param.full_numel, dtype=self.param_dtype))
                view = storage[: param.full.numel()].view(param.full.shape)
                param.unsharded = torch.nn.Parameter(view, requires_grad=param.full.requires_grad)
                if param.unsharded.requires_grad:  # its gradient is a gradient until the reduce-scatter
                    param.unsharded.register_post_accumulate_grad_hook(_grad_is_gradient)
                if param.pending_grad is not None:
                    param.unsharded.grad, param.pending_grad = param.pending_grad, None
            else:
                _regrow(param.unsharded, param.full_numel * param.unsharded.element_size())
        for param in self.params[id(unit)]:
            _set(param.owner, param.attr, _owner(param).unsharded)
        self.sharded[id(unit)] = False
        if self.state[id(unit)] == FORWARD:
            self.all_gather_state = output
        del output, previous

    def _issued(self, *tensors: torch.Tensor) -> None:
        """A collective issued on ``tensors`` (gloo's race, the module doc). Its work holds them (``AsyncWork``'s
        inputs and outputs) until the worker that ran it takes ``workMutex_`` again and resets it
        (``ProcessGroupGloo::runLoop``), after the training thread's wait returned. The worst branch
        (:func:`race_held`) keeps the last :data:`HELD_WORKS` collectives' tensors alive until more are issued
        (or the backward ends: the clipping's all-reduce is next); a worker stalled longer is not replayed.
        Measured on the two-rank sweep (``benchmarks/results/sweep.md``): seed 6's rank 0 peaked 128,256 B over
        the reconciled truth, the tail's bf16 all-gather output (gathered last in the forward, freed at the
        root's post-forward) alive into the backward; MemWatch's live peaks on seeds 7 and 31 past one held work."""
        if self.gloo:
            self.largest_held = max([self.largest_held, *(t.untyped_storage().nbytes() for t in tensors)])
            self.work_held = [*self.work_held, list(tensors)][-HELD_WORKS:] if race_held() else []

    def _reshard(self, unit: FsdpUnit) -> None:
        """``to_sharded``: the shards back on the modules, the unsharded storages resized to 0."""
        if self.sharded[id(unit)] or not self.params[id(unit)]:
            return
        for param in self.params[id(unit)]:
            _set(param.owner, param.attr, _owner(param).shard)
        for param in _owners(self.params[id(unit)]):
            _release(param.unsharded)
        self.sharded[id(unit)] = True

    def _resident_gradients(self) -> None:
        """The replayed micro-step after the first starts with every ``.grad`` resident (step.py): under
        ``no_sync`` FSDP2 keeps them unsharded, on the unsharded parameters, not on the shards."""
        for managed in self.params.values():
            for param in _owners(managed):
                if param.shard.grad is not None:
                    param.shard.grad = None
                    grad = torch.zeros_like(param.full, dtype=self.param_dtype)
                    if param.unsharded is not None:
                        param.unsharded.grad = grad
                    else:
                        param.pending_grad = grad

    # -- backward -------------------------------------------------------------------------------
    def _register_post_backward(self, unit: FsdpUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``RegisterPostBackwardFunction`` on the inputs that need a gradient (as FSDP's pre-forward)."""
        if not torch.is_grad_enabled():
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        places = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if not places:
            return args, kwargs
        outputs = _PostBackward.apply(self, unit, *(leaves[i] for i in places))
        for i, out in zip(places, outputs):
            leaves[i] = out
        return tree_unflatten(leaves, spec)

    def _register_pre_backward(self, unit: FsdpUnit, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        leaves, _ = tree_flatten(output)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(lambda grad, unit=unit: self._pre_backward(unit, grad))

    def _pre_backward(self, unit: FsdpUnit, grad: torch.Tensor) -> torch.Tensor:
        if self.state[id(unit)] == PRE_BACKWARD:
            return grad
        self.state[id(unit)] = PRE_BACKWARD
        if not self.callback_queued:
            self.callback_queued = True
            queue_backward_callback(self._final_callback)
        self._unshard(unit)
        self._wait_for_unshard(unit)
        indices = self.indices[id(unit)]
        if self.prefetch and indices:
            index = indices.pop()
            if index > 0:
                self._unshard(self.post_forward_order[index - 1])
        return grad

    def post_backward(self, unit: FsdpUnit) -> None:
        """FSDP's ``post_backward``: reshard, the reduce-scatter's buffers, the sharded gradients."""
        self.state[id(unit)] = POST_BACKWARD
        owners = _owners(self.params[id(unit)])
        grads, reduced = [], []
        for param in owners:
            if param.unsharded is not None and param.unsharded.grad is not None:
                grads.append(param.unsharded.grad)
                reduced.append(param)
                param.unsharded.grad = None
        self._reshard(unit)
        self.rs_inputs.clear()  # the previous unit's reduce-scatter input (one kept in flight)
        if not grads:
            return
        total = sum(p.full_numel for p in reduced)
        rs_input = _as_gradient(grads[0].new_empty(total))
        offset = 0
        for param, grad in zip(reduced, grads):  # chunk_cat: the gradients into the input, then dropped
            rs_input.narrow(0, offset, grad.numel()).copy_(grad.reshape(-1))
            offset += param.full_numel
        grads.clear()
        del grad
        output = _as_gradient(rs_input.new_empty(total // self.world))
        if self.gloo:
            clone = rs_input.clone()  # gloo's reduce_scatter_tensor works on a copy of its input
            del clone
        self._issued(rs_input, output)
        if output.dtype != reduced[0].shard.dtype:  # _to_dtype_if_needed: the reduce-dtype output cast back
            output = _as_gradient(output.to(reduced[0].shard.dtype))
        offset = 0
        for param in reduced:
            view = output.narrow(0, offset, param.shard.numel()).view(param.shard.shape)
            if param.shard.grad is None:
                param.shard.grad = view
            else:
                param.shard.grad += view
            offset += param.padded_numel
        self.rs_inputs.append(rs_input)

    def _final_callback(self) -> None:
        """``_root_post_backward_final_callback``: the units autograd did not reach, then the last input freed."""
        for unit in self.order:
            if self.state[id(unit)] != POST_BACKWARD:
                self.post_backward(unit)
            self.state[id(unit)] = IDLE
        self.rs_inputs.clear()
        self.work_held = []  # the next collective: the gradient clipping's all-reduce (the race's worst branch ends)
        self.post_forward_order.clear()
        for indices in self.indices.values():
            indices.clear()
        self.callback_queued = False


class _Alias:
    """A tied parameter's second owner: the same shard and unsharded view, set on another module."""

    def __init__(self, base: _Param, owner: torch.nn.Module, attr: str) -> None:
        self.base, self.owner, self.attr = base, owner, attr
        self.full = base.full

    @property
    def shard(self) -> torch.nn.Parameter:
        return self.base.shard


def _owner(param: Any) -> _Param:
    return param.base if isinstance(param, _Alias) else param


def _owners(managed: list[Any]) -> list[_Param]:
    return [p for p in managed if not isinstance(p, _Alias)]


class _PostBackward(torch.autograd.Function):
    """FSDP's ``RegisterPostBackwardFunction``: runs the unit's post-backward once its inputs' gradients exist."""

    @staticmethod
    def forward(ctx: Any, flow: Fsdp2Flow, unit: FsdpUnit, *inputs: torch.Tensor) -> Any:
        ctx.flow, ctx.unit = flow, unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.flow.post_backward(ctx.unit)
        return (None, None, *grads)


def _set(owner: torch.nn.Module, attr: str, param: torch.nn.Parameter) -> None:
    set_parameter(owner, attr, param)  # FSDP's unsafe_setattr_param: no module checks


def _trackers() -> list[EstimateTracker]:
    return [mode for mode in current_dispatch_modes() if isinstance(mode, EstimateTracker)]


def _release(tensor: torch.Tensor) -> None:
    """``free_storage`` (``resize_(0)``), told to the trackers as a free: the storage's reference is
    dropped rather than shrunk, so a snapshot taken at an earlier high keeps its size."""
    storage = tensor.untyped_storage()
    for tracker in _trackers():
        ref = tracker.live_refs().get(storage_key(storage))
        if ref is not None:
            tracker._free(ref)  # the tracker's own free path (its weakref callback's)
    storage.resize_(0)


def _regrow(tensor: torch.Tensor, nbytes: int) -> None:
    """``alloc_storage`` (``resize_(n)``), told to the trackers as a new allocation."""
    tensor.untyped_storage().resize_(nbytes)
    for tracker in _trackers():
        tracker.register([tensor])
    _gathered(tensor)


def _as_gradient(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, counted as gradients while it lives (the estimate tracker's ``engine_gradients``)."""
    for tracker in _trackers():
        tracker.engine_gradients.update(refs(tracker, [tensor]))
    return tensor


def _grad_is_gradient(param: torch.Tensor) -> None:
    _as_gradient(param.grad)


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, counted as weights while it lives (the estimate tracker's ``engine_weights``)."""
    for tracker in _trackers():
        tracker.engine_weights.update(refs(tracker, [tensor]))
    return tensor


def fsdp_flow(model: torch.nn.Module, engine: Any, trainer: Any, precision: str = "fp32", device: str = "cpu") -> Any:
    """A :class:`Fsdp2Flow` for ``model`` where :func:`fsdp_applies`, else None. The collectives' copies
    are gloo's where this process's group is gloo, or where no group exists and the ranks are CPU ranks."""
    if not fsdp_applies(engine, model, precision):
        return None
    units = build_units(model, wrap_policy(trainer, model), reshards_after_forward(trainer, engine))
    # accelerate's no_sync is FSDP2's set_requires_gradient_sync(False) where the accelerator says
    # it is FSDP2 (``is_fsdp2``); else the DDP path, a no-op on an FSDP2 module: every micro-step reduces.
    no_sync = bool(getattr(getattr(trainer, "accelerator", None), "is_fsdp2", True))
    return Fsdp2Flow(model, units, engine.world_size, _rank(engine.world_size), BACKWARD_PREFETCH,
                     gloo_ranks(device), no_sync, torch.bfloat16 if precision == "bf16" else None)


def _rank(world_size: int) -> int:
    """This process's rank where its group is the engine's, else 0 (the widest chunks)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size:
        return dist.get_rank()
    return 0

