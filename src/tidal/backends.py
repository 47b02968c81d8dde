"""Engine backends: one registry entry per backend, everything that differs between them.

In: a backend's name (``runtime.cell_backend``, ``cluster.cells[i].backend``,
``runtime.standalone_backend``, a proxy's ``join``). Out: its ``EngineBackend`` entry: the run
config check it needs, the host class a cell's or a standalone engine's Ray actor runs, the
settings that host is built with, the adapter the proxy talks to it through, the venv package a
server needs, and whether it is a server that loads a published version out of routing.

The entries name code by ``"module:attribute"`` and load it on use: this module imports
nothing of ``serving`` or ``runtime`` (the proxy reads the adapter, the runtime the host, and
neither drags in the other), and a backend's heavy modules load only in runs that use it.
Adding a backend is one ``register_backend`` call; the rest of tidal asks the registry, never
compares a backend's name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.errors import ConfigError

if TYPE_CHECKING:
    from tidal.config import RunConfig


@dataclass(frozen=True)
class EngineBackend:
    """What tidal needs to run engines of one kind."""

    name: str
    label: str  # how messages name its servers ("vLLM")
    adapter: str  # the proxy's ``EngineAdapter`` for it
    cell_host: str | None  # a cell's actor class (None: it cannot serve cells)
    standalone_host: str | None  # a standalone engine's actor class (None: cells only)
    # RuntimeConfig -> dict: what a server's host is built with (None: the built-in host, built
    # from the run's device, CPU quota, seed and determinism instead)
    settings: str | None = None
    # RunConfig -> None: a ``ConfigError`` naming the field unless the run can serve it
    check: str | None = None
    # a server process of its own that loads a published version from the driver's file,
    # held out of the proxy's routing meanwhile (``vllm_host.load_weights``)
    server: bool = False
    package: str | None = None  # the module its venv must have (``tidal check``)
    python_field: str | None = None  # the RuntimeConfig field naming that venv's python


_REGISTRY: dict[str, EngineBackend] = {}


def register_backend(backend: EngineBackend) -> EngineBackend:
    """Add ``backend``; a name taken by another entry is refused."""
    if _REGISTRY.get(backend.name, backend) != backend:
        raise ConfigError("backend", f"engine backend {backend.name!r} is registered already")
    _REGISTRY[backend.name] = backend
    return backend


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def engine_backend(name: str) -> EngineBackend:
    """The entry of ``name``; an unknown one is a ``ConfigError`` listing the known."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ConfigError("backend", f"unknown engine backend {name!r} "
                          f"({', '.join(_REGISTRY)})")
    return entry


def load(ref: str) -> Callable[..., object]:
    """The object ``"module:attribute"`` names."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def configured_backends(cfg: RunConfig) -> list[EngineBackend]:
    """Every backend the run config names (each cell's, the standalone engines'), in the
    registry's order; the standalone one even without standalone engines (its check says
    whether that is an error)."""
    names = {spec.backend or cfg.runtime.cell_backend for spec in cfg.cluster.cell_specs()}
    names.add(cfg.runtime.standalone_backend)
    return [b for b in _REGISTRY.values() if b.name in names]


register_backend(EngineBackend(
    name="builtin", label="built-in", adapter="tidal.serving.adapters:BuiltinAdapter",
    cell_host="tidal.runtime.cell:EngineHost",
    standalone_host="tidal.runtime.cell:EngineHost"))
register_backend(EngineBackend(
    name="vllm", label="vLLM", adapter="tidal.serving.vllm_adapter:VLLMAdapter",
    cell_host="tidal.runtime.vllm_cell:VLLMCellHost",
    standalone_host="tidal.runtime.vllm_host:VLLMEngineHost",
    settings="tidal.runtime.vllm_host:vllm_settings", check="tidal.runtime.vllm_cell:check",
    server=True, package="vllm", python_field="vllm_python"))
register_backend(EngineBackend(
    name="sglang", label="SGLang", adapter="tidal.serving.sglang_adapter:SGLangAdapter",
    cell_host="tidal.runtime.sglang_cell:SGLangCellHost", standalone_host=None,
    settings="tidal.runtime.sglang_cell:sglang_settings",
    check="tidal.runtime.sglang_cell:check", server=True, package="sglang",
    python_field="sglang_python"))
