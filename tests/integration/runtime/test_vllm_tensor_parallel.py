"""vLLM tier (``make test-vllm``): a vLLM cell with tensor parallelism 2 on the CPU (two
workers, each holding half of every sharded weight, bound to their own CPUs by tidal), through
the steps a role switch takes: serve, load a published version as it comes across nodes, sleep
(both workers release their KV caches), wake, serve. The log-probabilities the server reports
equal transformers' recomputation for the version its label names, before and after the load,
so every worker loaded its shard of the new weights (a worker left on the old ones would be
off by the perturbation). A tiny Llama (4 heads, 2 KV heads), as SmolLM2's 9 heads do not
split in two.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch

VLLM_PYTHON = os.environ.get("TIDAL_VLLM_PYTHON")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON, reason="set TIDAL_VLLM_PYTHON (make test-vllm)"),
]
TOKEN = "tp-token"


def _logprobs(model, prompt: list[int], out: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out]))[0].float()
        lps = torch.log_softmax(logits, -1)
    return [lps[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)]


def _complete(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    resp = httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        headers={"Authorization": f"Bearer {TOKEN}"},
        json={
            "model": "tidal",
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 3,
            "logprobs": 0,
            "return_token_ids": True,
        },
    )
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@pytest.mark.timeout(600)
def test_a_tensor_parallel_vllm_cell_loads_every_shard(tmp_path, monkeypatch):
    from tidal.models import create_tiny, load_model
    from tidal.runtime.vllm_cell import VLLMCellHost
    from tidal.training.flat import ParamLayout
    from tidal.training.transport import FilePublisher

    monkeypatch.setenv("TIDAL_ENGINE_TOKEN", TOKEN)
    model_dir = create_tiny(tmp_path / "tiny", seed=3, max_seq_len=1024)
    host = VLLMCellHost(
        "c0",
        str(model_dir),
        4,
        str(tmp_path),
        {"python": VLLM_PYTHON, "kv_cache_gb": 0.25, "max_model_len": 512, "tensor_parallel": 2},
    )
    model, tok = load_model(model_dir)
    layout = ParamLayout.of(model)
    pub = FilePublisher(tmp_path / "w", layout)
    prompt = tok.encode("hello world")
    try:
        url = host.start(300)
        ws = httpx.get(
            f"{url}/get_world_size", timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}
        ).json()
        assert (ws.get("world_size") if isinstance(ws, dict) else ws) == 2, ws  # two workers
        ids, lps = _complete(url, prompt)
        v0 = _logprobs(model, prompt, ids)
        assert max(abs(a - b) for a, b in zip(lps, v0, strict=True)) < 1e-4
        torch.manual_seed(0)
        with torch.no_grad():  # another version
            for p in model.parameters():
                p.mul_(1 + 0.2 * torch.randn_like(p))
        pub.publish(1, layout.params_to_flat(model))
        assert host.load_weights_blob(Path(pub.path(1)).read_bytes(), "v1") == "v1"
        ids1, lps1 = _complete(url, prompt)
        assert (
            max(abs(a - b) for a, b in zip(lps1, _logprobs(model, prompt, ids1), strict=True))
            < 1e-4
        )
        if ids1 == ids:  # the old version's log-probs for these tokens are far from them
            assert max(abs(a - b) for a, b in zip(lps1, v0, strict=True)) > 1e-2
        assert host.sleep() == "asleep"
        mem = host.describe()["memory"][-1]
        print("TP=2 vLLM cell memory (MB):", mem)
        assert mem["kv_released_mb"] >= 500  # both workers' 0.25 GiB caches
        assert host.wake() == "awake"
        ids2, lps2 = _complete(url, prompt)
        assert (
            max(abs(a - b) for a, b in zip(lps2, _logprobs(model, prompt, ids2), strict=True))
            < 1e-4
        )
    finally:
        host.stop()
