"""A cell's real engine on a GPU through a role switch: vLLM (``VLLMCellHost``: started with
``--enable-sleep-mode``, ``/sleep?level=1``, ``/wake_up`` weights then KV cache, the published
version loaded in place through the worker extension) and SGLang (``SGLangCellHost``: started
with ``--enable-memory-saver``, ``release_memory_occupation`` / ``resume_memory_occupation``, the
published version loaded through ``update_weights_from_disk`` and read back; then served through
the proxy's ``SGLangAdapter``).
Each: sleeping frees at least 90% of the server's GPU memory (``nvidia-smi``, summed over the
server's processes), and after wake + load the served log-probs match tidal's model with the
new weights within 2e-2.

Skipped without a CUDA device (``TIDAL_TEST_DEVICE=cpu`` skips too: on the CPU the same switch is
tests/integration/runtime/test_vllm_cell.py, and for SGLang tests/unit/runtime/test_sglang_cell.py
against an SGLang-shaped server) and without the engine's venv
(``TIDAL_VLLM_PYTHON`` for a CUDA vLLM, ``TIDAL_SGLANG_PYTHON`` for SGLang). Run:
``TIDAL_VLLM_PYTHON=... TIDAL_SGLANG_PYTHON=... python -m pytest tests/gpu/test_engines_gpu.py``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess

import httpx
import pytest
import torch

DEVICE = os.environ.get("TIDAL_TEST_DEVICE", "cuda")
VLLM_PYTHON = os.environ.get("TIDAL_VLLM_PYTHON")
SGLANG_PYTHON = os.environ.get("TIDAL_SGLANG_PYTHON")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not DEVICE.startswith("cuda") or not torch.cuda.is_available(),
        reason="GPU memory: needs a CUDA device",
    ),
]


def gpu_mb(pgid: int) -> float:
    """GPU memory (MiB) used by the processes of group ``pgid``, from ``nvidia-smi``."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    total = 0.0
    for line in out.strip().splitlines():
        pid, mb = (x.strip() for x in line.split(","))
        try:
            if os.getpgid(int(pid)) == pgid:
                total += float(mb)
        except ProcessLookupError:
            continue
    return total


def new_version(model_dir: str, tmp) -> tuple:
    """The trainer's model (transformers) with every weight moved a little: a version the
    engine never saw, and the reference for its log-probs."""
    from tidal.models import HFTokenizer, load_training_model

    model, tok = load_training_model(model_dir), HFTokenizer(model_dir)
    model.eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.05 * torch.randn_like(p))
    return model, tok


def max_logprob_error(model, prompt: list[int], ids: list[int], lps: list[float]) -> float:
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), -1)
    return max(
        abs(ref[len(prompt) - 1 + i, t].item() - lp)
        for i, (t, lp) in enumerate(zip(ids, lps, strict=True))
    )


@pytest.mark.skipif(not VLLM_PYTHON, reason="set TIDAL_VLLM_PYTHON to a CUDA vLLM's python")
@pytest.mark.timeout(900)
def test_vllm_cell_sleeps_wakes_and_loads_on_the_gpu(smollm2, tmp_path):
    from tidal.runtime.vllm_cell import VLLMCellHost
    from tidal.training.flat import ParamLayout
    from tidal.training.transport import FilePublisher

    host = VLLMCellHost(
        "c0",
        str(smollm2),
        4,
        str(tmp_path),
        {"python": VLLM_PYTHON, "kv_cache_gb": 1, "max_model_len": 1024, "dtype": "float32"},
        device="cuda",
    )  # float32: the log-prob check below
    model, tok = new_version(str(smollm2), tmp_path)
    pub = FilePublisher(tmp_path / "w", ParamLayout.of(model))
    pub.publish(1, ParamLayout.of(model).params_to_flat(model))
    prompt = tok.encode("The capital of France is")
    try:
        url = host.start(600)
        pgid = host.describe()["pid"]
        awake = gpu_mb(pgid)
        host.sleep()
        asleep = gpu_mb(pgid)
        print(f"vLLM GPU memory: {awake:.0f} MiB awake, {asleep:.0f} MiB asleep")
        assert asleep <= 0.1 * awake
        host.wake()
        assert host.load_weights(str(pub.path(1)), "v1") == "v1"
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=120,
            json={
                "model": "tidal",
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": 0,
                "return_token_ids": True,
            },
        ).json()["choices"][0]
        assert (
            max_logprob_error(model, prompt, r["token_ids"], r["logprobs"]["token_logprobs"]) < 2e-2
        )
    finally:
        host.stop()


@pytest.mark.skipif(not SGLANG_PYTHON, reason="set TIDAL_SGLANG_PYTHON to SGLang's python")
@pytest.mark.timeout(900)
def test_sglang_cell_releases_resumes_and_loads_on_the_gpu(smollm2, tmp_path):
    from tidal.runtime.sglang_cell import SGLangCellHost
    from tidal.serving.protocol import GenerateRequest, SamplingParams
    from tidal.serving.sglang_adapter import SGLangAdapter
    from tidal.training.flat import ParamLayout
    from tidal.training.transport import FilePublisher

    host = SGLangCellHost(
        "c0",
        str(smollm2),
        4,
        str(tmp_path),
        {"python": SGLANG_PYTHON, "mem_fraction": 0.3, "dtype": "float32"},
        device="cuda",
    )
    model, tok = new_version(str(smollm2), tmp_path)
    pub = FilePublisher(tmp_path / "w", ParamLayout.of(model))
    pub.publish(1, ParamLayout.of(model).params_to_flat(model))
    prompt = tok.encode("The capital of France is")

    async def generate(url: str) -> tuple[list[int], list[float]]:
        adapter = SGLangAdapter(url, api_key=os.environ.get("TIDAL_ENGINE_TOKEN"))
        ids, lps = [], []
        try:
            async for chunk in adapter.generate(
                GenerateRequest("g1", prompt, SamplingParams(max_tokens=8, temperature=0.0))
            ):
                ids += chunk.token_ids
                lps += chunk.logprobs
                assert set(chunk.versions) <= {"v1"}
        finally:
            await adapter.close()
        return ids, lps

    try:
        url = host.start(600)
        pgid = host.describe()["pid"]
        awake = gpu_mb(pgid)
        host.sleep()  # pause, release_memory_occupation; measured by the host too
        asleep = gpu_mb(pgid)
        print(
            f"SGLang GPU memory: {awake:.0f} MiB awake, {asleep:.0f} MiB asleep; "
            f"host measured {host.describe()['memory']}"
        )
        assert asleep <= 0.1 * awake
        host.wake()
        assert host.load_weights(pub.path(1), "v1") == "v1"  # read back from the server
        ids, lps = asyncio.run(generate(url))
        assert ids and max_logprob_error(model, prompt, ids, lps) < 2e-2
    finally:
        host.stop()
