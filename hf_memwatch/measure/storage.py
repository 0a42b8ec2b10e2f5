"""Storage-level accounting helpers.

Memory belongs to storages, not tensors: views, tied weights and ``.grad`` views of a DDP bucket share
one storage and must count once. Every figure in hf-memwatch is a sum over unique storage keys
(the address of the C++ ``StorageImpl``, stable for as long as the storage lives).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ..compat.torch_internals import is_traceable_wrapper_subclass
from ..compat.torch_internals import storage_key as _identity


def plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Yield the tensors that own storage behind ``tensor`` (DTensor & co. are unwrapped).

    Example:
        >>> [t.shape for t in plain_tensors(torch.zeros(2))]
        [torch.Size([2])]
    """
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):  # DTensor also flattens its (opaque) device_mesh
                yield from plain_tensors(inner)
    elif not tensor.is_sparse and not getattr(tensor, "is_nested", False):
        yield tensor


def nested_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested dicts, lists and tuples (optimizer state, a batch, ...).

    Example:
        >>> len(list(nested_tensors({"a": torch.zeros(1), "b": [torch.ones(2), 3]})))
        2
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from nested_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from nested_tensors(item)


def storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """Identity of the storage behind a plain tensor and its size in bytes.

    Example:
        >>> t = torch.zeros(4)
        >>> storage_key(t)[0] == storage_key(t[1:])[0], storage_key(t)[1]
        (True, 16)
    """
    storage = tensor.untyped_storage()
    return _identity(storage), storage.nbytes()


def collect_storages(
    tensors: Iterable[torch.Tensor | None],
    device: torch.device | None = None,
    into: dict[int, int] | None = None,
) -> dict[int, int]:
    """Map storage key -> bytes for ``tensors`` on ``device`` (all devices when None).

    Example:
        >>> w = torch.zeros(8)
        >>> sum(collect_storages([w, w[:4], None]).values())
        32
    """
    out: dict[int, int] = {} if into is None else into
    for tensor in tensors:
        if tensor is None or not isinstance(tensor, torch.Tensor):
            continue
        for plain in plain_tensors(tensor):
            if device is not None and not same_device(plain.device, device):
                continue
            key, nbytes = storage_key(plain)
            out[key] = nbytes
    return out


def same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality where an index-less device matches any index of its type."""
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def total(storages: Mapping[int, int]) -> int:
    """Sum of bytes of a storage map."""
    return sum(storages.values())
