"""One name per concept: the keywords renamed to the Transformers ``TrainingArguments`` names users know,
the old names accepted for one release with one ``FutureWarning`` naming the new keyword.

The names: ``micro_batch_size`` (was ``batch_size``: the records' name for a per-device micro-batch;
``per_device_train_batch_size`` is its ``TrainingArguments`` name), ``gradient_accumulation_steps``
(was ``accum``) and ``activation_checkpointing`` (was ``checkpointing``; transformers 5's name, 4.x's
``gradient_checkpointing``). Used by :func:`hf_memwatch.estimate`, :class:`~hf_memwatch.core.run_config.RunConfig`,
:class:`~hf_memwatch.estimation.request.EstimateRequest` (keywords, ``replace`` and the old attribute
names) and the CLI's hidden ``--batch-size``/``--accum``/``--checkpointing``.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     renamed_keywords("estimate", {"accum": 2, "seq_len": 8})
    {'seq_len': 8, 'gradient_accumulation_steps': 2}
    >>> str(caught[0].message)
    'estimate: accum= is deprecated, use gradient_accumulation_steps= (the old name goes in the next release)'
"""

from __future__ import annotations

import argparse
import functools
import warnings
from typing import Any

from .errors import MemWatchConfigError

# old keyword -> the one name (every public place that took the old one)
RENAMED = {"batch_size": "micro_batch_size", "accum": "gradient_accumulation_steps",
           "checkpointing": "activation_checkpointing"}


def deprecation_message(where: str, old: str, new: str) -> str:
    """The one line an old keyword warns with."""
    return f"{where}: {old}= is deprecated, use {new}= (the old name goes in the next release)"


def renamed_keywords(where: str, kwargs: dict[str, Any], renames: dict[str, str] = RENAMED,
                     stacklevel: int = 3) -> dict[str, Any]:
    """``kwargs`` with each old name of ``renames`` given replaced by its new name (one ``FutureWarning``
    each, pointing at the caller's caller); both names given: one :class:`MemWatchConfigError` line."""
    out = dict(kwargs)
    for old, new in renames.items():
        if old not in out:
            continue
        value = out.pop(old)
        if new in out:
            raise MemWatchConfigError(f"{where}: pass {new}= only ({old}= is its deprecated name)")
        warnings.warn(deprecation_message(where, old, new), FutureWarning, stacklevel=stacklevel)
        out[new] = value
    return out


def accepts_renamed(renames: dict[str, str]) -> Any:
    """Class decorator: the constructor takes ``renames``' old keywords (warned, renamed) and the old
    attribute names read the new fields (warned)."""
    def decorate(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **renamed_keywords(cls.__name__, kwargs, renames))

        cls.__init__ = __init__
        for old, new in renames.items():
            setattr(cls, old, property(functools.partial(_old_attribute, cls.__name__, old, new),
                                       doc=f"Deprecated: ``{new}``."))
        return cls
    return decorate


def _old_attribute(owner: str, old: str, new: str, obj: Any) -> Any:
    warnings.warn(f"{owner}.{old} is deprecated, use {owner}.{new} (the old name goes in the next release)",
                  FutureWarning, stacklevel=2)
    return getattr(obj, new)


class RenamedKeys(dict):
    """A mapping written under the one names whose old keys (:data:`RENAMED`) still read, for one release,
    with one ``FutureWarning`` naming the new key (``MemoryEstimate.config``: ``config["batch_size"]``).

    Example:
        >>> config = RenamedKeys({"micro_batch_size": 8})
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     config["batch_size"], config.get("accum", 1), "batch_size" in config, list(config)
        (8, 1, False, ['micro_batch_size'])
        >>> str(caught[0].message)
        "config['batch_size'] is deprecated, use config['micro_batch_size'] (the old key goes in the next release)"
    """

    def __missing__(self, key: Any) -> Any:
        new = RENAMED.get(key) if isinstance(key, str) else None
        if new is None or not dict.__contains__(self, new):
            raise KeyError(key)
        warnings.warn(f"config[{key!r}] is deprecated, use config[{new!r}] (the old key goes in the next release)",
                      FutureWarning, stacklevel=3)
        return dict.__getitem__(self, new)

    def get(self, key: Any, default: Any = None) -> Any:
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        try:
            return self.__missing__(key)
        except KeyError:
            return default

    def with_old_keys(self) -> tuple[dict[str, Any], list[str]]:
        """(a plain dict with each old key written beside its new one, the old keys written): for
        JSON readers of the old keys (the CLI's ``--json``), one release."""
        out = dict(self)
        old = [name for name, new in RENAMED.items() if new in self]
        out.update({name: self[RENAMED[name]] for name in old})
        return out, old


class RenamedFlag(argparse.Action):
    """An old command-line flag kept hidden for one release: stores into the new flag's destination
    with one ``FutureWarning`` naming the new flag (``new``)."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        _warn_flag(parser, option_string, self.new)
        setattr(namespace, self.dest, values)


class RenamedSwitch(argparse.BooleanOptionalAction):
    """An old ``--x/--no-x`` switch kept hidden for one release (``new``: the new ``--y``), as :class:`RenamedFlag`."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        negative = option_string is not None and option_string.startswith("--no-")
        _warn_flag(parser, option_string, "--no-" + self.new[2:] if negative else self.new)
        super().__call__(parser, namespace, values, option_string)


def _warn_flag(parser: argparse.ArgumentParser, old: str | None, new: str) -> None:
    warnings.warn(f"{parser.prog}: {old} is deprecated, use {new} (the old flag goes in the next release)",
                  FutureWarning, stacklevel=2)
