"""The proxy's HTTP surface against real engine processes: OpenAI clients, bad input -> 4xx
with a clear message, bearer-protected admin routes, and a property-based fuzz of every route
of the published OpenAPI schema that finds no 5xx."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.serving.execution_keys import execution_key, execution_url


@pytest.fixture(scope="module")
def client(cluster):
    with httpx.Client(base_url=cluster.url, timeout=60) as c:
        c.admin, c.token = cluster.admin, cluster.token  # sent only where a test says so
        yield c


def _register(client) -> str:
    """A new execution, registered as the driver does (the admin token: the client's)."""
    return client.post("/tidal/executions", json={"group_id": "g"}, headers=client.admin).json()[
        "execution_id"
    ]


def _as(client, eid: str) -> dict[str, str]:
    """The headers of a harness of execution ``eid``: its own key."""
    return {"Authorization": f"Bearer {execution_key(client.token, eid)}"}


def test_openai_client_is_a_harness(cluster, client):
    openai = pytest.importorskip("openai")
    eid = _register(client)
    oa = openai.OpenAI(
        base_url=execution_url(cluster.url, eid), api_key=execution_key(cluster.token, eid)
    )
    chat = oa.chat.completions.create(
        model="tiny",
        max_tokens=8,
        logprobs=True,
        messages=[{"role": "user", "content": "12 plus 30?"}],
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens > 0
    comp = oa.completions.create(
        model="tiny", prompt="The agent", max_tokens=5, logprobs=0, extra_body={"ignore_eos": True}
    )
    assert comp.usage.completion_tokens == 5
    streamed = oa.completions.create(
        model="tiny", prompt="The agent", max_tokens=6, stream=True, extra_body={"ignore_eos": True}
    )
    pieces = list(streamed)
    assert pieces[-1].choices[0].finish_reason == "length"
    closed = client.post(
        f"/tidal/executions/{eid}/close", json={"reward": 0.5}, headers=cluster.admin
    ).json()
    assert closed["calls"] == 3 and not closed["duplicate"]
    assert client.post(f"/tidal/executions/{eid}/close", json={}, headers=cluster.admin).json()[
        "duplicate"
    ]
    records = client.get(f"/tidal/executions/{eid}/records", headers=cluster.admin).json()
    call = records["calls"][1]
    seg = call["segments"][0]
    assert len(call["output_token_ids"]) == 5 and len(seg["logprobs"]) == 5
    assert seg["weight_versions"] == [[0, 5, "v0"]]


@pytest.mark.parametrize(
    "body,status,needle",
    [
        ("{not json", 400, "JSON"),
        ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
        ({"prompt": list(range(1, 40_000)), "max_tokens": 2}, 400, "exceeds the limit"),
        ({"prompt": "x", "model": "no-such-model"}, 404, "not served"),
        ({"prompt": [10**9], "max_tokens": 2}, 400, "vocabulary"),
        ({"max_tokens": 2}, 400, "prompt"),
        ({"prompt": [3, 4], "max_tokens": 2, "seed": 2**63}, 400, "seed"),
        ({"prompt": [3, 4], "max_tokens": 2, "seed": -(2**63) - 1}, 400, "seed"),
        ({"prompt": "a" * 200_000, "max_tokens": 2}, 400, "prompt"),
        ({"prompt": [3, -4], "max_tokens": 2}, 400, "prompt"),
    ],
)
def test_bad_input_gets_a_clear_4xx(client, body, status, needle):
    eid = _register(client)
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    headers = {**_as(client, eid), "content-type": "application/json"}
    r = client.post("/v1/completions", headers=headers, **kw)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_unknown_or_closed_execution_and_admin_auth(cluster, client):
    r = client.post("/v1/completions", headers=_as(client, "nobody"), json={"prompt": "x"})
    assert r.status_code == 404 and "unknown execution" in r.json()["error"]["message"]
    eid = _register(client)
    client.post(f"/tidal/executions/{eid}/close", json={"reason": "timeout"}, headers=cluster.admin)
    r = client.post("/v1/completions", headers=_as(client, eid), json={"prompt": "x"})
    assert r.status_code == 409
    assert (
        client.post("/tidal/executions/nobody/close", json={}, headers=cluster.admin).status_code
        == 404
    )
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        for method, path in (
            ("GET", "/tidal/engines"),
            ("GET", "/tidal/stats"),
            ("POST", "/tidal/engines/s0/drain"),
            ("POST", "/tidal/engines/s0/undrain"),
            ("POST", f"/tidal/executions/{eid}/close"),
            ("POST", "/tidal/executions"),
            ("GET", f"/tidal/executions/{eid}/records"),
            ("GET", "/docs"),
            ("GET", "/openapi.json"),
        ):
            r = client.request(method, path, headers=headers)
            assert r.status_code == 401, (method, path, r.text)
    assert client.get("/tidal/engines", headers=cluster.admin).status_code == 200
    r = client.post("/tidal/engines/ghost/drain", headers=cluster.admin)
    assert r.status_code == 404


def test_heads_and_bodies_are_bounded(cluster, client):
    """Both servers (the proxy and an engine, real processes) run the bounded protocol: a 1 MB
    header is a 431 (the read deadline of the same protocol: ``tests/unit/serving/
    test_guard.py``); a 2 MB registration body is a 413; both go on serving."""
    engine = cluster.engines["s0"].url
    for url in (cluster.url, engine):
        r = httpx.get(f"{url}/health", headers={**cluster.admin, "x-big": "a" * 1_000_000})
        assert r.status_code == 431, (url, r.status_code)
    r = client.post(
        "/tidal/executions", json={"metadata": {"blob": "a" * 2_000_000}}, headers=cluster.admin
    )
    assert r.status_code == 413 and "content-length" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200
    assert httpx.get(f"{engine}/health", headers=cluster.admin).status_code == 200


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=12,
)
_fields = {
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_k",
    "seed",
    "logprobs",
    "stream",
    "model",
    "user",
    "ignore_eos",
    "stop_token_ids",
    "kv_handle",
    "reward",
    "reason",
    "execution_id",
    "group_id",
    "id",
    "url",
    "cap",
    "kind",
    "role",
    "content",
}
_bodies = st.one_of(_json, st.dictionaries(st.sampled_from(sorted(_fields)), _json, max_size=6))


def test_openapi_schema_is_published(cluster, client):
    schema = client.get("/openapi.json", headers=cluster.admin).json()
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/tidal/engines",
        "/tidal/engines/{engine_id}/drain",
        "/tidal/executions",
    } <= set(schema["paths"])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=_bodies,
    route=st.sampled_from(
        [
            "/v1/completions",
            "/v1/chat/completions",
            "/tidal/executions",
            "/tidal/executions/x/close",
            "/tidal/engines",
            "/tidal/engines/s0/undrain",
        ]
    ),
    auth=st.booleans(),
    execution=st.none()
    | st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=10),
)
def test_fuzzed_bodies_never_get_a_5xx(cluster, client, body, route, auth, execution):
    headers = dict(cluster.admin) if auth else {}
    if execution:
        headers["X-Tidal-Execution"] = execution
    if isinstance(body, dict) and "max_tokens" in body:
        body["max_tokens"] = 2 if isinstance(body["max_tokens"], int) else body["max_tokens"]
    r = client.post(route, json=body, headers=headers)
    assert r.status_code < 500, (route, body, r.text)
