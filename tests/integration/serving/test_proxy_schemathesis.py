"""Schema-driven fuzz (schemathesis strategies over the published OpenAPI documents) of every
operation of the proxy and of a built-in engine: none answers 5xx, none takes over 10 s, and
both still serve a plain completion afterwards. Driven by hypothesis directly, because
schemathesis' pytest plugin does not load under pytest 9."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")
HANG_S = 10.0
# engine routes that change its state for everyone: each fuzzed call is undone after it
_UNDO = {"/sleep": "/wake_up", "/pause": "/resume"}


def test_no_proxy_operation_answers_5xx_or_hangs(cluster):
    eid = httpx.post(f"{cluster.url}/tidal/executions", json={}, headers=cluster.admin).json()[
        "execution_id"
    ]
    _fuzz_all(cluster.url, cluster.admin, min_operations=12, execution=eid)


def test_no_engine_operation_answers_5xx_or_hangs(cluster):
    _fuzz_all(cluster.engines["c1"].url, cluster.admin, min_operations=15)


def _fuzz_all(url: str, auth: dict, min_operations: int, execution: str | None = None) -> None:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=auth, timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= min_operations
    failures: list = []
    for op in operations:
        _fuzz(url, op, auth, failures)
    assert not failures, failures[:5]
    headers = {**auth, **({"X-Tidal-Execution": execution} if execution else {})}
    r = httpx.post(
        f"{url}/v1/completions",
        headers=headers,
        timeout=HANG_S,
        json={"prompt": [3, 4], "max_tokens": 3, "ignore_eos": True},
    )
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3, r.text


def _fuzz(url: str, op, auth: dict, failures: list) -> None:
    @given(case=op.as_strategy())
    @settings(
        max_examples=10, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def fuzz(case):
        if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
            case.body["max_tokens"] = min(case.body["max_tokens"], 8)  # short generations
        try:
            response = case.call(headers={**auth, **(case.headers or {})}, timeout=HANG_S)
        except Exception as exc:  # requests' timeout or a dropped connection
            failures.append((op.method, op.path, case.body, f"{type(exc).__name__}: {exc}"))
            return
        finally:
            undo = _UNDO.get(op.path)
            if undo:
                httpx.post(f"{url}{undo}", headers=auth, timeout=HANG_S)
        if response.status_code >= 500:
            failures.append((op.method, op.path, case.body, response.text[:200]))

    fuzz()
