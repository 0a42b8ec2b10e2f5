"""The measured run's modelling code where it holds other tensors than the installed transformers' (for
``benchmarks/cuda_published.py``): a published figure is compared with a replay of the code that made it.

GPT-NeoX as transformers 4.42 ran it (``models/gpt_neox/modeling_gpt_neox.py`` of the 4.42.4 wheel; the
NeoX SDPA table of PR #31031 was measured on 4.42 dev), where 5.23's code differs in what it keeps:

* ``GPTNeoXAttention.__init__`` → ``_init_bias``: every layer registers a causal-mask buffer
  ``torch.tril(torch.ones((P, P), dtype=torch.bool))`` of ``max_position_embeddings`` P (2048 for
  Pythia: 4 MiB a layer, 100.7 MB over 24 layers), kept whatever the attention implementation;
  ``masked_bias`` a scalar beside it;
* ``GPTNeoXRotaryEmbedding`` (one per layer): ``inv_freq`` built with ``.float()`` and
  ``cos_cached``/``sin_cached`` as ``emb.cos()``/``emb.sin()`` of it, so fp32 buffers of
  ``[P, rotary_ndims]`` that ``from_pretrained(torch_dtype=float16)`` does not cast (non-persistent,
  never loaded);
* ``_attn_projections_and_rope``: ``apply_rotary_pos_emb`` multiplies the fp16 query/key slices by
  the fp32 ``cos``/``sin``, so by type promotion the rotated part is fp32 and
  ``torch.cat((query, query_pass))`` makes the whole query and key fp32; ``value`` stays a permuted
  view of the fused ``qkv`` output; ``present = (key, value)`` when ``use_cache`` (``config.use_cache``
  is True and the script passes nothing): the model's output keeps, per layer, the fp32 key and
  (through the view) the whole fp16 ``qkv``;
* ``GPTNeoXSdpaAttention.forward``: query and key cast back with ``.to(value.dtype)`` (the comment
  "GPT-neo-X casts query and key in fp32 to apply rotary embedding in full precision") before
  ``scaled_dot_product_attention(..., is_causal=True)``;
* ``GPTNeoXAttention._attn`` (eager): ``torch.zeros`` of the scores in the query's dtype (fp32 here),
  ``torch.baddbmm`` with ``alpha=norm_factor``, ``torch.where(causal_mask, scores, finfo.min)``,
  ``softmax``, ``.to(value.dtype)``, ``matmul`` with ``value``, then ``_merge_heads``
  (``permute(0, 2, 1, 3).contiguous()``).

:func:`gpt_neox_4_42` puts those on a 5.23 ``GPTNeoXForCausalLM`` built on the meta device: the buffers
on every attention module and a ``forward`` with 4.42's data flow (written here from the file above,
the same operators in the same order), which appends each layer's ``present`` to the list the
caller hands over per forward (the model's ``past_key_values``).

The Trainer as transformers 4.16 ran it on torch 1.10 (the perf guide's 2022 V100 runs):
``Trainer.train`` calls ``model.zero_grad()`` before the loop and after each optimizer step
(``trainer.py`` lines 1306 and 1435 of the 4.16.2 wheel), and torch 1.10's ``Module.zero_grad`` defaults
to ``set_to_none=False``: the gradients are zeroed in place and stay allocated through the next step's
forward, where today's Trainer (and the replay, ``estimation/step.py``) frees them
(``zero_grad(set_to_none=True)``). :func:`gradients_kept` replays that for the duration of an estimate.
And torch 1.10's autograd saved the *input* of ``softmax`` beside its output (``derivatives.yaml``:
``_softmax_backward_data(grad, result, dim, self)``; pytorch#64000 "Softmax/logsoftmax use more memory
for backward than needed", fixed by #66018 on 2021-10-01, after 1.10's branch, so from 1.11 on only
the input's dtype is kept): per BERT-large layer at 4 x 512 the fp32 scores, 4 x 16 x 512 x 512 x 4 B
= 64 MiB, kept until that layer's backward (under AMP the fp32 copy autocast makes for softmax, whose
list is fp32 in 1.10 as in 2.13). :func:`softmax_keeps_input` replays that: ``F.softmax`` keeps the
tensor its kernel got until its node's backward has run (:class:`_Softmax110`). The optimizer was
``transformers.AdamW`` (``adamw_hf``, gone from transformers 5): a loop over the parameters, one at a time
(``optimization.py`` of 4.16.2: ``denom = exp_avg_sq.sqrt().add_(eps)``, one parameter-size temporary
at a time), where the replay's ``adamw_torch`` on CUDA takes torch's ``foreach`` path (a list temporary
of every parameter: 1.25 GiB for BERT-large). :func:`per_parameter_adamw` builds ``torch.optim.AdamW``
with ``foreach=False`` (``_single_tensor_adamw``, the same loop; its ``denom`` is made by ``sqrt`` then
a division, so one more parameter-size temporary for an instant: 125 MB at the word embeddings).

The causal-LM loss as transformers 4.48 computed it (``loss/loss_utils.py`` of the 4.48.1 wheel,
``ForCausalLMLoss``): ``logits.float()``, then ``shift_logits = logits[..., :-1, :].contiguous()``, a
second fp32 copy of the logits less one position, and ``cross_entropy`` on it; its backward writes the
gradient of that slice into a new zero-filled fp32 tensor of the logits' shape. 5.23 pads the labels
instead (``nn.functional.pad(labels, (0, 1), value=ignore_index)``) and runs ``cross_entropy`` on the
whole upcast logits, with no copy and no slice. At 4 x 4096 x 32000 (Mistral-7B) each such fp32 tensor
is 2.1 GB. :func:`causal_lm_loss_4_48` puts 4.48's function in ``LOSS_MAPPING["ForCausalLM"]`` for the
duration of an estimate.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

NEOX_4_42 = "gpt_neox-4.42"
TRAINER_4_16 = "trainer-4.16/torch-1.10"
TRAINER_4_30 = "trainer-4.30/torch-2.0"  # transformers.AdamW (adamw_hf) stepped per parameter, torch 2.0's defaults
LOSS_4_48 = "loss-4.48"  # 4.48's ForCausalLMLoss: a contiguous fp32 copy of the shifted logits


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _eager_4_42(self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``GPTNeoXAttention._attn`` of 4.42 (no mask passed, no head mask, dropout 0) and ``_merge_heads``."""
    b, heads, s, size = query.shape
    causal = self.bias[:, :, :s, :s]
    q, k = query.view(b * heads, s, size), key.view(b * heads, s, size)
    scores = torch.zeros(b * heads, s, s, dtype=q.dtype, device=k.device)
    scores = torch.baddbmm(scores, q, k.transpose(1, 2), beta=1.0, alpha=self.norm_factor).view(b, heads, s, s)
    floor = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype).to(scores.device)
    weights = F.softmax(torch.where(causal, scores, floor), dim=-1).to(value.dtype)
    return torch.matmul(weights, value).permute(0, 2, 1, 3).contiguous()


def _forward_4_42(self: Any, hidden_states: torch.Tensor, attention_mask: Any = None,
                  position_ids: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """4.42's ``GPTNeoXSdpaAttention.forward`` / ``GPTNeoXAttention.forward`` for a first forward (no past)."""
    b, s, _hidden = hidden_states.shape
    heads, size, rot = self.n_heads_4_42, self.head_size, self.rotary_ndims
    qkv = self.query_key_value(hidden_states).view(b, s, heads, 3 * size)
    query = qkv[..., :size].permute(0, 2, 1, 3)
    key = qkv[..., size:2 * size].permute(0, 2, 1, 3)
    value = qkv[..., 2 * size:].permute(0, 2, 1, 3)
    if position_ids is None:
        position_ids = torch.arange(s, device=hidden_states.device).unsqueeze(0)
    cos = self.cos_cached[:s][position_ids].unsqueeze(1)
    sin = self.sin_cached[:s][position_ids].unsqueeze(1)
    q_rot, k_rot = query[..., :rot], key[..., :rot]
    query = torch.cat(((q_rot * cos) + (_rotate_half(q_rot) * sin), query[..., rot:]), dim=-1)
    key = torch.cat(((k_rot * cos) + (_rotate_half(k_rot) * sin), key[..., rot:]), dim=-1)
    self.holder_4_42[0].append((key, value))
    if self.impl_4_42 == "sdpa":
        out = F.scaled_dot_product_attention(query.to(value.dtype), key.to(value.dtype), value, attn_mask=None,
                                             dropout_p=0.0, is_causal=True).transpose(1, 2).contiguous()
    else:
        out = _eager_4_42(self, query, key, value)
    return self.dense(out.view(b, s, heads * size)), None


def gpt_neox_4_42(model: torch.nn.Module, attn: str) -> list:
    """``model`` (a 5.23 GPTNeoXForCausalLM on the meta device) as 4.42 ran it; returns the holder whose
    ``presents`` list each forward fills (``holder[0] = []`` before a forward gives it a fresh one)."""
    config = model.config
    size = config.hidden_size // config.num_attention_heads
    rot = int(size * config.rope_parameters.get("partial_rotary_factor", 1.0))
    positions = config.max_position_embeddings
    holder: list = [[]]
    for layer in model.gpt_neox.layers:
        attention = layer.attention
        device = attention.query_key_value.weight.device
        attention.register_buffer("bias", torch.empty((1, 1, positions, positions), dtype=torch.bool, device=device),
                                  persistent=False)
        attention.register_buffer("masked_bias", torch.empty((), dtype=torch.float16, device=device),
                                  persistent=False)  # torch.tensor(-1e9) under from_pretrained's default dtype
        attention.register_buffer("inv_freq", torch.empty(rot // 2, dtype=torch.float32, device=device), persistent=False)
        for name in ("cos_cached", "sin_cached"):
            attention.register_buffer(name, torch.empty((positions, rot), dtype=torch.float32, device=device),
                                      persistent=False)
        attention.n_heads_4_42, attention.norm_factor, attention.impl_4_42 = config.num_attention_heads, size**-0.5, attn
        attention.holder_4_42 = holder
        attention.forward = types.MethodType(_forward_4_42, attention)
    return holder


class _Softmax110(torch.autograd.Function):
    """``_softmax`` whose node saves its input beside its output, as torch 1.10's ``SoftmaxBackward`` did:
    saved through autograd (so a checkpoint's saved-tensor hooks drop it as they would have), freed
    when the node's backward has run."""

    @staticmethod
    def forward(ctx: Any, kernel_input: torch.Tensor, dim: int) -> torch.Tensor:
        out = torch._softmax(kernel_input, dim, False)
        ctx.save_for_backward(kernel_input, out)
        ctx.dim = dim
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        kernel_input, out = ctx.saved_tensors
        return torch._softmax_backward_data(grad, out, ctx.dim, kernel_input.dtype), None


def _softmax_1_10(input: torch.Tensor, dim: int | None = None, _stacklevel: int = 3,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    kernel_input = input if dtype is None else input.to(dtype)
    if torch.is_autocast_enabled("cpu") and kernel_input.dtype in (torch.float16, torch.bfloat16):
        kernel_input = kernel_input.float()  # the cast autocast's fp32 list makes (the replay's CPU autocast)
    if dim is None:
        dim = 0 if kernel_input.dim() in (0, 1, 3) else 1  # F.softmax's _get_softmax_dim
    return _Softmax110.apply(kernel_input, dim)


@contextlib.contextmanager
def softmax_keeps_input() -> Iterator[None]:
    """``torch.nn.functional.softmax`` as torch 1.10's autograd kept it (its input saved), for the duration."""
    softmax = F.softmax
    F.softmax = _softmax_1_10
    try:
        yield
    finally:
        F.softmax = softmax


@contextlib.contextmanager
def per_parameter_adamw() -> Iterator[None]:
    """``torch.optim.AdamW`` built with ``foreach=False`` (a per-parameter loop, as 4.16's AdamW) for the duration."""
    init = torch.optim.AdamW.__init__

    def single_tensor(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "foreach": False})

    torch.optim.AdamW.__init__ = single_tensor
    try:
        yield
    finally:
        torch.optim.AdamW.__init__ = init


@contextlib.contextmanager
def torch_1_10() -> Iterator[None]:
    """The 2022 runs' torch 1.10 as 4.16's Trainer drove it: :func:`gradients_kept`, :func:`softmax_keeps_input`
    and :func:`per_parameter_adamw`."""
    with gradients_kept(), softmax_keeps_input(), per_parameter_adamw():
        yield


@contextlib.contextmanager
def gradients_kept() -> Iterator[None]:
    """``Module.zero_grad`` and ``Optimizer.zero_grad`` zero the gradients in place whatever they are asked
    (torch 1.10's ``set_to_none=False``, as 4.16's Trainer left it) for the duration; put back on exit."""
    module_zero, optimizer_zero = torch.nn.Module.zero_grad, torch.optim.Optimizer.zero_grad
    torch.nn.Module.zero_grad = lambda self, set_to_none=True: module_zero(self, set_to_none=False)
    torch.optim.Optimizer.zero_grad = lambda self, set_to_none=True: optimizer_zero(self, set_to_none=False)
    try:
        yield
    finally:
        torch.nn.Module.zero_grad, torch.optim.Optimizer.zero_grad = module_zero, optimizer_zero


def _causal_lm_loss_4_48(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                         num_items_in_batch: Any = None, ignore_index: int = -100, **kwargs: Any) -> torch.Tensor:
    """``ForCausalLMLoss`` of transformers 4.48.1 (``loss/loss_utils.py``), the same operators in the same order."""
    logits = logits.float()
    labels = labels.to(logits.device)
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    shift_logits = shift_logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1).to(shift_logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    return loss / num_items_in_batch if reduction == "sum" else loss


@contextlib.contextmanager
def causal_lm_loss_4_48() -> Iterator[None]:
    """4.48's causal-LM loss in ``LOSS_MAPPING["ForCausalLM"]`` for the duration; put back on exit."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    before = LOSS_MAPPING["ForCausalLM"]
    LOSS_MAPPING["ForCausalLM"] = _causal_lm_loss_4_48
    try:
        yield
    finally:
        LOSS_MAPPING["ForCausalLM"] = before
