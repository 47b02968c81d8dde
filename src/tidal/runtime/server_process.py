"""The server process an engine host runs when its engine is a server of its own (vLLM's,
SGLang's): held by the host (composition), never inherited, so each backend's host keeps only
what differs (its command line, how it sleeps, wakes and loads a version).

In: the host's launch command (a function of the port), environment and node address. Out: the
server's URL, the run's token on every control call (``http``), and its end: a process group
(the server and its children, e.g. vLLM's engine core) started in its own session, on a free
port of the node's address (retried when the port was taken before the server bound it),
healthy within the start-up bound or ended, and ended by SIGTERM then SIGKILL to the group.
Also the descriptions a server host and a server cell give (``describe``), shared by every
backend's host. Every failure is one ``RuntimeFailure`` line naming the server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from tidal.runtime.cell import RuntimeFailure, _gpu_ids

if TYPE_CHECKING:
    from tidal.runtime.cell import EngineHost

PORT_TRIES = 3  # launches of a server whose port was taken before it bound it


def check_extra_args(args: list[str], owned: dict[str, str], field: str, server: str) -> None:
    """A ``ConfigError`` naming ``field`` when the user's server arguments (``args``) set a
    flag tidal sets itself (``owned``: flag -> what sets it instead), in any of its spellings
    (``--flag value``, ``--flag=value``, underscores for dashes)."""
    from tidal.errors import ConfigError

    for arg in args:
        if not arg.startswith("-"):
            continue  # a value
        flag = arg.split("=", 1)[0]
        if flag.startswith("--"):
            flag = flag.replace("_", "-")
        if flag in owned:
            raise ConfigError(
                field, f"{arg}: tidal sets {flag} of each {server} server itself ({owned[flag]})"
            )


log = logging.getLogger(__name__)


def control_call(
    server: str,
    url: str | None,
    headers: dict[str, str],
    method: str,
    path: str,
    timeout_s: float = 120.0,
    *,
    text_ok: bool = False,
    json: dict[str, object] | None = None,
    params: dict[str, str | int | float] | None = None,
) -> dict[str, Any]:
    """One control call on an engine server (vLLM's or SGLang's), the JSON object it answers.

    In: ``server`` names it in errors (``"vLLM engine c1"``), ``url`` its root (None: not
    running). Out: the answer's JSON object ({} for an empty answer, and with ``text_ok`` for a
    plain-text or non-object one); any failure is one ``RuntimeFailure`` line."""
    if url is None:
        raise RuntimeFailure(f"{server} is not running")
    try:
        resp = httpx.request(
            method, f"{url}{path}", timeout=timeout_s, headers=headers, json=json, params=params
        )
    except httpx.HTTPError as exc:
        raise RuntimeFailure(f"{server} {path}: {exc!r}") from None
    if resp.status_code != 200:
        raise RuntimeFailure(f"{server} {path}: HTTP {resp.status_code} {resp.text[:200]}")
    if not resp.content:
        return {}
    try:
        out = resp.json()
    except ValueError:
        if text_ok:
            return {}
        raise RuntimeFailure(f"{server} {path}: not JSON: {resp.text[:200]!r}") from None
    if isinstance(out, dict):
        return out
    if text_ok:
        return {}
    raise RuntimeFailure(f"{server} {path}: not a JSON object: {resp.text[:200]!r}")


class ServerProcess:
    """One engine server: ``label`` names its kind in messages ("vLLM"); ``text_answers``:
    a plain-text answer to a control call counts as {} (SGLang's ``/flush_cache``)."""

    def __init__(self, label: str, name: str, log_path: Path, text_answers: bool = False) -> None:
        self.label, self.name, self.log_path = label, name, log_path
        self.text_answers = text_answers
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.token: str | None = None

    def bind_host(self, ip: str) -> str:
        """The address the server listens on, its node's ``ip`` (loopback on one machine: the
        proxy reaches an engine on any node), and the run's token it will need on every route
        (``self.token``); beyond loopback a server without the token is refused."""
        from tidal.serving.guard import is_loopback

        self.token = os.environ.get("TIDAL_ENGINE_TOKEN")
        if not self.token and not is_loopback(ip):
            raise RuntimeFailure(
                f"{self.label} engine {self.name}: bound to {ip}, beyond "
                "loopback, it needs the run's token ($TIDAL_ENGINE_TOKEN)"
            )
        return ip

    def headers(self) -> dict[str, str]:
        """What every call on the server carries: the run's token, when there is one."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def http(
        self,
        method: str,
        path: str,
        timeout_s: float = 120.0,
        *,
        json: dict[str, object] | None = None,
        params: dict[str, str | int | float] | None = None,
    ) -> dict[str, Any]:
        """One control call on the server (``control_call``)."""
        url = self.url if self.url is not None and self.alive() else None
        return control_call(
            f"{self.label} engine {self.name}",
            url,
            self.headers(),
            method,
            path,
            timeout_s,
            text_ok=self.text_answers,
            json=json,
            params=params,
        )

    def serve(
        self, args_for: Callable[[int], list[str]], env: dict[str, str], host: str, timeout_s: float
    ) -> None:
        """Launch the server (``args_for(port)``) on a free port of ``host`` and wait until
        it answers, within ``timeout_s`` in all. The server binds its port only after its
        imports, seconds after the port was chosen; a port taken meanwhile (its log says
        so) is retried on another, ``PORT_TRIES`` launches at most. Any other failure is
        raised as it is (``RuntimeFailure``), the server ended."""
        from tidal.serving.launch import free_port

        deadline = time.monotonic() + timeout_s
        for attempt in range(1, PORT_TRIES + 1):
            port = free_port(host)
            offset = self._log_size()
            self._launch(args_for(port), env, host, port)
            try:
                self._wait_healthy(max(deadline - time.monotonic(), 1.0))
                return
            except RuntimeFailure:
                taken = self._port_taken(offset)
                self.end()
                if not taken or attempt == PORT_TRIES:
                    raise
                log.warning(
                    "engine %s: port %d was taken before the server bound it; "
                    "starting it again on another port",
                    self.name,
                    port,
                )

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def _port_taken(self, offset: int) -> bool:
        """Whether the server's output since ``offset`` says its port was in use."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(offset)
                text = fh.read().decode(errors="replace")
        except OSError:
            return False
        return "Address already in use" in text or "[Errno 98]" in text

    def _launch(self, args: list[str], env: dict[str, str], host: str, port: int) -> None:
        """Start the server (``args``) in its own session (its children end with it), its
        output appended to the engine's log; ``url`` is where it will answer."""
        with open(self.log_path, "ab") as log_fh:
            self.proc = subprocess.Popen(
                args, stdout=log_fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.url = f"http://{host}:{port}"

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeFailure(
                    f"the server exited with {self.proc.returncode} during "
                    f"start-up: {self.log_tail()}"
                )
            try:
                if (
                    httpx.get(f"{self.url}/health", headers=self.headers(), timeout=2.0).status_code
                    == 200
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeFailure(f"not healthy within {timeout_s:g} s (see {self.log_path})")

    def log_tail(self, lines: int = 3) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return f"see {self.log_path}"
        return " | ".join(tail) + f" (in {self.log_path})"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> bool:
        """Crash the server (SIGKILL to its process group); False: it was never started."""
        if self.proc is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        return True

    def end(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the group, then SIGKILL (the children too, whatever became of the
        server)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def group_rss_bytes(pgid: int, proc: Path = Path("/proc")) -> int:
    """Resident bytes of every process in process group ``pgid`` (the server and its engine
    core); 0 when none is left."""
    total = 0
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # after "state ppid": pgrp
                continue
            for line in (d / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    return total


def server_rss_bytes(server: ServerProcess) -> int:
    """Resident bytes of ``server``'s processes; 0 when it is not running."""
    return group_rss_bytes(server.proc.pid) if server.alive() and server.proc else 0


def describe_server(host: EngineHost, server: ServerProcess, backend: str) -> dict[str, Any]:
    """What a host whose engine is a server reports (``describe``)."""
    return {
        "name": host.name,
        "state": host.state,
        "version": host.loaded_version,
        "alive": server.alive(),
        "url": server.url,
        "pid": server.proc.pid if server.proc else None,
        "satellite_pid": None,
        "satellite_starts": 0,
        "gpu_ids": _gpu_ids(),
        "backend": backend,
        "device": host.device,
        "node_id": host.node.node_id,
        "node_ip": host.node.ip,
        "host": socket.gethostname(),
    }


def describe_cell(
    host: EngineHost, server: ServerProcess, backend: str, memory: list[dict[str, Any]]
) -> dict[str, Any]:
    """What a cell whose engine is a server reports: the server's description, what each
    release freed (``memory``) and the cell's satellite trainer."""
    out = describe_server(host, server, backend)
    out.update(
        device=host.device,
        memory=memory,
        cgroup=None,
        satellite_pid=host.satellite.pid if host.satellite_alive() else None,
        satellite_starts=host.satellite_starts,
    )
    return out
