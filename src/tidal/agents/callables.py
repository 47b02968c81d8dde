"""The user's code named in a run config: ``module:function`` (an importable module) or
``path/to/file.py:function`` (a file, loaded by path, as verl's ``custom_reward_function.path``).

In: the spec string and the dotted config field it came from. Out: the callable, or a one-line
``ConfigError`` naming the field (a malformed spec, a module that does not import, with the
exception's own line, or a name that is missing or not callable). Nothing is called here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from tidal.errors import ConfigError
from tidal.user_modules import load_module


def load_callable(spec: str, field: str) -> Callable[..., Any]:
    """The function ``spec`` names (``module:function`` or ``file.py:function``)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ConfigError(field, f"{spec!r}: expected 'module:function' or 'file.py:function'")
    module = load_module(where, field)
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(field, f"{spec!r}: {where} has no attribute {name!r}")
    if not callable(fn):
        raise ConfigError(field, f"{spec!r}: {name} is not callable")
    return fn


def parameters(fn: Callable[..., Any]) -> list[str]:
    """The names ``fn`` takes (``**kwargs`` is given as ``**``)."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        out.append("**" if p.kind is p.VAR_KEYWORD else p.name)
    return out
