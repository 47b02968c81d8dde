"""A KV handoff A -> B whose destination B is drained while the handoff is in flight: the call
keeps its KV (0 tokens re-prefilled on every hop), never runs on B once B's drain has begun,
and B's drain returns holding nothing of the call.

Real engine processes; the proxy runs in the test's event loop so the race can be staged
deterministically: B's real adapter is wrapped so that its KV import waits on a gate the test
opens once B's drain has begun (the import is the in-flight window), or B is kept busy so the
continuation waits in B's queue when B's drain aborts it.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from tidal.serving.launch import start_engine
from tidal.serving.protocol import SamplingParams
from tidal.serving.proxy import Attempt, Proxy, ProxyConfig

BUDGET = 120
PROMPT = [5, 17, 42, 9, 33, 8, 71, 2]


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("race-logs")
    procs = {
        "A": start_engine(tiny_model, log_path=logs / "A.log"),
        "B": start_engine(tiny_model, max_batch=1, log_path=logs / "B.log"),
        "C": start_engine(tiny_model, log_path=logs / "C.log"),
    }
    try:
        for p in procs.values():
            p.wait_healthy(120)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


class ImportGate:
    """B's real adapter, except that a KV import waits until the test opens the gate."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.entered, self.gate = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def import_kv(self, blob: bytes) -> tuple[str, int]:
        self.entered.set()
        await asyncio.wait_for(self.gate.wait(), 30)
        return await self.inner.import_kv(blob)


async def _until(cond, what: str, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.002)
    assert cond(), what


async def _proxy(engines) -> Proxy:
    proxy = Proxy(ProxyConfig(kv_handoff=True, drain_timeout_s=30, request_timeout_s=60))
    # A is the standalone engine every call starts on; B is the first drain destination
    # (the highest rollout cell), C the next
    await proxy.join("A", engines["A"].url, kind="standalone")
    await proxy.join("B", engines["B"].url, kind="cell", cell_index=1)
    await proxy.join("C", engines["C"].url, kind="cell", cell_index=0)
    return proxy


async def _start_call(proxy: Proxy, eid: str, a_url: str, stream: bool) -> asyncio.Task:
    """The call runs on A with a few tokens generated there (seen in its chunks when streamed,
    in A's own token count otherwise: A serves nothing else)."""
    got: list[int] = []
    params = SamplingParams(max_tokens=BUDGET, temperature=0.0, ignore_eos=True)
    base = (await _engine_stats(a_url))["generated_tokens"]
    task = asyncio.create_task(
        proxy.complete(
            eid, PROMPT, params, on_chunk=(lambda c: got.extend(c.token_ids)) if stream else None
        )
    )
    if stream:
        await _until(lambda: len(got) >= 5 or task.done(), "the call produced tokens on A")
    else:
        await _until_stats(
            a_url,
            lambda s: s["generated_tokens"] - base >= 5 or task.done(),
            "the call produced tokens on A",
        )
    assert not task.done() and proxy.router.members["A"].inflight
    return task


async def _engine_stats(url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        return (await c.get("/stats")).json()


async def _reference(url: str) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        r = await c.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": BUDGET, "temperature": 0, "ignore_eos": True},
        )
        return r.json()["choices"][0]["token_ids"]


def _check_call(proxy: Proxy, eid: str, res, reference: list[int]) -> list:
    assert res.finish_reason == "length" and res.token_ids == reference
    [call] = proxy.records.calls(eid)
    segs = call.segments
    assert segs[0].engine_id == "A" and segs[0].ended_by == "abort"
    assert segs[-1].ended_by == "length" and segs[-1].engine_id == "C"
    for seg in segs[1:]:  # every handed-off hop reused the KV: nothing re-prefilled
        assert seg.reprefill_tokens == 0, [
            (s.engine_id, len(s.token_ids), s.cached_tokens, s.reprefill_tokens, s.ended_by)
            for s in segs
        ]
        assert seg.cached_tokens >= len(PROMPT) + len(segs[0].token_ids) - 1
    return segs


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "one-piece"])
def test_drain_of_the_destination_during_the_kv_import(engines, stream):
    """B's drain begins while the KV exported from A is being imported into B: the call moves
    on to C with the same KV and never runs on B."""

    async def main():
        proxy = await _proxy(engines)
        gate = ImportGate(proxy.router.members["B"].adapter)
        proxy.router.members["B"].adapter = gate
        try:
            reference = await _reference(engines["C"].url)
            b_before = await _engine_stats(engines["B"].url)
            task = await _start_call(proxy, "x1", engines["A"].url, stream)
            drain_a = asyncio.create_task(proxy.drain("A"))
            await asyncio.wait_for(gate.entered.wait(), 30)  # handoff A -> B in flight
            assert [type(a) for a in proxy.router.members["B"].inflight.values()] == [Attempt]
            drain_b = asyncio.create_task(proxy.drain("B"))
            await _until(lambda: not proxy.router.members["B"].admitting, "B's drain began")
            gate.gate.set()
            out_b = await asyncio.wait_for(drain_b, 30)
            out_a = await asyncio.wait_for(drain_a, 30)
            res = await asyncio.wait_for(task, 60)
            b_after = await _engine_stats(engines["B"].url)
            return proxy, res, reference, out_a, out_b, b_before, b_after
        finally:
            await proxy.close()

    proxy, res, reference, out_a, out_b, b_before, b_after = asyncio.run(main())
    segs = _check_call(proxy, "x1", res, reference)
    assert [s.engine_id for s in segs] == ["A", "C"]  # B never ran it
    assert b_after["requests"] == b_before["requests"]  # nothing was sent to B
    assert b_after["pinned_kv"] == 0  # the import B took was released
    assert out_a["moved"] == 1 and out_b["moved"] == 1
    assert proxy.totals["kv_handoffs"] == 1 and proxy.totals["reprefill_tokens"] == 0


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "one-piece"])
def test_drain_of_the_destination_while_the_continuation_waits_there(engines, stream):
    """The continuation was sent to B with its KV but waits in B's queue (B is busy with another
    client's request) when B's drain aborts it: B pins the adopted KV, the next hop takes it
    from B (a chained handoff), and no hop re-prefills."""

    async def main():
        proxy = await _proxy(engines)
        b_url = engines["B"].url
        try:
            async with _busy(b_url, "hog"):
                reference = await _reference(engines["C"].url)
                task = await _start_call(proxy, "x2", engines["A"].url, stream)
                drain_a = asyncio.create_task(proxy.drain("A"))
                await _until_stats(
                    b_url,
                    lambda s: s["waiting"] == 1 and s["running"] == 1,
                    "the continuation waits at B",
                )
                out_b = await asyncio.wait_for(proxy.drain("B"), 30)
                b_after = await _engine_stats(b_url)
                out_a = await asyncio.wait_for(drain_a, 30)
                res = await asyncio.wait_for(task, 60)
            return proxy, res, reference, out_a, out_b, b_after
        finally:
            await proxy.close()

    proxy, res, reference, out_a, out_b, b_after = asyncio.run(main())
    segs = _check_call(proxy, "x2", res, reference)
    assert [s.engine_id for s in segs] == ["A", "B", "C"]
    assert segs[1].ended_by == "abort" and not segs[1].token_ids  # aborted before it started
    assert b_after["running"] == 1 and b_after["pinned_kv"] == 0  # exported, then released
    assert out_a["moved"] == 1 and out_b["moved"] == 1
    assert proxy.totals["kv_handoffs"] == 2 and proxy.totals["reprefill_tokens"] == 0


@contextlib.asynccontextmanager
async def _busy(url: str, rid: str):
    """Another client's long request fills the engine's single batch slot (B's) while the
    block runs; aborted after it."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        hog = asyncio.create_task(
            client.post(
                "/v1/completions",
                json={"prompt": [3, 4], "max_tokens": 1000, "ignore_eos": True, "request_id": rid},
            )
        )
        try:
            await _until_stats(url, lambda s: s["running"] == 1, "the hog runs there")
            yield
        finally:
            await client.post("/abort_requests", json={"request_ids": [rid]}, timeout=10)
            await asyncio.wait_for(hog, 30)


async def _until_stats(url: str, cond, what: str, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond(await _engine_stats(url)):
            await asyncio.sleep(0.01)


def test_a_call_drained_from_a_queue_after_its_engine_died_counts_its_reprefill_once(
    engines, tiny_model, tmp_path
):
    """The call's first engine (D) dies after it computed the prompt and some tokens; the
    retry waits in B's queue (B is busy) when B is drained, so B computed nothing and holds no
    KV; C computes the lost tokens again. The records say so: B's segment re-prefilled 0 and
    held 0 KV, C's segment re-prefilled what D had computed, and the proxy's total counts it
    once (it was counted on B and again on C)."""
    dead = start_engine(tiny_model, log_path=tmp_path / "D.log").wait_healthy(120)

    async def main():
        proxy = Proxy(ProxyConfig(kv_handoff=True, drain_timeout_s=30, request_timeout_s=60))
        await proxy.join("A", dead.url, kind="standalone")  # D, under the name calls start on
        await proxy.join("B", engines["B"].url, kind="cell", cell_index=1)
        b_url = engines["B"].url
        try:
            async with _busy(b_url, "hog3"):
                reference = await _reference(engines["C"].url)
                task = await _start_call(proxy, "x3", dead.url, stream=True)
                await asyncio.to_thread(dead.kill)  # D dies under the call: its KV is gone
                await _until_stats(
                    b_url, lambda s: s["waiting"] == 1 and s["running"] == 1, "the retry waits at B"
                )
                # C joins only now: the retry had nowhere to go but B
                await proxy.join("C", engines["C"].url, kind="cell", cell_index=0)
                out_b = await asyncio.wait_for(proxy.drain("B"), 30)
                res = await asyncio.wait_for(task, 60)
            return proxy, res, reference, out_b
        finally:
            await proxy.close()

    try:
        proxy, res, reference, out_b = asyncio.run(main())
    finally:
        dead.stop()
    assert res.finish_reason == "length" and res.token_ids == reference
    [call] = proxy.records.calls("x3")
    d, b, c = call.segments
    assert [s.engine_id for s in call.segments] == ["A", "B", "C"], call.segments
    assert d.ended_by == "error" and d.token_ids
    assert b.ended_by == "abort" and not b.token_ids and b.kv_tokens == 0
    assert b.reprefill_tokens == 0  # B computed nothing
    lost = len(PROMPT) + len(d.token_ids) - 1  # what D had computed
    assert c.cached_tokens == 0 and c.reprefill_tokens == lost
    assert proxy.totals["reprefill_tokens"] == lost
    assert out_b["moved"] == 1


class AbortAfter:
    """A's real adapter, except that an abort reaches the engine only once the engine has
    finished every request it ran (its ``/stats`` show nothing running or waiting)."""

    def __init__(self, inner, url: str) -> None:
        self.inner, self.url = inner, url

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def abort(self, request_ids, keep_kv: bool = False):
        await _until_stats(self.url, lambda s: s["running"] == 0 and s["waiting"] == 0, "A idle")
        return await self.inner.abort(request_ids, keep_kv=keep_kv)


@pytest.mark.parametrize("handoff", [True, False], ids=["kv", "plain"])
def test_a_call_that_finishes_before_its_drains_abort_lands_is_not_counted_moved(engines, handoff):
    """The drain's abort reaches A only after the call has finished there: the call ran on A
    alone, and the drain says it moved nothing (it counts the call as finished at the source)
    and charged no re-prefill, so the run's ``drained_requests`` never exceeds the calls that
    really went elsewhere (``rerouted_requests``)."""

    async def main():
        proxy = await _proxy(engines)
        a = proxy.router.members["A"]
        a.adapter = AbortAfter(a.adapter, engines["A"].url)
        try:
            task = await _start_call(proxy, "x4", engines["A"].url, stream=True)
            out = await asyncio.wait_for(proxy.drain("A", handoff), 60)
            res = await asyncio.wait_for(task, 60)
            return proxy, res, out
        finally:
            await proxy.close()

    proxy, res, out = asyncio.run(main())
    assert res.finish_reason == "length" and len(res.token_ids) == BUDGET
    [call] = proxy.records.calls("x4")
    assert [(s.engine_id, s.ended_by) for s in call.segments] == [("A", "length")]
    assert out["moved"] == 0 and out["finished_at_source"] == 1, out
    assert out["reprefill_tokens"] == 0 and proxy.totals["retries"] == 0
