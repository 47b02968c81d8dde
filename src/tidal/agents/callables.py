"""The user's code named in a run config: ``module:function`` (an importable module) or
``path/to/file.py:function`` (a file, loaded by path, as verl's ``custom_reward_function.path``).

In: the spec string and the dotted config field it came from. Out: the callable, or a one-line
``ConfigError`` naming the field (a malformed spec, a module that does not import, with the
exception's own line, or a name that is missing or not callable). Nothing is called here.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from tidal.errors import ConfigError


def load_callable(spec: str, field: str) -> Callable[..., Any]:
    """The function ``spec`` names (``module:function`` or ``file.py:function``)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ConfigError(field, f"{spec!r}: expected 'module:function' or 'file.py:function'")
    module = _module(where, field)
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


def _module(where: str, field: str) -> ModuleType:
    try:
        if where.endswith(".py"):
            return _from_file(Path(where), field)
        return importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as exc:  # the user's module may raise anything at import
        raise ConfigError(
            field, f"{where} does not import: {type(exc).__name__}: {_first_line(exc)}"
        ) from None


def _from_file(path: Path, field: str) -> ModuleType:
    if not path.is_file():
        raise ConfigError(field, f"{path}: no such file")
    name = f"tidal_user_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(field, f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "(no message)"
