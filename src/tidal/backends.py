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
compares a backend's name. A user's backend registers from a module the run config names
(``runtime.backend_modules``: a ``.py`` file or a dotted module) or from an installed package's
``tidal.backends`` entry point (``load_backends``); its references may name the
module's own classes (``f"{__name__}:Class"``), and a file's classes reach the Ray workers by
value (``runtime.engines``). docs/engines.md, "Your own backend".
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.errors import ConfigError

if TYPE_CHECKING:
    from tidal.config import RunConfig


BACKEND_GROUP = "tidal.backends"  # the entry point group of installed backends
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # what a config may name
BUILTIN_BACKENDS = ("builtin", "vllm", "sglang", "emulated")


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
    # RuntimeConfig -> bool: its engines serve in bfloat16, so a published version may be
    # written in bfloat16 (half the bytes) when every engine of the run does (None: float32)
    serves_bfloat16: str | None = None


_REGISTRY: dict[str, EngineBackend] = {}


def register_backend(backend: EngineBackend) -> EngineBackend:
    """Add ``backend``; a name taken by another entry, a name a config cannot hold, an entry
    that serves nothing or a reference that is not ``"module:attribute"`` is refused."""
    if not isinstance(backend, EngineBackend):
        raise ConfigError(
            "backend", f"register_backend takes an EngineBackend, not {type(backend).__name__}"
        )
    if not NAME.match(backend.name):
        raise ConfigError(
            "backend", f"engine backend name {backend.name!r}: letters, digits, '_', '.', '-' only"
        )
    if _REGISTRY.get(backend.name, backend) != backend:
        raise ConfigError("backend", f"engine backend {backend.name!r} is registered already")
    if backend.cell_host is None and backend.standalone_host is None:
        raise ConfigError(
            "backend",
            f"engine backend {backend.name!r} names neither a cell_host nor a standalone_host",
        )
    for field in (
        "adapter",
        "cell_host",
        "standalone_host",
        "settings",
        "check",
        "serves_bfloat16",
    ):
        ref = getattr(backend, field)
        if ref is not None and not _is_ref(ref):
            raise ConfigError(
                "backend",
                f"engine backend {backend.name!r}: {field} {ref!r} is not 'module:attribute'",
            )
    if backend.python_field is not None:
        from tidal.config import RuntimeConfig  # (config reads this registry only lazily)

        if not hasattr(RuntimeConfig, f"resolved_{backend.python_field}"):
            raise ConfigError(
                "backend",
                f"engine backend {backend.name!r}: python_field "
                f"{backend.python_field!r} is not a venv setting of runtime "
                f"(vllm_python, sglang_python)",
            )
    _REGISTRY[backend.name] = backend
    return backend


def unregister_backend(name: str) -> None:
    """Remove a user's entry (a module refused part-way leaves none of its backends); tidal's
    own stay."""
    if name in BUILTIN_BACKENDS:
        raise ConfigError("backend", f"engine backend {name!r} is tidal's own")
    _REGISTRY.pop(name, None)


def _is_ref(ref: object) -> bool:
    if not isinstance(ref, str):
        return False
    module, sep, attr = ref.partition(":")
    return bool(sep and module and attr.isidentifier())


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def engine_backend(name: str) -> EngineBackend:
    """The entry of ``name``; an unknown one is a ``ConfigError`` listing the known."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ConfigError("backend", f"unknown engine backend {name!r} ({', '.join(_REGISTRY)})")
    return entry


def load(ref: str) -> Callable[..., object]:
    """The object ``"module:attribute"`` names."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def load_backends(
    modules: list[str] | tuple[str, ...] = (), field: str = "runtime.backend_modules"
) -> None:
    """The ``tidal.backends`` entry points (once), then each of ``modules`` (each registers
    engine backends with ``tidal.backends.register_backend``). A module refused part-way leaves
    none of its backends registered."""
    from tidal.user_modules import load_registering

    load_registering(BACKEND_GROUP, modules, field, backend_names, unregister_backend)


def serving_backends(cfg: RunConfig) -> list[EngineBackend]:
    """The backends of the run's engines (each cell's; the standalone engines' when it has
    any), in the registry's order."""
    return _named(cfg, standalone=cfg.cluster.standalone_count > 0)


def _named(cfg: RunConfig, standalone: bool) -> list[EngineBackend]:
    """The registry's entries of each cell's backend, and of the standalone one if asked."""
    names = {spec.backend or cfg.runtime.cell_backend for spec in cfg.cluster.cell_specs()}
    if standalone:
        names.add(cfg.runtime.standalone_backend)
    return [b for b in _REGISTRY.values() if b.name in names]


def published_dtype(cfg: RunConfig) -> str:
    """What a published version's file holds: 'bfloat16' when every engine of the run serves
    in bfloat16 (its backend says so for this config: vLLM on GPUs), else 'float32' (the
    built-in engine, SGLang's float32 cells, a backend that does not say)."""
    engines = serving_backends(cfg)
    if engines and all(
        b.serves_bfloat16 is not None and load(b.serves_bfloat16)(cfg.runtime) for b in engines
    ):
        return "bfloat16"
    return "float32"


def configured_backends(cfg: RunConfig) -> list[EngineBackend]:
    """Every backend the run config names (each cell's, the standalone engines'), in the
    registry's order; the standalone one even without standalone engines (its check says
    whether that is an error)."""
    return _named(cfg, standalone=True)


register_backend(
    EngineBackend(
        name="builtin",
        label="built-in",
        adapter="tidal.serving.adapters:BuiltinAdapter",
        cell_host="tidal.runtime.cell:EngineHost",
        standalone_host="tidal.runtime.cell:EngineHost",
    )
)
register_backend(
    EngineBackend(
        name="vllm",
        label="vLLM",
        adapter="tidal.serving.vllm_adapter:VLLMAdapter",
        cell_host="tidal.runtime.vllm_cell:VLLMCellHost",
        standalone_host="tidal.runtime.vllm_host:VLLMEngineHost",
        settings="tidal.runtime.vllm_host:vllm_settings",
        check="tidal.runtime.vllm_cell:check",
        server=True,
        package="vllm",
        python_field="vllm_python",
        serves_bfloat16="tidal.runtime.vllm_host:serves_bfloat16",
    )
)
register_backend(
    EngineBackend(
        name="sglang",
        label="SGLang",
        adapter="tidal.serving.sglang_adapter:SGLangAdapter",
        cell_host="tidal.runtime.sglang_cell:SGLangCellHost",
        standalone_host=None,
        settings="tidal.runtime.sglang_cell:sglang_settings",
        check="tidal.runtime.sglang_cell:check",
        server=True,
        package="sglang",
        python_field="sglang_python",
    )
)
register_backend(
    EngineBackend(
        name="emulated",
        label="emulated",  # a test double at scale: seeded tokens at a scenario's rates
        adapter="tidal.serving.adapters:BuiltinAdapter",  # it serves the built-in engine's routes
        cell_host="tidal.runtime.emulated_host:EmulatedHost",
        standalone_host="tidal.runtime.emulated_host:EmulatedHost",
        settings="tidal.runtime.emulated_host:emulated_settings",
        check="tidal.runtime.emulated_host:check",
    )
)
