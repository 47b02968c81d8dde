"""The pure parts of ``tidal.serving.proxy_set``: which process owns an execution (stable,
spread), an engine's cap split between processes, the processes' answers merged, and which
process a request goes to (the real-HTTP drain test: tests/integration/serving)."""

from __future__ import annotations

from collections import Counter

import httpx

from tidal.serving.proxy_set import _execution_of, cap_share, merge, owner


def test_owner_is_stable_and_spreads():
    ids = [f"g{i}-{j}" for i in range(250) for j in range(8)]
    counts = Counter(owner(e, 4) for e in ids)
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 400
    assert [owner(e, 4) for e in ids[:50]] == [owner(e, 4) for e in ids[:50]]
    assert {owner(e, 1) for e in ids} == {0}


def test_cap_shares_sum_to_the_cap():
    for cap in (1, 2, 7, 32, 1000):
        for n in (1, 2, 3, 4):
            shares = [cap_share(cap, i, n) for i in range(n)]
            assert min(shares) >= 1
            assert sum(shares) == max(cap, n)


def test_merge_sums_counts_per_engine_and_keeps_the_highest_quantiles():
    a = {
        "calls": 10,
        "failed_calls": 0,
        "queue_max_wait_s": 0.5,
        "overhead": {"n": 10, "p50_ms": 0.1, "p99_ms": 1.0},
        "engines": [{"id": "e0", "cap": 4, "inflight": 2, "admitting": True, "alive": True}],
        "lost_engines": ["e9"],
        "prompt_tokens": 100,
        "cached_tokens": 50,
        "cached_token_share": 0.5,
        "process": {"pid": 1, "cpu_s": 1.0},
        "decode_meter": {"tokens": 5.0, "inflight_s": 1.0},
    }
    b = {
        **a,
        "calls": 5,
        "queue_max_wait_s": 2.0,
        "overhead": {"n": 5, "p50_ms": 0.2, "p99_ms": 0.5},
        "engines": [{"id": "e0", "cap": 4, "inflight": 1, "admitting": False, "alive": True}],
        "cached_tokens": 0,
        "cached_token_share": 0.0,
        "process": {"pid": 2, "cpu_s": 3.0},
    }
    m = merge([a, b])
    assert m["calls"] == 15 and m["queue_max_wait_s"] == 2.0
    assert m["overhead"] == {"n": 15, "p50_ms": 0.2, "p99_ms": 1.0}
    assert m["engines"] == [
        {"id": "e0", "cap": 8, "inflight": 3, "admitting": False, "alive": True}
    ]
    assert m["lost_engines"] == ["e9"] and m["cached_token_share"] == 0.25
    assert m["process"] == [{"pid": 1, "cpu_s": 1.0}, {"pid": 2, "cpu_s": 3.0}]
    assert m["decode_meter"] == {"tokens": 10.0, "inflight_s": 2.0}
    assert merge([{"status": "ok", "engines": 2, "queued": 1}] * 2) == {
        "status": "ok",
        "engines": 2,
        "queued": 2,
    }


def test_requests_name_their_execution():
    def req(method: str, path: str, **kw) -> httpx.Request:
        return httpx.Request(method, f"http://127.0.0.1:1{path}", **kw)

    assert _execution_of(req("POST", "/x/ex1/v1/completions")) == "ex1"
    assert _execution_of(req("GET", "/tidal/executions/ex2/records")) == "ex2"
    assert _execution_of(req("POST", "/tidal/executions", json={"execution_id": "ex3"})) == "ex3"
    hdr = {"X-Tidal-Execution": "ex4"}
    assert _execution_of(req("POST", "/v1/completions", headers=hdr)) == "ex4"
    assert _execution_of(req("POST", "/tidal/engines/e0/drain")) is None
