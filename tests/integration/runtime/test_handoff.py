"""Each weight carrier delivers a version bit for bit to a real built-in engine, and a carrier
that fails mid-version falls back to the next one while the engine never serves a half-loaded
version.

Real parts: the core's ``VersionWriter`` (a shared-memory segment per version, the run's file),
the ``Handoff`` of ``tidal run``, an ``EngineHost`` with its own built-in engine process (the
tiny model), a gloo side group for the broadcast, the file's bytes as Ray's object store hands
them to an actor (``object``). Not Ray: the host is called the way Ray calls
an actor (``.method.remote(...)`` in a thread; see test_load_abort.py). Each tensor's sha256 as
the engine serves it (``/tidal/weights/hashes``) is compared with the trainer's.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tidal.runtime.cell import EngineHost
from tidal.runtime.engines import EngineId
from tidal.runtime.handoff import Handoff, VersionWriter
from tidal.training import carriers
from tidal.training.carriers import SegmentRing, segment_root
from tidal.training.flat import ParamLayout
from tidal.training.transport import FilePublisher

TOKEN = "handoff-test"


class AsActor:
    def __init__(self, host: EngineHost) -> None:
        self.host = host

    def __getattr__(self, name: str):
        method = getattr(self.host, name)
        return SimpleNamespace(remote=lambda *a: asyncio.to_thread(method, *a))


def _hashes(named: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        n: hashlib.sha256(
            t.detach().float().contiguous().reshape(-1).view(torch.uint8).numpy()
        ).hexdigest()[:16]
        for n, t in named.items()
    }


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tidal.models import create_tiny, load_model

    tmp = tmp_path_factory.mktemp("handoff")
    # the engine host reads the run's token from the environment, as in a cell actor; put back
    # after the module: a token left in this process's environment would reach every engine
    # later tests start, and their proxies (without it) would be refused (CI 2026-12-06)
    before = os.environ.get("TIDAL_ENGINE_TOKEN")
    os.environ["TIDAL_ENGINE_TOKEN"] = TOKEN
    try:
        model_dir = create_tiny(tmp / "tiny", seed=5)
        model, _ = load_model(model_dir)
        host = EngineHost("c0", str(model_dir), 4, str(tmp))
        host.start(120, None)
        yield SimpleNamespace(host=host, actor=AsActor(host), model=model, tmp=tmp)
        host.stop()
    finally:
        if before is None:
            os.environ.pop("TIDAL_ENGINE_TOKEN", None)
        else:
            os.environ["TIDAL_ENGINE_TOKEN"] = before


def _writer(e, name: str) -> VersionWriter:
    """As ``tidal run``'s: segments in /dev/shm (the engine serves from their pages)."""
    layout = ParamLayout.of(e.model)
    files = FilePublisher(e.tmp / f"weights-{name}", layout)
    return VersionWriter(files, SegmentRing(segment_root(f"handoff-{name}"), layout))


def _version(e, writer: VersionWriter, version: int) -> dict[str, str]:
    """The trainer's weights moved by ``version`` * 1e-3, published; their hashes."""
    params = {n: p.detach() + version * 1e-3 for n, p in e.model.named_parameters()}
    writer.restream = lambda: iter(params.items())
    writer.publish_stream(version, iter(params.items()))
    return _hashes(params)


def _handoff(writer: VersionWriter, force: str, group_timeout_s: float = 30) -> Handoff:
    # ``blob``: what Ray's object store hands the actor (``Engines.blob`` puts the file's bytes)
    engines = SimpleNamespace(transport=lambda eid: "file", blob=lambda p: Path(p).read_bytes())
    return Handoff(engines, writer, force, call_timeout_s=60, group_timeout_s=group_timeout_s)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("carrier", ["shm", "broadcast", "file", "object"])
def test_each_carrier_delivers_the_version_bit_for_bit(engine, carrier):
    writer = _writer(engine, carrier)
    want = _version(engine, writer, 1)
    d = asyncio.run(_handoff(writer, carrier).deliver(EngineId.cell(0), engine.actor, 1, "v1"))
    assert (d.carrier, d.label, d.failed) == (carrier, "v1", ())
    assert d.bytes >= 4 * ParamLayout.of(engine.model).numel and d.pause_s <= d.seconds
    # the engine's own parts of the load: opened and checked, then the wait for its step
    # (Ray's object store hands the actor bytes it loads as a label alone: no parts)
    parts = dict(d.parts)
    if carrier != "object":
        assert sorted(parts) == ["prepare_s", "step_wait_s"] and min(parts.values()) >= 0
        assert sum(parts.values()) + d.pause_s <= d.seconds
        assert d.record()["step_wait_s"] == round(parts["step_wait_s"], 4)
    served = engine.host.weight_hashes()
    assert served["weight_version"] == "v1" and served["hashes"] == want
    if carrier == "shm":  # served from the segment's own pages: the engine maps it
        assert writer.segment in Path(f"/proc/{engine.host.proc.proc.pid}/maps").read_text()
    if carrier == "broadcast":  # the next version over the same group, kept by both ends
        h = _handoff(writer, carrier)
        asyncio.run(h.deliver(EngineId.cell(0), engine.actor, 1, "v1"))
        group = h._links[EngineId.cell(0)][1]
        want = _version(engine, writer, 2)
        d = asyncio.run(h.deliver(EngineId.cell(0), engine.actor, 2, "v2"))
        assert (d.carrier, d.label) == ("broadcast", "v2")
        assert h._links[EngineId.cell(0)][1] is group
        assert engine.host.weight_hashes()["hashes"] == want
    writer.close()


@pytest.mark.timeout(300)
def test_a_torn_segment_falls_back_to_the_file_and_nothing_half_loaded_is_served(engine):
    writer = _writer(engine, "torn")
    want = _version(engine, writer, 2)
    h = _handoff(writer, "auto")
    assert h.carriers(EngineId.cell(0)) == ["shm", "file"]
    os.truncate(writer.segment, os.path.getsize(writer.segment) // 2)  # half of it is gone
    d = asyncio.run(h.deliver(EngineId.cell(0), engine.actor, 2, "v2"))
    assert d.carrier == "file" and d.failed and d.failed[0].startswith("shm: ")
    assert "no weights of this model" in d.failed[0]  # refused before any copy
    assert engine.host.weight_hashes()["hashes"] == want  # the whole version, from the file

    before = engine.host.weight_hashes()
    want3 = _version(engine, writer, 3)
    os.truncate(writer.segment, 100)  # torn again, and no trainer to write the file from
    writer.restream = None
    with pytest.raises(Exception, match="v3"):
        asyncio.run(h.deliver(EngineId.cell(0), engine.actor, 3, "v3"))
    after = engine.host.weight_hashes()
    assert after == before and after["hashes"] != want3  # still all of v2, nothing of v3
    writer.close()


@pytest.mark.timeout(300)
def test_a_broadcast_lost_mid_version_falls_back_logged_and_nothing_half_received_serves(
    engine, monkeypatch, caplog
):
    """The sender sends the first half of the segment's buckets, then its link is gone: the
    engine's receiver times out without a loadable segment, the handoff logs it and delivers
    the version by the next carrier (shm); the engine serves all of it."""
    writer = _writer(engine, "lost")
    want = _version(engine, writer, 4)

    def half_then_lost(g, path, version, bucket_bytes=carriers.BUCKET_BYTES, timeout_s=60.0):
        size = os.path.getsize(path)
        bucket = -(-size // 2)
        carriers._bcast(g, torch.tensor([size, version, bucket], dtype=torch.int64), timeout_s)
        with open(path, "rb") as f:
            first = torch.frombuffer(bytearray(f.read(bucket)), dtype=torch.uint8)
        carriers._bcast(g, first, timeout_s)
        raise carriers.TransportError("broadcast failed: the link went down")

    monkeypatch.setattr(carriers, "send_segment", half_then_lost)
    h = _handoff(writer, "broadcast", group_timeout_s=3)
    assert h.carriers(EngineId.cell(0)) == ["broadcast", "shm", "file"]
    with caplog.at_level("WARNING", logger="tidal.runtime.handoff"):
        d = asyncio.run(h.deliver(EngineId.cell(0), engine.actor, 4, "v4"))
    assert d.carrier == "shm" and d.failed and d.failed[0].startswith("broadcast: ")
    assert any("did not load by broadcast" in r.getMessage() for r in caplog.records)
    received = engine.host.received_dir()
    assert not list(received.glob("v4*")) and not list(received.glob(".v4*"))  # nothing half
    served = engine.host.weight_hashes()
    assert served["weight_version"] == "v4" and served["hashes"] == want
    writer.close()
