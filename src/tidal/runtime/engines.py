"""The engines of a run: typed ids and the Ray actors that own the engine processes.

In: the run config, the model directory, the placement (one reserved bundle per engine) and
the optional CPU-quota groups. Out: ``Engines``, holding one actor per ``EngineId`` (standalone
engines ``s<j>``, cells ``c<i>``), their URLs and process ids, the body each one joins the proxy
with, and a fresh actor for an id (a replacement reuses the id's bundle). Every Ray call here is
bounded (``start_timeout_s``). Invariant: an engine id is parsed once (``EngineId.parse``);
nothing else splits the string.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from tidal.backends import engine_backend, load
from tidal.config import RunConfig
from tidal.errors import ConfigError
from tidal.runtime.cell import RuntimeFailure
from tidal.seeding import engine_seed

if TYPE_CHECKING:
    from tidal.runtime.cpuquota import CpuGroups
    from tidal.runtime.placement import Placement
    from tidal.runtime.ray_types import ActorHandle, ObjectRef

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class EngineId:
    """``s<j>``: the j-th standalone engine; ``c<i>``: the engine of cell i."""

    kind: str  # "s" | "c"
    index: int

    @classmethod
    def parse(cls, name: str) -> EngineId:
        if len(name) < 2 or name[0] not in "sc" or not name[1:].isdigit():
            raise RuntimeFailure(f"engine id {name!r}: expected s<j> or c<i>")
        return cls(name[0], int(name[1:]))

    @classmethod
    def cell(cls, index: int) -> EngineId:
        return cls("c", index)

    @property
    def standalone(self) -> bool:
        return self.kind == "s"

    def __str__(self) -> str:
        return f"{self.kind}{self.index}"


def model_path(cfg: RunConfig, out: Path) -> Path:
    """The model every engine serves and the core trains: ``tiny`` (created in the run
    directory), a bundled model (converted once, no download) or a model directory."""
    from tidal.models import create_tiny
    from tidal.models.fetch import KNOWN, fetch

    rt = cfg.runtime
    if rt.model == "tiny":
        return create_tiny(
            out / "model",
            seed=cfg.seed,
            n_layers=rt.tiny_layers,
            d_model=rt.tiny_d_model,
            n_heads=4,
            d_ff=4 * rt.tiny_d_model,
            max_seq_len=rt.tiny_max_seq_len,
        )
    if rt.model in KNOWN:
        return fetch(rt.model)
    if not (Path(rt.model) / "config.json").is_file():
        raise ConfigError(
            "runtime.model",
            f"{rt.model}: not 'tiny', a bundled model "
            f"({', '.join(KNOWN)}) or a model directory with config.json",
        )
    return Path(rt.model)


def served_name(cfg: RunConfig) -> str:
    """The name engines serve the model under: ``tiny``, the bundled model's name, or the
    model directory's name."""
    return Path(cfg.runtime.model).name


def by_value_if_user_file(ray: ModuleType, cls: Any) -> Any:
    """``cls``, its module registered with Ray's pickler by value when it is a user's file
    loaded by path (``runtime.backend_modules``): no worker could import it by its name."""
    import sys

    from tidal.user_modules import loaded_from_file

    if loaded_from_file(cls.__module__):
        ray.cloudpickle.register_pickle_by_value(sys.modules[cls.__module__])
    return cls


def cell_backend(cfg: RunConfig, index: int) -> str:
    """What serves cell ``index``: its own ``cluster.cells[i].backend``, else
    ``runtime.cell_backend``."""
    return cfg.cluster.cell_specs()[index].backend or cfg.runtime.cell_backend


def engine_ids(cfg: RunConfig) -> list[EngineId]:
    """Standalone engines first, then cells in order."""
    return [EngineId("s", j) for j in range(cfg.cluster.standalone_count)] + [
        EngineId.cell(i) for i in range(len(cfg.cluster.cell_specs()))
    ]


class Engines:
    """One actor per engine id; each actor's engine process is started, probed and stopped
    through it. Handles change only through ``replace`` (the cell supervisor)."""

    def __init__(
        self,
        ray: ModuleType,
        cfg: RunConfig,
        out: Path,
        model_dir: Path,
        placement: Placement,
        cpu_groups: CpuGroups | None,
        token: str,
    ) -> None:
        self.ray, self.cfg, self.rt, self.token = ray, cfg, cfg.runtime, token
        self.out, self.model_dir = out, model_dir
        self.placement, self.cpu_groups = placement, cpu_groups
        self.ids = engine_ids(cfg)
        # host class ("module:Class" of a backend's entry) -> its Ray actor class, made on
        # first use
        self._actor_classes: dict[str, Any] = {}
        self.actors: dict[EngineId, Any] = {}
        self.urls: dict[EngineId, str] = {}
        self.start_pids: dict[EngineId, int] = {}
        self.pids: dict[EngineId, int] = {}
        self.gpu_ids: dict[EngineId, list[int]] = {}
        # placement (Ray node ids): an engine on another node than the driver gets weights
        # through Ray's object store instead of the driver's file (``load``)
        from tidal.runtime.nodes import here

        self.driver_node = here().node_id
        self.nodes: dict[EngineId, str | None] = {}
        self.hosts: dict[EngineId, str | None] = {}  # machine names: where a pid means a process
        self._blob: tuple[str, Any] | None = None  # (path, object ref) of the newest version
        # the engine token reaches the actors through Ray's object store (``cell.adopt_token``)
        self.token_box = [ray.put(token)] if token else None

    def backend(self, eid: EngineId) -> str:
        """What serves engine ``eid``: builtin, vllm or sglang (cells only)."""
        if eid.standalone:
            return self.rt.standalone_backend
        return cell_backend(self.cfg, eid.index)

    def is_server(self, eid: EngineId) -> bool:
        """A server of its own (vLLM, SGLang): it loads a version from the driver's file, out
        of routing."""
        return engine_backend(self.backend(eid)).server

    def cell(self, index: int) -> ActorHandle:
        return self.actors[EngineId.cell(index)]

    def new_actor(self, eid: EngineId) -> ActorHandle:
        """An engine actor pinned to its reserved bundle (a replacement reuses it)."""
        # its engine takes calls with the token only (given to ``start``); the actor sets
        # GLOO_SOCKET_IFNAME to the interface of its node's address (``nodes.here``)
        env = {"OMP_NUM_THREADS": "1"}
        # Threaded (max_concurrency): a health probe is answered while a long sleep, wake or
        # weight load runs; the actuator never sends one cell two state changes at once.
        device = self.rt.device if self.rt.use_gpus else "cpu"
        groups, name = self.cpu_groups, str(eid)
        backend = engine_backend(self.backend(eid))
        host = backend.standalone_host if eid.standalone else backend.cell_host
        if host is None:
            raise ConfigError(
                "runtime.cell_backend" if not eid.standalone else "runtime.standalone_backend",
                f"'{backend.name}' cannot serve {eid}",
            )
        if host not in self._actor_classes:
            self._actor_classes[host] = self.ray.remote(by_value_if_user_file(self.ray, load(host)))
        cls = self._actor_classes[host]
        if backend.settings is not None:  # a server: built from its settings (and the device)
            extra = [load(backend.settings)(self.rt), *([] if eid.standalone else [device])]
        else:
            extra = [
                device,
                groups.path(name) if groups is not None else None,
                served_name(self.cfg),
                engine_seed(self.cfg.seed, name),
                self.rt.deterministic,
            ]
        return cls.options(
            runtime_env={"env_vars": env}, max_concurrency=4, **self.placement.options(name)
        ).remote(
            name, str(self.model_dir), self.rt.engine_max_batch, str(self.out / "logs"), *extra
        )

    def start_call(self, actor: ActorHandle) -> ObjectRef:
        """The Ray call that starts ``actor``'s engine (bounded by ``start_timeout_s``) with
        the run's engine token."""
        return actor.start.remote(self.rt.start_timeout_s, self.token_box)

    def start(self) -> None:
        """Every actor created and its engine started (bounded); an engine's own one-line
        error is raised as itself."""
        ray, timeout_s = self.ray, self.rt.start_timeout_s
        for eid in self.ids:
            self.actors[eid] = self.new_actor(eid)
        try:
            urls = ray.get(
                [self.start_call(a) for a in self.actors.values()], timeout=timeout_s + 30
            )
            described = ray.get(
                [a.describe.remote() for a in self.actors.values()], timeout=timeout_s
            )
        except ray.exceptions.RayTaskError as exc:
            raise (exc.cause if isinstance(exc.cause, RuntimeFailure) else exc) from None
        except ray.exceptions.GetTimeoutError:
            raise RuntimeFailure(
                f"engines not started within {timeout_s} s "
                "(runtime.start_timeout_s; see logs/engine-*.log)"
            ) from None
        self.urls = dict(zip(self.actors, urls, strict=True))
        for d in described:
            eid = EngineId.parse(d["name"])
            self.start_pids[eid], self.gpu_ids[eid] = d["pid"], d["gpu_ids"]
            self.nodes[eid], self.hosts[eid] = d.get("node_id"), d.get("host")
        self.pids = dict(self.start_pids)

    def on_this_host(self, eid: EngineId) -> bool:
        """Whether ``eid``'s processes run on the driver's machine (their pids mean something
        here); unknown counts as here (an embedded run)."""
        import socket

        return self.hosts.get(eid) in (None, socket.gethostname())

    def transport(self, eid: EngineId) -> str:
        """How ``eid`` gets a weight version: ``file`` (the driver's file, on the driver's
        node) or ``object`` (pulled across nodes by Ray's object store and written to the
        engine's node, whatever serves there: the built-in engine, vLLM or SGLang load it
        from that path)."""
        node = self.nodes.get(eid)
        if node is None or node == self.driver_node:
            return "file"
        return "object"

    def blob(self, path: str) -> ObjectRef:
        """The version at ``path`` in Ray's object store (put once per version; blocking:
        call it off the event loop)."""
        if self._blob is None or self._blob[0] != path:
            self._blob = (path, self.ray.put(Path(path).read_bytes()))
        return self._blob[1]

    def load(self, eid: EngineId, actor: ActorHandle, path: str, label: str) -> ObjectRef:
        """The Ray call that loads ``label`` into ``eid`` by its transport (``blob`` first
        for an ``object`` engine)."""
        if self.transport(eid) == "file":
            return actor.load_weights.remote(path, label)
        return actor.load_weights_blob.remote(self.blob(path), label)

    def join_body(self, eid: EngineId, url: str) -> dict[str, Any]:
        """What the proxy's ``POST /tidal/engines`` gets for this engine."""
        cl = self.cfg.cluster
        if eid.standalone:
            return {
                "id": str(eid),
                "url": url,
                "kind": "standalone",
                "cap": cl.standalone_slots,
                "backend": self.rt.standalone_backend,
            }
        return {
            "id": str(eid),
            "url": url,
            "kind": "cell",
            "cell_index": eid.index,
            "cap": cl.cell_specs()[eid.index].slots,
            "backend": self.backend(eid),
        }

    def stop(self, extra_pids: list[int]) -> None:
        """Stop every engine (bounded), then end by pid what this run started and is still
        there (engines, and the satellites in ``extra_pids``)."""
        if not self.actors:
            return
        try:
            self.ray.wait(
                [a.stop.remote() for a in self.actors.values()],
                num_returns=len(self.actors),
                timeout=60,
            )
        except Exception:
            log.exception("stopping engines")
        local = [p for e, p in self.pids.items() if self.on_this_host(e)]
        for pid in [*local, *extra_pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
