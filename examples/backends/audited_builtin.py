"""An engine backend of your own, registered from a file the run config names
(``runtime.backend_modules``): tidal's built-in engine, whose host also writes an audit line for
every lifecycle call the run makes on it (start, sleep, wake, weight loads) to
``<run>/logs/audit-<engine>.jsonl``.

Its entry names the host a cell's Ray actor runs (``cell_host``; ``standalone_host`` for
standalone engines) and the adapter the proxy talks to it through, as ``"module:attribute"``;
``__name__`` names this file's own classes in every process that loads it (the driver, the
proxy; Ray's workers get the classes by value). A backend that is a server of its own (like
vLLM) also names ``settings``, ``check`` and ``server=True``: docs/engines.md, "Your own
backend".

Used by ``configs/audited-backend.yaml`` and ``tests/integration/runtime/test_user_backend_run.py``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tidal.backends import EngineBackend, register_backend
from tidal.runtime.cell import EngineHost


class AuditedHost(EngineHost):
    """The built-in engine's host; each lifecycle call is appended to an audit file."""

    def _audit(self, event: str, **fields: object) -> None:
        path = Path(self.log_path).parent / f"audit-{self.name}.jsonl"
        line = {"t": round(time.time(), 3), "engine": self.name, "event": event, **fields}
        with open(path, "a") as fh:
            fh.write(json.dumps(line) + "\n")

    def start(self, timeout_s: float, token: list | None = None) -> str:
        url = super().start(timeout_s, token)
        self._audit("start", url=url)
        return url

    def sleep(self) -> str:
        state = super().sleep()
        self._audit("sleep")
        return state

    def wake(self) -> str:
        state = super().wake()
        self._audit("wake")
        return state

    def load_weights(self, path: str, version: str) -> str:
        loaded = super().load_weights(path, version)
        self._audit("load_weights", version=loaded)
        return loaded


register_backend(EngineBackend(
    name="audited-builtin", label="audited built-in",
    adapter="tidal.serving.adapters:BuiltinAdapter",  # the built-in engine's routes, unchanged
    cell_host=f"{__name__}:AuditedHost", standalone_host=f"{__name__}:AuditedHost"))
