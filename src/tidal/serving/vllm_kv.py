"""The proxy's side of tidal's vLLM KV connector (``tidal.serving.vllm_kv_connector``, which
runs inside each vLLM server): the ``export_kv`` / ``import_kv`` / ``release_kv`` steps of a
drain (``serving.kv_handoff``) for vLLM servers on the proxy's node.

In: the server's ``/server_info`` (does it run the connector, and on which shared-memory
folder), the proxy's abort of a drained call (``keep_kv``). Out: the blob the proxy carries
between engines is a small reference (``MAGIC`` + JSON: the export's key and token count),
never the KV itself, which stays pinned in the node's folder until the destination's workers
load it (or its lease ends). The destination's adopted token count is the connector's own
(``<key>.ack``, written by vLLM's scheduler), reported as the call's cached tokens.

The probe's first answer takes a few seconds (vLLM collects its environment once: 3.6 s under
a load average of 15, then 0.1 s; measured 2026-12-06). A server without the connector, or
whose folder is not on this node, does not hand off
(``kv_handoff`` False): its moved calls re-prefill, counted. A blob of another engine kind
(the built-in engine's KV layout) is refused at import: that move re-prefills, counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from pathlib import Path

from tidal.serving.protocol import BadRequest, EngineError, ServingError

CONNECTOR = "TidalKVConnector"
MODULE = "tidal.serving.vllm_kv_connector"
MAGIC = b"tidal-vllm-kv\n"
PARAM = "tidal_kv"  # the key in a request's kv_transfer_params (the connector's PARAM)


def kv_transfer_config(kv_dir: str, lease_s: float = 120.0) -> str:
    """``--kv-transfer-config`` for a vLLM server that hands its calls' KV over in ``kv_dir``."""
    return json.dumps(
        {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"tidal_kv_dir": kv_dir, "lease_s": lease_s},
        }
    )


def connector_dir(server_info: dict) -> str | None:
    """The folder of tidal's connector in a ``/server_info?config_format=json`` answer (None:
    the server runs no tidal connector)."""
    cfg = (server_info.get("vllm_config") or {}).get("kv_transfer_config") or {}
    if not isinstance(cfg, dict) or cfg.get("kv_connector") != CONNECTOR:
        return None
    path = (cfg.get("kv_connector_extra_config") or {}).get("tidal_kv_dir")
    return path if isinstance(path, str) else None


class VLLMKVHandoff:
    """Mixed into ``VLLMAdapter``: ``kv_dir`` is set by ``probe_kv`` (at join)."""

    kv_dir: Path | None = None
    _kv_nonces: dict[str, str]  # router request id -> its export's nonce (``mark_keep``)
    export_timeout_s = 30.0  # the export runs at the source's next engine step

    @property
    def supports_kv_handoff(self) -> bool:  # type: ignore[override]
        return self.kv_dir is not None

    async def probe_kv(self) -> None:
        """Find the server's connector folder; a server without one (or elsewhere) keeps
        ``kv_dir`` None."""
        try:
            info = (
                await self._call(
                    "GET",
                    "/server_info",  # type: ignore[attr-defined]
                    params={"config_format": "json"},
                )
            ).json()
        except (ServingError, ValueError):
            return
        path = connector_dir(info) if isinstance(info, dict) else None
        if path is not None and Path(path).is_dir():
            self.kv_dir = Path(path)

    def mark_keep(self, engine_request_ids: list[tuple[str, str]]) -> None:
        """Before an abort with ``keep_kv``: each (router id, engine id) exports its KV."""
        if self.kv_dir is None:
            return
        for rid, engine_id in engine_request_ids:
            nonce = uuid.uuid4().hex
            with contextlib.suppress(OSError):
                (self.kv_dir / f"keep-{engine_id}").write_text(nonce)
                self._kv_nonces[rid] = nonce

    async def export_kv(self, request_id: str) -> bytes:
        """The reference to the export of the aborted ``request_id``, once the source's
        workers wrote it. Nothing to export / too late: ``EngineError`` (the next engine
        prefills)."""
        nonce = self._kv_nonces.pop(request_id, None)
        if self.kv_dir is None or nonce is None:
            raise EngineError(f"no KV export was asked of {request_id}")
        rec = self.kv_dir / f"rec-{nonce}.json"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.export_timeout_s
        while not rec.exists():
            if loop.time() >= deadline:
                raise EngineError(
                    f"KV export of {request_id}: none after {self.export_timeout_s:.0f} s"
                )
            await asyncio.sleep(0.01)
        data = json.loads(rec.read_text())
        rec.unlink(missing_ok=True)
        if not data.get("num_tokens"):
            raise EngineError(f"KV export of {request_id}: the engine had computed nothing")
        return (
            MAGIC
            + json.dumps(
                {"key": data["key"], "num_tokens": data["num_tokens"], "dir": str(self.kv_dir)}
            ).encode()
        )

    async def import_kv(self, blob: bytes) -> tuple[str, int]:
        """(the export's key, its token count) when this server can load it: a vLLM export
        in this server's folder. Otherwise ``BadRequest`` (a full prefill)."""
        if not blob.startswith(MAGIC):
            raise BadRequest("not a vLLM KV export (another engine kind's layout)")
        if self.kv_dir is None:
            raise BadRequest("this vLLM server runs no tidal KV connector")
        ref = json.loads(blob[len(MAGIC) :])
        key = str(ref.get("key", ""))
        if (
            ref.get("dir") != str(self.kv_dir)
            or not key.isalnum()
            or not (self.kv_dir / f"{key}.json").exists()
        ):
            raise BadRequest(
                f"KV export {key[:12]} is not in {self.kv_dir} (another node, or its lease ended)"
            )
        return key, int(ref["num_tokens"])

    def adopted(self, key: str) -> int:
        """Tokens the destination's scheduler took from export ``key`` (its ``.ack``)."""
        if self.kv_dir is None:
            return 0
        ack = self.kv_dir / f"{key}.ack"
        try:
            n = int(ack.read_text())
        except (OSError, ValueError):
            return 0
        ack.unlink(missing_ok=True)
        return n

    async def release_kv(self, key: str) -> None:
        """An export key: drop its files (an import not used). A request id (the source,
        after its export): nothing, the export stays pinned until its adopter loads it."""
        if self.kv_dir is None or not key.isalnum() or len(key) != 40:
            return
        for p in self.kv_dir.glob(f"{key}.*"):
            p.unlink(missing_ok=True)
