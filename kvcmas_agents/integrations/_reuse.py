"""The adapters' one ``reuse`` setting: a reuse mode's name or a ``ReuseOptions``.

The knobs the adapters once took one by one (``recompute_ratio``, ``rank``, ``reference``) still work
for one release, folded into the setting with a DeprecationWarning.
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, fields, replace
from typing import Any, Mapping, Union

from ..engine import ReuseOptions

ReuseSetting = Union[str, ReuseOptions, None]
LEGACY_KNOBS = ("recompute_ratio", "rank", "reference")
_FIELDS = tuple(f.name for f in fields(ReuseOptions))


def to_options(reuse: ReuseSetting | Mapping[str, Any]) -> ReuseOptions:
    """The setting as ReuseOptions (a mapping is a serialized ReuseOptions)."""
    if reuse is None:
        return ReuseOptions()
    if isinstance(reuse, str):
        return ReuseOptions(reuse=reuse)
    if isinstance(reuse, ReuseOptions):
        return replace(reuse)
    if isinstance(reuse, Mapping):
        return ReuseOptions(**reuse)
    raise TypeError(f"reuse must be a reuse mode's name or a ReuseOptions, got {type(reuse).__name__}")


def compact(options: ReuseOptions) -> ReuseSetting:
    """The smallest setting meaning ``options``: None, a mode's name, or the options themselves."""
    if all(getattr(options, k) is None for k in _FIELDS if k != "reuse"):
        return options.reuse
    return options


def fold_legacy(reuse: ReuseSetting, knobs: Mapping[str, Any], owner: str, stacklevel: int = 3) -> ReuseSetting:
    """``reuse`` with the deprecated separate knobs that are set (not None) folded in."""
    given = {k: v for k, v in knobs.items() if v is not None}
    if not given:
        return reuse
    warnings.warn(f"{owner}: {', '.join(sorted(given))} as separate arguments are deprecated and will be "
                  f"removed in the next release; pass reuse=ReuseOptions(...) instead",
                  DeprecationWarning, stacklevel=stacklevel)
    options = to_options(reuse)
    clash = sorted(k for k, v in given.items() if getattr(options, k) not in (None, v))
    if clash:
        raise ValueError(f"{owner} got {clash} both in reuse and as separate arguments; give each once")
    return replace(options, **given)


def override(base: ReuseOptions, call: ReuseSetting | Mapping[str, Any]) -> ReuseOptions:
    """One call's options: what ``call`` sets replaces ``base``'s (a mode's name replaces only the mode)."""
    given = asdict(to_options(call))
    return ReuseOptions(**{k: given[k] if given[k] is not None else getattr(base, k) for k in _FIELDS})
