"""vLLM tier (``make test-vllm``): one cell's vLLM server through a whole role switch, in one
server process: serve, sleep (memory freed, measured as RSS of the server's processes), wake,
load a published version in place (as it comes across nodes: bytes written to the node's shared
memory) and read it back, serve again; a load whose file holds another version is refused with
one line, and the server keeps serving what it served. The port first chosen for the server is
taken before vLLM binds it (as another process could take it during vLLM's start-up): the host
starts it again on another port. Every route of the server, vLLM's
control routes included, refuses a call without the run's token (tidal's guard middleware).

The host is driven as a plain object (what the actuator calls on its Ray actor), so the test
needs no Ray. Skipped unless ``TIDAL_VLLM_PYTHON`` names the vLLM venv's python.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import httpx
import pytest

from tidal.runtime.cell import RuntimeFailure
from tidal.serving import launch

VLLM_PYTHON = os.environ.get("TIDAL_VLLM_PYTHON")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON, reason="set TIDAL_VLLM_PYTHON (make test-vllm)"),
]


def _complete(url: str, prompt: list[int], token: str) -> dict:
    resp = httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        headers={"Authorization": f"Bearer {token}"},
        json={
            "model": "tidal",
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 0,
            "return_token_ids": True,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


@pytest.mark.timeout(600)
def test_a_vllm_cell_switches_roles_in_one_server(smollm2, tmp_path, monkeypatch):
    import torch

    from tidal.models import load_model
    from tidal.runtime.vllm_cell import VLLMCellHost
    from tidal.training.flat import ParamLayout
    from tidal.training.transport import FilePublisher

    token = "cell-token"
    auth = {"Authorization": f"Bearer {token}"}
    monkeypatch.setenv("TIDAL_ENGINE_TOKEN", token)
    host = VLLMCellHost(
        "c0",
        str(smollm2),
        4,
        str(tmp_path),
        {
            "python": VLLM_PYTHON,
            "kv_cache_gb": 1,
            "max_model_len": 512,
            "args": ["--max-num-batched-tokens", "1024"],
        },
    )  # runtime.vllm.args
    model, tok = load_model(smollm2)
    layout = ParamLayout.of(model)
    pub = FilePublisher(tmp_path / "w", layout)
    prompt = tok.encode("The capital of France is")
    received = Path(f"/dev/shm/tidal-c0-{os.getpid()}")
    taken = socket.socket()  # listening, as a process that took the port after it was chosen
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    ports = iter([taken_port])
    real_free_port = launch.free_port
    monkeypatch.setattr(
        launch, "free_port", lambda host="127.0.0.1": next(ports, None) or real_free_port(host)
    )
    try:
        url = host.start(300)
        taken.close()
        assert not url.endswith(f":{taken_port}")
        assert "Address already in use" in host.log_path.read_text(errors="replace")
        pid = host.describe()["pid"]
        argv = Path(f"/proc/{host.server.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--max-num-batched-tokens") + 1] == b"1024"
        # tidal's guard: every route, vLLM's control routes too, needs the run's token
        assert (
            httpx.post(
                f"{url}/v1/completions",
                timeout=30,
                json={"model": "tidal", "prompt": prompt, "max_tokens": 1},
            ).status_code
            == 401
        )
        rpc = {"method": "tidal_release_kv_cache", "args": [], "kwargs": {}}
        for method, path, body in [
            ("POST", "/collective_rpc", rpc),
            ("POST", "/pause", None),
            ("POST", "/reset_prefix_cache", None),
            ("GET", "/health", None),
            ("GET", "/weight_info", None),
        ]:
            for bad in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
                resp = httpx.request(method, f"{url}{path}", json=body, headers=bad, timeout=30)
                assert resp.status_code == 401, (path, bad, resp.status_code)
        assert httpx.get(f"{url}/health", headers=auth, timeout=30).status_code == 200
        before = _complete(url, prompt, token)
        assert host.sleep() == "asleep"
        mem = host.describe()["memory"][-1]
        print("vLLM cell memory (MB):", mem)
        assert mem["kv_released_mb"] >= 1000  # the whole 1 GiB KV cache storage
        assert mem["rss_after_mb"] < mem["rss_before_mb"]
        assert host.wake() == "awake"
        torch.manual_seed(0)
        with torch.no_grad():  # a different version
            for p in model.parameters():
                p.mul_(1 + 0.05 * torch.randn_like(p))
        pub.publish(1, layout.params_to_flat(model))
        # as a version that crossed nodes arrives: bytes, written to this node's /dev/shm
        assert host.load_weights_blob(Path(pub.path(1)).read_bytes(), "v1") == "v1"
        assert [p.name for p in received.iterdir()] == ["v1.safetensors"]
        after = _complete(url, prompt, token)
        assert after["logprobs"]["token_logprobs"] != before["logprobs"]["token_logprobs"]
        # a file that holds v1 is not v2: one line, the server still serves v1
        with pytest.raises(RuntimeFailure, match="holds v1, not v2"):
            host.load_weights(str(pub.path(1)), "v2")
        assert (
            httpx.get(f"{url}/weight_info", headers=auth, timeout=30).json()["weight_version"]
            == "v1"
        )
        # a version published in bfloat16 (what a run whose engines all serve in bfloat16
        # writes: backends.published_dtype) loads into the same server and is read back
        half = FilePublisher(tmp_path / "w16", layout, dtype=torch.bfloat16)
        half.publish(2, layout.params_to_flat(model))
        assert os.path.getsize(half.path(2)) < 0.6 * os.path.getsize(pub.path(1))
        assert host.load_weights(half.path(2), "v2") == "v2"
        again = _complete(url, prompt, token)
        assert len(again["token_ids"]) == 6 and again["logprobs"]["token_logprobs"][0] < 0
        # the same server process through it all
        d = host.describe()
        assert d["pid"] == pid and d["alive"] and d["backend"] == "vllm"
    finally:
        host.stop()
    assert not received.exists()  # what came across nodes goes with the engine
