"""Control channel between the core and its satellites: small request/response messages.

In/out: picklable dicts over ``multiprocessing.connection`` on 127.0.0.1 (authenticated). The core
runs one ``RpcServer``; each satellite holds one ``RpcClient``. A closed connection is how the
core learns that a satellite process died: the server calls ``on_disconnect(peer)`` so its
claims and undelivered work can be reopened. Bulk data (weights, gradients) never travels here;
it goes over torch.distributed groups.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from tidal.errors import TidalError, TimeoutExpired

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]


class RpcError(TidalError):
    """The peer answered with an error, or the connection broke."""


class RpcServer:
    """Serves ``handler(request, session)`` on one thread per connection."""

    def __init__(
        self,
        handler: Handler,
        on_disconnect: Callable[[dict[str, Any]], None],
        authkey: bytes,
        host: str = "127.0.0.1",
    ) -> None:
        self._handler, self._on_disconnect = handler, on_disconnect
        self._listener = Listener((host, 0), authkey=authkey)
        self.address: tuple[str, int] = self._listener.address
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="rpc-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                if not self._closed:
                    log.exception("rpc accept failed")
                return
            except Exception:  # an unauthenticated peer must not stop the server
                log.warning("rpc: refused a connection", exc_info=True)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        session: dict[str, Any] = {}
        try:
            while True:
                try:
                    request = conn.recv()
                except (EOFError, OSError):
                    break
                try:
                    reply = self._handler(request, session)
                except TidalError as exc:
                    reply = {"error": type(exc).__name__, "message": str(exc)}
                except Exception as exc:
                    log.exception("rpc handler failed on %s", request.get("op"))
                    reply = {"error": type(exc).__name__, "message": str(exc)}
                conn.send(reply)
                if session.get("closing"):
                    break
        finally:
            conn.close()
            if not session.get("closing"):
                self._on_disconnect(session)

    def close(self) -> None:
        self._closed = True
        self._listener.close()


class RpcClient:
    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        try:
            self._conn = Client(address, authkey=authkey)
        except OSError as exc:
            raise RpcError(f"cannot reach the core at {address}: {exc}") from exc
        self._lock = threading.Lock()

    def call(self, op: str, timeout_s: float = 120.0, **kwargs: object) -> dict[str, Any]:
        return self.call_with(op, lambda: None, timeout_s, **kwargs)[0]

    def call_with(
        self, op: str, during: Callable[[], object], timeout_s: float = 120.0, **kwargs: object
    ) -> tuple[dict[str, Any], object]:
        """Send ``op``, run ``during()`` (the satellite's half of a collective the core's
        handler runs for this request), then read the reply."""
        with self._lock:
            try:
                self._conn.send({"op": op, **kwargs})
                result = during()
                if not self._conn.poll(timeout_s):
                    raise TimeoutExpired(f"core did not answer {op!r} within {timeout_s}s")
                reply = self._conn.recv()
            except (EOFError, OSError) as exc:
                raise RpcError(f"connection to the core lost during {op!r}: {exc}") from exc
        if "error" in reply:
            raise RpcError(f"core refused {op!r}: {reply['error']}: {reply['message']}")
        return reply, result

    def close(self) -> None:
        self._conn.close()
