"""Whether a record's fields hold the JSON types their annotations name (the controller's strict read).

Contract: :func:`field_type_problems` lists, in words, each field of a dataclass whose value does not
have its annotated type; the annotations it understands are ``bool``, ``int``, ``float``, ``str``,
``None``, ``Any``, unions, ``list[...]`` and ``dict[...]`` (any other raises ``TypeError``, a bug in
the record's declaration, never in the data).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any


def field_type_problems(obj: object) -> list[str]:
    """The fields of dataclass ``obj`` whose value does not have the annotated type, in words.

    JSON has one number type, so an integral value is a valid ``float``; a ``bool`` is never an
    ``int``, and a ``float`` field must be finite (``Infinity``/``NaN`` parse, but no writer means them)."""
    cls: type = type(obj)  # a plain `type`: mypy does not take type[object] as Hashable (functools.cache)
    return [
        f"{name} is {getattr(obj, name)!r:.40}, not {_type_name(hint)}"
        for name, hint in _field_types(cls).items()
        if not _has_type(getattr(obj, name), hint)
    ]


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _has_type(value: object, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin is types.UnionType or origin is typing.Union:
        return any(_has_type(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and math.isfinite(value)
        )
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and all(_has_type(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _has_type(k, args[0]) and _has_type(v, args[1]) for k, v in value.items()
        )
    raise TypeError(f"no JSON type check for the annotation {hint!r}")
