"""Loading the user's modules, below every registry: one named in a config (a dotted module, or
a ``path/to/file.py`` loaded by path) or installed as an entry point of a group; importing one
runs its registrations (``register_policy``: ``tidal.plugins``; ``register_backend``:
``tidal.backends``). It imports nothing of tidal but its errors, so ``tidal.config`` may use it.

In: a module spec and the dotted config field it came from. Out: the imported module (a file
is imported once per process, under a name derived from its resolved path), or a one-line
``ConfigError`` naming the field: a missing file, a module that does not import (with the
exception's own line), or a registration the module got wrong. Entry points of a group load
once per process; one that fails is remembered with its reason (``broken_plugins``) and named
where what it registers is asked for, never raised for a run that does not use it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

from tidal.errors import ConfigError

USER_PREFIX = "tidal_user_"  # the module name of a file loaded by path
_loaded_groups: set[str] = set()
_BROKEN: dict[str, str] = {}  # "group:name" of an entry point whose load failed -> why


def load_module(where: str, field: str) -> ModuleType:
    """``where`` imported: a ``.py`` path (loaded by path) or a dotted module name."""
    is_file = where.endswith(".py")
    if is_file and not Path(where).is_file():
        raise ConfigError(field, f"{where}: no such file")
    try:
        return _from_file(Path(where)) if is_file else importlib.import_module(where)
    except ConfigError as exc:  # the module's own registration refused something
        raise ConfigError(field, f"{where}: {exc}") from None
    except Exception as exc:  # the user's module may raise anything at import
        raise ConfigError(
            field, f"{where} does not import: {type(exc).__name__}: {first_line(exc)}"
        ) from None


def load_registering(
    group: str,
    modules: list[str] | tuple[str, ...],
    field: str,
    registered: Callable[[], Iterable[str]],
    unregister: Callable[[str], None],
) -> None:
    """``group``'s entry points (once), then each of ``modules`` (``field``, or ``field.i`` of
    several), each registering into one registry (``registered`` lists its names). A module
    refused part-way leaves nothing it registered (``unregister``): fixed, it loads again."""
    load_entry_points(group)
    for i, where in enumerate(modules):
        before = set(registered())
        try:
            load_module(where, field if len(modules) == 1 else f"{field}.{i}")
        except ConfigError:
            for name in set(registered()) - before:
                unregister(name)
            raise


def loaded_from_file(module_name: str) -> bool:
    """Whether ``module_name`` is a user's file loaded by path (no other process can import it
    by that name: its classes travel by value)."""
    return module_name.startswith(USER_PREFIX)


def load_entry_points(group: str) -> None:
    if group in _loaded_groups:
        return
    _loaded_groups.add(group)
    for ep in importlib.metadata.entry_points(group=group):
        try:
            ep.load()
        except Exception as exc:  # a broken plugin must not stop runs that do not use it
            _BROKEN[f"{group}:{ep.name}"] = f"{ep.value}: {type(exc).__name__}: {first_line(exc)}"


def broken_plugins(group: str) -> dict[str, str]:
    """Entry point name -> why it did not load, for ``group``."""
    prefix = f"{group}:"
    return {k.removeprefix(prefix): v for k, v in _BROKEN.items() if k.startswith(prefix)}


def _from_file(path: Path) -> ModuleType:
    name = f"{USER_PREFIX}{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else "(no message)"
