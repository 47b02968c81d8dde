"""The proxy's side of tidal's vLLM KV connector (``serving.vllm_kv``): which servers hand
over, and which blobs a vLLM server refuses (the tier test ``test_vllm_kv_handoff`` runs the
connector itself in two real vLLM servers)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tidal.serving.protocol import BadRequest
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


def test_a_vllm_server_refuses_what_it_cannot_load(tmp_path):
    a = VLLMAdapter("http://127.0.0.1:9")
    assert not a.supports_kv_handoff  # no connector found: its calls re-prefill
    a.kv_dir = tmp_path
    assert a.supports_kv_handoff
    key = "ab" * 20

    async def main():
        with pytest.raises(BadRequest, match="another engine kind"):
            await a.import_kv(b"\x00built-in layout")
        ref = MAGIC + json.dumps({"key": key, "num_tokens": 5, "dir": "/elsewhere"}).encode()
        with pytest.raises(BadRequest, match="another node"):
            await a.import_kv(ref)
        ref = MAGIC + json.dumps({"key": key, "num_tokens": 5, "dir": str(tmp_path)}).encode()
        with pytest.raises(BadRequest, match="lease ended"):  # no manifest: expired
            await a.import_kv(ref)
        (tmp_path / f"{key}.json").write_text("{}")
        (tmp_path / f"{key}.0.kv").write_bytes(b"kv")
        assert await a.import_kv(ref) == (key, 5)
        await a.release_kv("call-1-1")  # a request id: the export stays pinned
        assert (tmp_path / f"{key}.0.kv").exists()
        await a.release_kv(key)  # an unused import: dropped
        assert not list(tmp_path.iterdir())
        await a.close()

    asyncio.run(main())


def test_kv_between_engine_kinds_is_not_imported_and_counted_as_mixed(tmp_path):
    """A vLLM export never goes to a built-in engine, nor a built-in engine's KV to a vLLM
    server (different layouts): the move re-prefills, marked ``mixed`` (``kv_mixed_moves``)."""
    from tidal.serving.adapters import BuiltinAdapter
    from tidal.serving.kv_handoff import Attempt, import_kv
    from tidal.serving.router import Member

    vllm = VLLMAdapter("http://127.0.0.1:9")
    vllm.kv_dir = tmp_path
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
