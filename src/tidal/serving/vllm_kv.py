"""The proxy's side of tidal's vLLM KV connector (``tidal.serving.vllm_kv_connector``, which
runs inside each vLLM server): the ``export_kv`` / ``import_kv`` / ``release_kv`` steps of a
drain (``serving.kv_handoff``) for vLLM servers on any node.

In: the server's ``/server_info`` (does it run the connector, on which folder) and its folder's
routes (``/tidal/kv/*``, ``serving.vllm_kv_routes``: the folder's node), the proxy's abort of a
drained call (``keep_kv``). Out: the blob the proxy carries between engines is a small
reference (``MAGIC`` + JSON: the export's key, token count, folder, node and source URL), never
the KV itself, which stays pinned in the source node's folder until its adopter loads it (or its
lease ends). A destination on another node first pulls the export into its own folder (a gloo
broadcast between the two servers, ``training.carriers``); the proxy never touches a folder.
The destination's adopted token count is the connector's own (``<key>.ack``, written by vLLM's
scheduler), reported as the call's cached tokens.

The probe's first answer takes a few seconds (vLLM collects its environment once: 3.6 s under
a load average of 15, then 0.1 s; measured 2026-12-06). A server without the connector or its
routes does not hand off (``kv_handoff`` False): its moved calls re-prefill, counted. A blob of
another engine kind (the built-in engine's KV layout) is refused at import, as is an export
that cannot be found or carried: those moves re-prefill, counted.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

from tidal.serving.protocol import BadRequest, EngineError, ServingError

log = logging.getLogger("tidal.serving.proxy")

CONNECTOR = "TidalKVConnector"
MODULE = "tidal.serving.vllm_kv_connector"
MAGIC = b"tidal-vllm-kv\n"
PARAM = "tidal_kv"  # the key in a request's kv_transfer_params (the connector's PARAM)
ROUTES = "/tidal/kv/"  # the folder's routes on each server (``serving.vllm_kv_routes``)


def kv_transfer_config(kv_dir: str, lease_s: float = 120.0) -> str:
    """``--kv-transfer-config`` for a vLLM server that hands its calls' KV over in ``kv_dir``."""
    return json.dumps(
        {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": MODULE,
            "kv_role": "kv_both",
            # a load that fails (an export gone) recomputes those blocks; vLLM's default fails
            # the request
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"tidal_kv_dir": kv_dir, "lease_s": lease_s},
        }
    )


def kv_args(kv_dir: str, lease_s: float = 120.0) -> list[str]:
    """The ``vllm serve`` flags of tidal's KV handoff: the connector on ``kv_dir`` and the
    folder's routes (``serving.vllm_kv_routes``; a guard given after them wraps them)."""
    from tidal.serving.vllm_kv_routes import MIDDLEWARE

    return ["--kv-transfer-config", kv_transfer_config(kv_dir, lease_s), "--middleware", MIDDLEWARE]


def kv_env(kv_dir: str, node: str) -> dict[str, str]:
    """The environment the folder's routes read: the folder and the name of its node."""
    from tidal.serving.vllm_kv_routes import DIR_ENV, NODE_ENV

    return {DIR_ENV: kv_dir, NODE_ENV: node}


def connector_dir(server_info: dict) -> str | None:
    """The folder of tidal's connector in a ``/server_info?config_format=json`` answer (None:
    the server runs no tidal connector)."""
    cfg = (server_info.get("vllm_config") or {}).get("kv_transfer_config") or {}
    if not isinstance(cfg, dict) or cfg.get("kv_connector") != CONNECTOR:
        return None
    path = (cfg.get("kv_connector_extra_config") or {}).get("tidal_kv_dir")
    return path if isinstance(path, str) else None


class VLLMKVHandoff:
    """Mixed into ``VLLMAdapter``: ``kv_node`` is set by ``probe_kv`` (at join)."""

    kv_dir: Path | None = None  # the server's folder (on its node, maybe not the proxy's)
    kv_node: str | None = None  # the server's node name: same name, same folder
    _kv_nonces: dict[str, str]  # router request id -> its export's nonce (``mark_keep``)
    export_timeout_s = 30.0  # the export runs at the source's next engine step
    # the connector records every marked abort it saw (0 tokens: never scheduled), so a call
    # drained before its first chunk asks too (``kv_handoff.export_kv``)
    kv_exports_unstarted = True
    pull_timeout_s = 60.0  # an export carried from another node

    @property
    def supports_kv_handoff(self) -> bool:  # type: ignore[override]
        return self.kv_node is not None

    async def _kv(self, op: str, body: dict, timeout_s: float | None = None) -> dict:
        resp = await self._call(  # type: ignore[attr-defined]
            "POST", f"{ROUTES}{op}", json=body, timeout_s=timeout_s
        )
        return resp.json()

    async def probe_kv(self) -> None:
        """Find the server's connector and its folder's routes; a server without either
        keeps ``kv_node`` None (its moved calls re-prefill)."""
        try:
            info = (
                await self._call(
                    "GET",
                    "/server_info",  # type: ignore[attr-defined]
                    params={"config_format": "json"},
                )
            ).json()
            path = connector_dir(info) if isinstance(info, dict) else None
            if path is None:
                return
            where = await self._kv("info", {})
        except (ServingError, ValueError):
            return
        if where.get("dir") == path and isinstance(where.get("node"), str):
            self.kv_dir, self.kv_node = Path(path), where["node"]

    async def mark_keep(self, engine_request_ids: list[tuple[str, str]]) -> None:
        """Before an abort with ``keep_kv``: each (router id, engine id) exports its KV."""
        if self.kv_node is None:
            return
        nonces = {rid: uuid.uuid4().hex for rid, _ in engine_request_ids}
        try:
            await self._kv("keep", {"ids": {e: nonces[r] for r, e in engine_request_ids}})
        except ServingError:
            return  # no marker: the abort exports nothing, the calls re-prefill
        self._kv_nonces.update(nonces)

    async def export_kv(self, request_id: str) -> bytes:
        """The reference to the export of the aborted ``request_id``, once the source's
        workers wrote it; ``b""`` when the engine had computed nothing of it. Not asked for /
        too late: ``EngineError`` (the next engine prefills)."""
        nonce = self._kv_nonces.pop(request_id, None)
        if self.kv_node is None or nonce is None:
            raise EngineError(f"no KV export was asked of {request_id}")
        try:
            data = await self._kv(
                "record",
                {"nonce": nonce, "timeout_s": self.export_timeout_s},
                self.export_timeout_s + 10,
            )
        except BadRequest as exc:
            raise EngineError(f"KV export of {request_id}: {exc}") from None
        if not data.get("num_tokens"):  # aborted before it was scheduled: nothing to hand on
            return b""
        ref = {
            "key": data["key"],
            "num_tokens": data["num_tokens"],
            "dir": str(self.kv_dir),
            "node": self.kv_node,
            "url": self.url,  # type: ignore[attr-defined]
        }
        return MAGIC + json.dumps(ref).encode()

    async def import_kv(self, blob: bytes) -> tuple[str, int]:
        """(the export's key, its token count) once this server can load it: an export in
        its own folder, or one carried here from the source's node (``pull``). Otherwise
        ``BadRequest`` (a full prefill)."""
        if not blob.startswith(MAGIC):
            raise BadRequest("not a vLLM KV export (another engine kind's layout)")
        if self.kv_node is None:
            raise BadRequest("this vLLM server runs no tidal KV connector")
        ref = json.loads(blob[len(MAGIC) :])
        key = str(ref.get("key", ""))
        if not key.isalnum() or len(key) != 40:
            raise BadRequest(f"not a KV export key: {key[:40]!r}")
        if ref.get("node") != self.kv_node or ref.get("dir") != str(self.kv_dir):
            moved = await self._kv(
                "pull",
                {"key": key, "source": ref.get("url"), "timeout_s": self.pull_timeout_s},
                self.pull_timeout_s + 20,
            )
            log.info(
                "KV export %s carried from %s to %s: %s bytes in %s s",
                key[:12],
                ref.get("node"),
                self.kv_node,
                moved.get("bytes"),
                moved.get("seconds"),
            )
        if not (await self._kv("has", {"key": key}))["exists"]:
            raise BadRequest(f"KV export {key[:12]} is not at {self.url} (its lease ended)")  # type: ignore[attr-defined]
        return key, int(ref["num_tokens"])

    async def adopted(self, key: str) -> int:
        """Tokens the destination's scheduler took from export ``key`` (its ``.ack``)."""
        if self.kv_node is None:
            return 0
        try:
            return int((await self._kv("ack", {"key": key}))["tokens"])
        except (ServingError, ValueError, KeyError):
            return 0

    async def release_kv(self, key: str) -> None:
        """An export key: drop its files (an import not used). A request id (the source,
        after its export): nothing, the export stays pinned until its adopter loads it."""
        if self.kv_node is None or not key.isalnum() or len(key) != 40:
            return
        await self._kv("release", {"key": key})
