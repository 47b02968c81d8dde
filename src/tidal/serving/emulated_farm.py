"""Many emulated engines in one process: one asyncio server, one listening socket per engine.

In: ``FarmSettings`` (a simulator scenario, the time scale ``k``, which of its engines, a seed)
and the bound sockets to serve on (inherited from the parent through ``$TIDAL_LISTEN_FDS``, one
per engine, in order; or bound here on ``ports``). Out: every engine at its own URL with every
route of the built-in engine (``engine_server.build_engine_app`` over an ``EmulatedEngine``), so
the proxy, the adapters and the driver talk to each as to a built-in engine on its own port;
``--urls-file`` gets ``{"engines": {name: url}, "k": k, "emulated": true}`` once all listen.

One uvicorn server holds all the sockets; a small ASGI dispatcher hands each connection to the
app of the port it arrived on. The engines' loops start and stop with the server. 64-256
engines fit on 2 cores: an idle engine costs a timer, a request one task.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

LISTEN_FDS_ENV = "TIDAL_LISTEN_FDS"


class FarmSettings(BaseModel):
    """``tidal emulate``: the emulated engines of a simulator scenario."""

    model_config = ConfigDict(extra="forbid")

    scenario: str = Field(..., description="Simulator scenario: a shipped name or a YAML path.")
    k: float = Field(1.0, gt=0, description="Time scale: every emulated duration is divided by k.")
    engines: list[str] = Field(
        default_factory=list,
        json_schema_extra={"flag": "--engine"},
        description="Engine of the scenario to serve (s<j> standalone, c<i> a cell; "
        "repeatable; default: all of them).",
    )
    host: str = Field("127.0.0.1", description="Address to listen on.")
    ports: list[int] = Field(
        default_factory=list,
        json_schema_extra={"flag": "--port"},
        description="Port of each engine, in order (repeatable; default: the kernel picks).",
    )
    seed: int = Field(0, description="Seed of the token ids of requests without their own.")
    name: str | None = Field(None, description="Served model name (default: the scenario's).")
    stream_tick_s: float = Field(
        1.0, gt=0, description="Real seconds between a streamed request's progress chunks."
    )
    urls_file: str | None = Field(
        None, description="Write the engines' URLs here (JSON) once every engine listens."
    )


def served_name(s: FarmSettings) -> str:
    from tidal.serving.emulated_timing import resolved_scenario

    sc = resolved_scenario(s.scenario)
    return s.name or (sc.costmodel.model if sc.costmodel else sc.name)


def build_farm(s: FarmSettings, token: str | None, clock=None) -> tuple[list[str], list, list]:
    """(engine names, their ``EmulatedEngine`` objects, their ASGI apps) of ``s``."""
    from tidal.seeding import engine_seed
    from tidal.serving.emulated import EmulatedEngine
    from tidal.serving.emulated_timing import (
        EmulatedTiming,
        engine_slot,
        resolved_scenario,
        scenario_engines,
    )
    from tidal.serving.engine_server import build_engine_app

    sc = resolved_scenario(s.scenario)
    names = s.engines or [e.name for e in scenario_engines(sc)]
    served = s.name or (sc.costmodel.model if sc.costmodel else sc.name)
    engines, apps = [], []
    for name in names:
        timing = EmulatedTiming(sc, engine_slot(sc, name), s.k, clock or _wall())
        eng = EmulatedEngine(
            timing, name=name, seed=engine_seed(s.seed, name), stream_tick_s=s.stream_tick_s
        )
        engines.append(eng)
        apps.append(build_engine_app(eng, served, token))  # type: ignore[arg-type]
    return names, engines, apps


def _wall():
    from tidal.clock import WallClock

    return WallClock()


class PortDispatch:
    """ASGI: each connection to the app of the local port it arrived on; the lifespan starts
    and stops every engine's loop."""

    def __init__(self, by_port: dict[int, Any], engines: list, ready=None) -> None:
        self.by_port, self.engines, self.ready = by_port, engines, ready

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    for e in self.engines:
                        await e.start()
                    if self.ready is not None:
                        self.ready()
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await asyncio.gather(*(e.stop() for e in self.engines))
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        server = scope.get("server") or (None, None)
        app = self.by_port.get(server[1])
        if app is None:
            raise RuntimeError(f"no emulated engine on port {server[1]}")
        await app(scope, receive, send)


def sockets_for(s: FarmSettings, count: int) -> list[socket.socket]:
    """The inherited listening sockets (``$TIDAL_LISTEN_FDS``), else ones bound on ``ports``."""
    from tidal.serving.launch import bound_socket

    fds = os.environ.pop(LISTEN_FDS_ENV, None)
    if fds:
        socks = [socket.socket(fileno=int(fd)) for fd in fds.split(",")]
    elif s.ports:
        socks = []
        for port in s.ports:
            sock = socket.socket(socket.AF_INET6 if ":" in s.host else socket.AF_INET)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((s.host, port))
            sock.listen(4096)
            socks.append(sock)
    else:
        socks = [bound_socket(s.host) for _ in range(count)]
    if len(socks) != count:
        raise SystemExit(f"{count} engines need {count} sockets, not {len(socks)}")
    return socks


def serve_farm(s: FarmSettings, token: str | None) -> None:
    """Serve the engines of ``s`` until interrupted (blocks)."""
    import uvicorn

    from tidal.serving.guard import MAX_HEADER_BYTES, READ_TIMEOUT_S, bounded_protocol

    names, engines, apps = build_farm(s, token)
    socks = sockets_for(s, len(names))
    ports = [sock.getsockname()[1] for sock in socks]
    host = s.host if ":" not in s.host else f"[{s.host}]"
    urls = {n: f"http://{host}:{p}" for n, p in zip(names, ports, strict=True)}

    def ready() -> None:
        if s.urls_file:
            tmp = Path(s.urls_file).with_suffix(".tmp")
            tmp.write_text(json.dumps({"emulated": True, "k": s.k, "engines": urls}))
            tmp.replace(s.urls_file)

    app = PortDispatch(dict(zip(ports, apps, strict=True)), engines, ready)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=120,
        backlog=4096,
        http=bounded_protocol(READ_TIMEOUT_S, MAX_HEADER_BYTES),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        lifespan="on",
    )
    uvicorn.Server(config).run(sockets=socks)


class FarmProcess:
    """``tidal emulate`` as a child process: its engines' URLs, stopped on ``stop``."""

    def __init__(self, proc, urls: dict[str, str], k: float, log) -> None:
        self.proc, self.urls, self.k, self._log = proc, urls, k, log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        from tidal.serving.launch import stop_child

        stop_child(self.proc, self._log)


def start_farm(
    scenario: str,
    k: float = 1.0,
    engines: list[str] | None = None,
    *,
    token: str | None = None,
    log_path: Path | None = None,
    timeout_s: float = 60.0,
    **fields: Any,
) -> FarmProcess:
    """``tidal emulate`` serving ``engines`` of ``scenario`` (default all) at time scale ``k``
    on sockets bound here (handed over, never raced for); ready once every engine's
    ``/health`` answers (bounded by ``timeout_s``). ``token`` goes through the environment."""
    import subprocess
    import sys
    import tempfile
    import time

    import httpx

    from tidal.errors import TimeoutExpired
    from tidal.serving.emulated_timing import resolved_scenario, scenario_engines
    from tidal.serving.launch import bound_socket

    names = list(engines or [e.name for e in scenario_engines(resolved_scenario(scenario))])
    host = fields.get("host", "127.0.0.1")
    socks = [bound_socket(host) for _ in names]
    with tempfile.NamedTemporaryFile(prefix="tidal-emulate-", suffix=".json", delete=False) as f:
        urls_file = Path(f.name)
    urls_file.unlink()
    s = FarmSettings(scenario=scenario, k=k, engines=names, urls_file=str(urls_file), **fields)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        LISTEN_FDS_ENV: ",".join(str(x.fileno()) for x in socks),
        "TIDAL_ENGINE_TOKEN": token or "",
    }
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.cli", "emulate", "--settings", s.model_dump_json()],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=tuple(x.fileno() for x in socks),
        )
    finally:
        for x in socks:
            x.close()
    farm = FarmProcess(proc, {}, k, log)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            farm.stop()
            raise TimeoutExpired(f"tidal emulate exited with {proc.returncode}")
        if urls_file.exists():
            farm.urls = json.loads(urls_file.read_text())["engines"]
            try:
                if all(
                    httpx.get(f"{u}/health", headers=headers, timeout=2.0).status_code == 200
                    for u in farm.urls.values()
                ):
                    urls_file.unlink(missing_ok=True)
                    return farm
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    farm.stop()
    urls_file.unlink(missing_ok=True)
    raise TimeoutExpired(f"tidal emulate: {len(names)} engines not healthy in {timeout_s} s")
