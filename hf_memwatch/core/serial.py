"""A dataclass that turns itself into plain JSON-able data and back (the machinery of the timeline's
typed records, :mod:`hf_memwatch.core.records`).

:class:`Serial` writes its fields in order (:meth:`Serial.to_dict`) and reads them back
(:meth:`Serial.from_dict`: unknown keys kept in ``extra``, missing ones an error or, ``lenient``,
their type's absent value); a field declared with :func:`optional` is written only when known.
:meth:`Serial.slots` is the layout on disk, which a record writing a nested object flat overrides.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, TypeVar, get_type_hints

_R = TypeVar("_R", bound="Serial")


def optional(default: Any = None) -> Any:
    """A field written only when known (not None): absent from the JSON object otherwise."""
    return field(default=default, metadata={"optional": True})


class Slot(NamedTuple):
    """One key of a record on disk: the field (or, ``within`` a nested object written flat, its
    attribute) ``name`` behind it, its ``key``, type ``hint``, whether it is ``optional`` (written only
    when known) or required (no default)."""

    name: str
    key: str
    hint: Any
    optional: bool
    required: bool
    within: str | None = None


@dataclass(kw_only=True)
class Serial:
    """A dataclass that turns itself into plain JSON-able data and back.

    ``KEYS`` maps a field to its key on disk where they differ (``klass`` -> ``class``); ``OLD_KEYS`` maps
    a key an older version wrote to the key it is now (``batch_size`` -> ``micro_batch_size``: read, not written); ``NESTED``
    names the fields holding another :class:`Serial`; :meth:`slots` is the layout on disk (a record
    that writes a nested object's attributes flat, :class:`PlanRecord`, says so there).
    """

    KEYS: ClassVar[dict[str, str]] = {}
    OLD_KEYS: ClassVar[dict[str, str]] = {}  # a key older timelines wrote -> its key now (read, never written)
    NESTED: ClassVar[dict[str, type[Serial]]] = {}
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # keys this definition does not know

    @classmethod
    def slots(cls) -> tuple[Slot, ...]:
        """The keys on disk, in the order they are written."""
        return _field_slots(cls)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for slot in self.slots():
            owner = self if slot.within is None else getattr(self, slot.within)
            value = getattr(owner, slot.name)
            if value is None and slot.optional:
                continue
            out[slot.key] = value.to_dict() if isinstance(value, Serial) else value
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    @classmethod
    def _build(cls: type[_R], values: dict[str, Any], extra: dict[str, Any]) -> _R:
        """The record from its slots' values (a nested object written flat is assembled by its class)."""
        return cls(**values, extra=extra)

    @classmethod
    def from_dict(cls: type[_R], data: dict[str, Any], *, lenient: bool = False) -> _R:
        """The inverse of :meth:`to_dict`; unknown keys go to ``extra``; a missing required key is a
        ValueError — or, ``lenient`` (a reader of timelines older versions wrote), its type's absent
        value: ``{}`` for a mapping, ``[]`` for a list, else None."""
        data = cls.renamed_keys(data)
        slots = cls.slots()
        values: dict[str, Any] = {}
        for slot in slots:
            if slot.key in data:
                value = data[slot.key]
                nested = cls.NESTED.get(slot.name) if slot.within is None else None
                if nested is not None and isinstance(value, dict):
                    value = nested.from_dict(value, lenient=lenient)
                values[slot.name] = value
        missing = [slot for slot in slots if slot.required and slot.name not in values]
        if missing and lenient:
            values.update({slot.name: _absent(slot.hint) for slot in missing})
        elif missing:
            named = ", ".join(repr(slot.key) for slot in missing)
            raise ValueError(f"{getattr(cls, 'EVENT', cls.__name__)} record: missing {named}")
        known = {slot.key for slot in slots} | {"event"}
        return cls._build(values, {k: v for k, v in data.items() if k not in known})

    @classmethod
    def renamed_keys(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` with each key of :attr:`OLD_KEYS` under its name now (in its place; the new key wins)."""
        return renamed(data, cls.OLD_KEYS)

    def replace(self: _R, **changes: Any) -> _R:
        """A copy with ``changes`` (field names)."""
        return dataclasses.replace(self, **changes)


def renamed(data: dict[str, Any], old_keys: dict[str, str]) -> dict[str, Any]:
    """``data`` with each key of ``old_keys`` under its name now (in its place; both written: the new key wins).

    Example:
        >>> renamed({"a": 1, "accumulating": True}, {"accumulating": "gradient_accumulation"})
        {'a': 1, 'gradient_accumulation': True}
    """
    if not any(old in data for old in old_keys):
        return data
    out: dict[str, Any] = {}
    for key, value in data.items():
        new = old_keys.get(key)
        if new is None:
            out[key] = value
        elif new not in data:
            out[new] = value
    return out


@functools.cache
def _field_slots(cls: type[Serial]) -> tuple[Slot, ...]:
    """The slots of ``cls``'s own fields (``extra`` left out), in their order."""
    hints = _hints(cls)
    return tuple(Slot(f.name, cls.KEYS.get(f.name, f.name), hints[f.name], bool(f.metadata.get("optional")),
                      f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls) if f.name != "extra")


def _absent(hint: Any) -> Any:
    """The value a field an older timeline did not write is read as: an empty mapping or list, else None.

    Example:
        >>> _absent(dict[str, int]), _absent(list[int]), _absent(int | None)
        ({}, [], None)
    """
    origin = getattr(hint, "__origin__", None)
    if origin is dict or (isinstance(hint, type) and issubclass(hint, dict)):
        return {}
    if origin is list or hint is list:
        return []
    return None


@functools.cache
def _hints(cls: type[Serial]) -> dict[str, Any]:
    return get_type_hints(cls)
