"""Schema-driven fuzz (schemathesis strategies over the published OpenAPI document) of every
operation of the proxy: none answers 5xx. Driven by hypothesis directly, because
schemathesis' pytest plugin does not load under pytest 9."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")


def test_no_operation_answers_5xx(cluster):
    schema = schemathesis.openapi.from_url(f"{cluster.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    failures = []
    for op in operations:
        _fuzz(op, cluster.admin, failures)
    assert not failures, failures[:5]


def _fuzz(op, admin: dict, failures: list) -> None:
    @given(case=op.as_strategy())
    @settings(max_examples=10, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
            case.body["max_tokens"] = min(case.body["max_tokens"], 8)  # short generations
        response = case.call(headers={**admin, **(case.headers or {})}, timeout=60)
        if response.status_code >= 500:
            failures.append((op.method, op.path, case.body, response.text[:200]))

    fuzz()
