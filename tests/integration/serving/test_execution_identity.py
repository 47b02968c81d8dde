"""Issue 38 defects (1) and (2) against a real proxy and engines on loopback, with the
``openai`` SDK as the agent's client: an execution's ``tx-`` key is never the admin token (it
reads, closes, registers nothing and drains no engine), and naming another execution without
its key (header, ``/x/<id>`` base URL, body ``user``, with no key or with one's own) is 401 and
writes nothing into that execution's records. On main both were accepted."""

from __future__ import annotations

import httpx
import pytest

from tidal.serving.execution_keys import execution_key, execution_url

openai = pytest.importorskip("openai")
ASK = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


def _register(cluster) -> str:
    r = httpx.post(f"{cluster.url}/tidal/executions", json={"group_id": "g"}, headers=cluster.admin)
    assert r.status_code == 200, r.text
    return r.json()["execution_id"]


def _agent(cluster, eid: str, **kw):
    """An agent's SDK client as a run hands it out: its execution's base URL and key."""
    base = kw.pop("base_url", execution_url(cluster.url, eid))
    key = kw.pop("api_key", execution_key(cluster.token, eid))
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, **kw)


def _calls(cluster, eid: str) -> int:
    r = httpx.get(f"{cluster.url}/tidal/executions/{eid}/records", headers=cluster.admin)
    return len(r.json()["calls"])


def test_an_execution_key_is_not_the_admin_token(cluster):
    """Defect (1): with its own key an agent reads no other execution's records, closes none,
    registers none, and drains, removes or lists no engine; its own calls work."""
    mine, other = _register(cluster), _register(cluster)
    _agent(cluster, mine).chat.completions.create(**ASK)
    _agent(cluster, other).chat.completions.create(**ASK)
    key = {"Authorization": f"Bearer {execution_key(cluster.token, mine)}"}
    base = execution_url(cluster.url, mine).removesuffix("/v1")
    with httpx.Client(base_url=cluster.url, headers=key, timeout=30) as c:
        for method, path in (
            ("GET", f"/tidal/executions/{other}/records"),
            ("POST", f"/tidal/executions/{other}/close"),
            ("POST", f"/tidal/executions/{mine}/close"),
            ("POST", "/tidal/executions"),
            ("POST", "/tidal/engines/s0/drain"),
            ("DELETE", "/tidal/engines/c1?drain=false"),
            ("GET", "/tidal/engines"),
            ("GET", "/tidal/stats"),
            ("GET", "/openapi.json"),
            ("POST", f"{base}/tidal/executions/{other}/close"),
        ):
            r = c.request(method, path, json={"reward": 1.0} if "close" in path else None)
            assert r.status_code == 401, (method, path, r.text)
            assert "admin token" in r.json()["error"]["message"]
    # nothing changed: the other execution is open and takes calls, every engine serves
    _agent(cluster, other).chat.completions.create(**ASK)
    assert _calls(cluster, other) == 2 and _calls(cluster, mine) == 1
    engines = httpx.get(f"{cluster.url}/tidal/engines", headers=cluster.admin).json()["engines"]
    assert {e["id"] for e in engines} >= {"s0", "c0", "c1"}
    assert all(e["admitting"] for e in engines if e["id"] in ("s0", "c0", "c1"))


def test_naming_an_execution_needs_its_key(cluster):
    """Defect (2): no key, a placeholder key or another execution's key naming the victim
    (header, base URL, body ``user``) is 401 and the victim's records stay empty; the admin
    token may name it (the driver's own harness pool)."""
    victim, attacker = _register(cluster), _register(cluster)
    plain = f"{cluster.url}/v1"
    attempts = [
        _agent(
            cluster,
            victim,
            base_url=plain,
            api_key="sk-none",
            default_headers={"X-Tidal-Execution": victim},
        ),
        _agent(cluster, victim, api_key="sk-none"),
        _agent(cluster, attacker, default_headers={"X-Tidal-Execution": victim}),
        _agent(cluster, attacker, base_url=execution_url(cluster.url, victim)),
        _agent(cluster, victim, api_key=f"tx-{victim}.0123456789abcdef"),
    ]
    for client in attempts:
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(**ASK)
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
    anonymous = _agent(cluster, victim, base_url=plain, api_key="sk-none")
    with pytest.raises(openai.AuthenticationError, match="named without its key"):
        anonymous.chat.completions.create(**ASK, user=victim)
    r = httpx.post(
        f"{cluster.url}/inference/v1/generate",
        json={"token_ids": [3, 4], "sampling_params": {"max_tokens": 2}},
        headers={"X-Tidal-Execution": victim},
    )
    assert r.status_code == 401, r.text
    assert _calls(cluster, victim) == 0
    # the attacker's own key still works, counted to the attacker
    _agent(cluster, attacker).chat.completions.create(**ASK, user=victim)
    assert _calls(cluster, attacker) == 1 and _calls(cluster, victim) == 0
    # the admin token names any execution: the driver's built-in chat loop does
    _agent(
        cluster,
        victim,
        base_url=plain,
        api_key=cluster.token,
        default_headers={"X-Tidal-Execution": victim},
    ).chat.completions.create(**ASK)
    assert _calls(cluster, victim) == 1
