"""Start and stop ``tidal engine`` / ``tidal proxy`` as real child processes on loopback.

In: a model directory or engine URLs, a port, and the settings (``contracts.launch``'s
``EngineSettings``, ``ProxySettings``: passed to the child as JSON). Out: a handle that waits
until ``/health`` answers (bounded) and stops the process (terminate, then kill). Used by the
integration tests, the benchmarks and local runs.

A port tidal picks itself is never raced for: the parent binds and listens (port 0, the kernel
chooses), hands the socket to the child (``pass_fds``, its number in ``$TIDAL_LISTEN_FD``) and
closes its copy; the child serves on that very socket (``guard.run_server``). Between the choice and
the child's listen nothing else can take the port, which ``free_port`` (pick, close, let the
child bind later) could not promise while other servers, vLLM's many internal ports among them,
start alongside.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tidal.contracts.launch import EngineSettings, ProxySettings
from tidal.errors import TimeoutExpired

LISTEN_FD_ENV = "TIDAL_LISTEN_FD"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a server tidal cannot hand a socket to (vLLM, SGLang, Ray)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bound_socket(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket listening on ``host`` on a port the kernel picks: the port is the holder's
    until the process it is handed to closes it (connections wait in the backlog meanwhile).

    ``SO_REUSEADDR`` is set only after the bind: bound without it, nobody else (uvicorn and
    vLLM set it, and on Linux two sockets that both set it may share a port while neither
    listens) can take the port before it listens; set before the listen, the connections it
    accepts inherit it, so a later server may bind the port while they linger in TIME_WAIT
    (an engine restarted on its old address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.listen(4096)
    except OSError:
        sock.close()
        raise
    return sock


class ServerProcess:
    def __init__(
        self,
        args: list[str],
        port: int,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        health_path: str = "/health",
        token: str | None = None,
        host: str = "127.0.0.1",
        sock: socket.socket | None = None,
    ) -> None:
        """``sock``: the bound socket the child listens on (its port is ``port``); it goes
        to the child and is closed here once the child has it."""
        self.port, self.args, self.health_path = port, args, health_path
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = f"http://{host}:{port}"
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        verbosity = os.environ.get("TIDAL_CHILD_LOG", "")  # e.g. "-vv" for DEBUG
        pass_fds: tuple[int, ...] = ()
        if sock is not None:
            pass_fds = (sock.fileno(),)
            full_env[LISTEN_FD_ENV] = str(sock.fileno())
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tidal.cli", *([verbosity] if verbosity else []), *args],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=full_env,
                pass_fds=pass_fds,
            )
        finally:
            if sock is not None:
                sock.close()  # the child holds its own copy

    def wait_healthy(self, timeout_s: float = 60.0) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TimeoutExpired(
                    f"{self.args[0]} on port {self.port} exited with {self.proc.returncode}"
                )
            try:
                if (
                    httpx.get(
                        f"{self.url}{self.health_path}", headers=self.headers, timeout=1.0
                    ).status_code
                    == 200
                ):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutExpired(f"{self.args[0]} on port {self.port} not healthy in {timeout_s} s")

    def kill(self) -> None:
        """Crash it (SIGKILL): what an engine failure looks like to the proxy."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        stop_child(self.proc, self._log)


def stop_child(proc: subprocess.Popen, log) -> None:
    """Stop a child server: SIGTERM, 10 s, then SIGKILL; close its log file (not DEVNULL)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if log is not subprocess.DEVNULL:
        log.close()


def start_engine(
    model_dir: str | Path,
    port: int | None = None,
    *,
    token: str | None = None,
    log_path: Path | None = None,
    **fields: Any,
) -> ServerProcess:
    """``tidal engine`` on ``host:port`` with ``EngineSettings(**fields)`` (given as ``--settings
    JSON``; the defaults the contract's); ``token`` (default ``$TIDAL_ENGINE_TOKEN``, the run's
    token in a runtime actor) goes through the environment, never the command line. A host
    beyond loopback (a cluster node's address) needs the token: the engine refuses otherwise."""
    host = fields.get("host", "127.0.0.1")
    sock = None if port else bound_socket(host)
    port = port or sock.getsockname()[1]
    token = token if token is not None else os.environ.get("TIDAL_ENGINE_TOKEN")
    settings = EngineSettings(
        model_dir=str(model_dir),
        port=port,
        **{k: str(v) if k == "spill_dir" and v is not None else v for k, v in fields.items()},
    )
    return ServerProcess(
        engine_args(settings),
        port,
        log_path,
        env={"TIDAL_ENGINE_TOKEN": token or ""},
        token=token,
        host=host,
        sock=sock,
    )


def start_proxy(
    engines: list[str],
    cells: list[str],
    admin_token: str,
    port: int | None = None,
    *,
    engine_token: str | None = None,
    log_path: Path | None = None,
    **fields: Any,
) -> ServerProcess:
    """``tidal proxy`` on ``port`` with ``ProxySettings(engines=..., cells=..., **fields)``
    (given as ``--settings JSON``; the defaults the contract's); ready once ``/live`` answers
    (``/health`` is 503 until an engine serves). The tokens go through the environment:
    ``engine_token`` default ``$TIDAL_ENGINE_TOKEN``, else the admin token."""
    sock = None if port else bound_socket()
    port = port or sock.getsockname()[1]
    if "admission" in fields:  # a latency target in seconds, or a rule's name
        fields["admission"] = str(fields["admission"])
    settings = ProxySettings(engines=list(engines), cells=list(cells), port=port, **fields)
    env = {"TIDAL_ADMIN_TOKEN": admin_token}
    if engine_token is not None:
        env["TIDAL_ENGINE_TOKEN"] = engine_token
    return ServerProcess(
        proxy_args(settings), port, log_path, env=env, health_path="/live", sock=sock
    )


def engine_args(settings: EngineSettings) -> list[str]:
    """The command line of ``tidal engine`` with ``settings`` (no secret on it)."""
    return ["engine", "--settings", settings.model_dump_json()]


def proxy_args(settings: ProxySettings) -> list[str]:
    """The command line of ``tidal proxy`` with ``settings`` (no secret on it)."""
    return ["proxy", "--settings", settings.model_dump_json()]
