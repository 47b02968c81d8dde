"""The proxy's side of tidal's vLLM KV connector (``serving.vllm_kv``): which servers hand
over, an export carried between nodes by the folder routes (``serving.vllm_kv_routes``, real,
served by uvicorn; a real gloo broadcast), and which blobs a vLLM server refuses (the tier test
``test_vllm_kv_handoff`` runs the connector itself in two real vLLM servers)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tidal.serving.protocol import BadRequest, EngineError
from tidal.serving.vllm_adapter import VLLMAdapter
from tidal.serving.vllm_kv import MAGIC, connector_dir, kv_transfer_config


def test_the_connector_is_found_in_server_info_only_when_it_is_tidals():
    cfg = json.loads(kv_transfer_config("/dev/shm/x", lease_s=5))
    assert cfg["kv_connector_module_path"] == "tidal.serving.vllm_kv_connector"
    info = {"vllm_config": {"kv_transfer_config": cfg}}
    assert connector_dir(info) == "/dev/shm/x"
    assert connector_dir({"vllm_config": {"kv_transfer_config": None}}) is None
    cfg["kv_connector"] = "NixlConnector"
    assert connector_dir(info) is None


class _Server:
    """A stand-in for a vLLM server's app (``/server_info`` naming tidal's connector on
    ``folder``) behind the real ``KVRoutes``, served by uvicorn on loopback."""

    def __init__(self, folder, node: str, connector: bool = True) -> None:
        import socket
        import threading

        import uvicorn

        from tidal.serving.vllm_kv_routes import KVRoutes

        info = {"vllm_config": {"kv_transfer_config": json.loads(kv_transfer_config(str(folder)))}}
        if not connector:
            info = {"vllm_config": {"kv_transfer_config": None}}

        async def app(scope, receive, send):
            found = scope["path"] == "/server_info"
            body = json.dumps(info if found else {"detail": "Not Found"}).encode()
            await send({"type": "http.response.start", "status": 200 if found else 404})
            await send({"type": "http.response.body", "body": body})

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.folder = folder
        config = uvicorn.Config(KVRoutes(app, str(folder), node), log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, args=([sock],), daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def two_nodes(tmp_path):
    """Two servers with folders of their own on two named nodes."""
    servers = [_Server(tmp_path / n, n) for n in ("node-a", "node-b")]
    for s in servers:
        s.folder.mkdir()
    yield servers
    for s in servers:
        s.stop()


def _export(folder, key: str, tokens: list[int], nonce: str, data: bytes) -> None:
    """What the connector writes at a marked abort: the manifest, the blocks, the record."""
    manifest = {"token_ids": tokens, "model": "m", "tp": 1, "block_size": 16, "nonce": nonce}
    (folder / f"{key}.json").write_text(json.dumps(manifest))
    (folder / f"{key}.0.kv").write_bytes(data)
    (folder / f"rec-{nonce}.json").write_text(json.dumps({"key": key, "num_tokens": len(tokens)}))


def test_an_export_is_carried_to_a_server_on_another_node(two_nodes):
    """The whole proxy-side flow over the folder routes: the abort's marker, the export's
    reference, the destination on another node pulling it over a gloo broadcast (the bytes
    equal, the source's copy gone), the scheduler's acknowledgement read back once."""
    src, dst = two_nodes
    key, data = "cd" * 20, bytes(range(256)) * 4099  # > 1 MB, not a whole bucket

    async def main():
        a, b = VLLMAdapter(src.url), VLLMAdapter(dst.url)
        await a.probe_kv()
        await b.probe_kv()
        assert (a.kv_node, b.kv_node) == ("node-a", "node-b") and a.supports_kv_handoff
        await a.mark_keep([("call-1-1", "cmpl-call-1-1-0")])
        nonce = (src.folder / "keep-cmpl-call-1-1-0").read_text()
        assert nonce == a._kv_nonces["call-1-1"]
        _export(src.folder, key, list(range(40)), nonce, data)
        blob = await a.export_kv("call-1-1")
        assert json.loads(blob[len(MAGIC) :])["node"] == "node-a"
        assert await b.import_kv(blob) == (key, 40)
        assert (dst.folder / f"{key}.0.kv").read_bytes() == data
        assert json.loads((dst.folder / f"{key}.json").read_text())["token_ids"] == list(range(40))
        assert not list(src.folder.glob(f"{key}.*"))  # moved, not copied
        assert not [p for p in dst.folder.iterdir() if p.name.startswith(".")]  # no staging
        (dst.folder / f"{key}.ack").write_text("39")
        assert await b.adopted(key) == 39 and await b.adopted(key) == 0
        await b.release_kv(key)  # an import not used: dropped
        assert not list(dst.folder.iterdir())
        await a.close()
        await b.close()

    asyncio.run(main())


def test_eight_exports_are_carried_at_once(two_nodes):
    """A drain moves every live call at once: eight pulls to one server run together, each
    whole and in its own place."""
    src, dst = two_nodes
    keys = [f"{i:040x}" for i in range(1, 9)]

    async def main():
        a, b = VLLMAdapter(src.url), VLLMAdapter(dst.url)
        await a.probe_kv()
        await b.probe_kv()
        blobs = []
        for i, key in enumerate(keys):
            rid = f"call-{i}"
            await a.mark_keep([(rid, f"cmpl-{rid}-0")])
            _export(src.folder, key, [i] * 30, a._kv_nonces[rid], bytes([i]) * 300_000)
            blobs.append(await a.export_kv(rid))
        got = await asyncio.wait_for(asyncio.gather(*(b.import_kv(x) for x in blobs)), 60)
        assert got == [(k, 30) for k in keys]
        for i, key in enumerate(keys):
            assert (dst.folder / f"{key}.0.kv").read_bytes() == bytes([i]) * 300_000
        await a.close()
        await b.close()

    asyncio.run(main())


def test_a_vllm_server_refuses_what_it_cannot_load(two_nodes, tmp_path):
    src, dst = two_nodes
    key = "ab" * 20

    async def main():
        a, b = VLLMAdapter(src.url), VLLMAdapter(dst.url)
        await b.probe_kv()
        assert not a.supports_kv_handoff  # not probed: its calls re-prefill
        with pytest.raises(BadRequest, match="another engine kind"):
            await b.import_kv(b"\x00built-in layout")
        ref = {"key": key, "num_tokens": 5, "dir": str(dst.folder), "node": "node-b"}
        with pytest.raises(BadRequest, match="lease ended"):  # no manifest: expired
            await b.import_kv(MAGIC + json.dumps(ref).encode())
        # an export on another node whose server is gone, or that no longer holds it
        for url in ("http://127.0.0.1:9", src.url):
            ref = {**ref, "dir": str(src.folder), "node": "node-a", "url": url}
            with pytest.raises(BadRequest):
                await b.import_kv(MAGIC + json.dumps(ref).encode())
        with pytest.raises(EngineError, match="no KV export was asked"):
            await b.export_kv("call-9")
        await b.mark_keep([("call-3", "cmpl-call-3-0")])  # aborted before it was scheduled
        nonce = (dst.folder / "keep-cmpl-call-3-0").read_text()
        (dst.folder / f"rec-{nonce}.json").write_text(json.dumps({"num_tokens": 0}))
        assert await b.export_kv("call-3") == b""  # nothing: the call keeps what it carried
        await b.mark_keep([("call-2", "cmpl-call-2-0")])
        b.export_timeout_s = 0.2  # the connector never wrote its record
        with pytest.raises(EngineError, match="no KV export"):
            await b.export_kv("call-2")
        await a.release_kv("call-1-1")  # a request id: nothing
        await a.close()
        await b.close()
        plain = _Server(tmp_path / "c", "node-c", connector=False)
        c = VLLMAdapter(plain.url)
        await c.probe_kv()
        assert not c.supports_kv_handoff  # a server without tidal's connector
        await c.close()
        plain.stop()

    asyncio.run(main())


def test_kv_between_engine_kinds_is_not_imported_and_counted_as_mixed(tmp_path):
    """A vLLM export never goes to a built-in engine, nor a built-in engine's KV to a vLLM
    server (different layouts): the move re-prefills, marked ``mixed`` (``kv_mixed_moves``)."""
    from tidal.serving.adapters import BuiltinAdapter
    from tidal.serving.kv_handoff import Attempt, import_kv
    from tidal.serving.router import Member

    vllm = VLLMAdapter("http://127.0.0.1:9")
    vllm.kv_dir, vllm.kv_node = tmp_path, "node-a"
    builtin = BuiltinAdapter("http://127.0.0.1:9")
    vllm_blob = (
        MAGIC + json.dumps({"key": "ab" * 20, "num_tokens": 5, "dir": str(tmp_path)}).encode()
    )

    async def main():
        for adapter, blob in ((builtin, vllm_blob), (vllm, b"built-in KV")):
            attempt = Attempt(None, "c-1-2", Member("e", adapter, backend="x"))
            assert await import_kv(blob, attempt) == (None, None)
            assert attempt.kv_result == "mixed"
            await adapter.close()

    asyncio.run(main())
