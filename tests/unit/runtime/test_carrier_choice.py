"""Each engine's carriers, in order, by its placement (``Handoff.carriers``), as ``tidal run``
wires them (``core_placement``, ``core_ipc_source``): the core's own CUDA device -> ``ipc``
while the core's device parameters hold the version; the driver's node -> ``shm``, then
``file``; another node -> ``broadcast``, then ``object``; no segment -> the file's carriers
only; ``runtime.weight_carrier`` puts one first. Real ``VersionWriter`` (segment + file) of a
small model; the engines' placement is given (no Ray)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tidal.runtime.engines import EngineId
from tidal.runtime.handoff import Handoff, VersionWriter, core_ipc_source, core_placement
from tidal.training.carriers import SegmentRing
from tidal.training.flat import ParamLayout
from tidal.training.transport import FilePublisher

S0, C0, C1, REMOTE, VLLM0 = (
    EngineId("s", 0),
    EngineId.cell(0),
    EngineId.cell(1),
    EngineId.cell(2),
    EngineId.cell(3),
)


def _engines(vllm_cell0: bool = False):
    def is_server(eid):
        return eid == VLLM0 or (vllm_cell0 and eid == C0)

    return SimpleNamespace(
        transport=lambda eid: "object" if eid == REMOTE else "file", is_server=is_server
    )


@pytest.fixture
def writer(tmp_path):
    model = torch.nn.Linear(4, 3)
    layout = ParamLayout.of(model)
    w = VersionWriter(
        FilePublisher(tmp_path / "weights", layout), SegmentRing(tmp_path / "shm", layout)
    )
    w.publish_stream(3, ((n, p.detach()) for n, p in model.named_parameters()))
    yield w, model
    w.close()


def _core(model, device="cuda", version=3, offloaded=False):
    # a torch.device("cuda") is only a name here: nothing is put on a GPU
    return SimpleNamespace(
        device=torch.device(device), sharded=None, offloaded=offloaded, version=version, model=model
    )


def _handoff(w, core, engines=None, force="auto") -> Handoff:
    engines = engines or _engines()
    return Handoff(
        engines,
        w,
        force,
        same_device=core_placement(engines, str(core.device)),
        ipc_source=core_ipc_source(core),
    )


def test_carriers_per_placement_on_a_gpu_core(writer):
    w, model = writer
    h = _handoff(w, _core(model))
    assert h.carriers(C0) == ["ipc", "shm", "file"]  # the core's own cell: its device tensors
    assert h.carriers(C1) == ["shm", "file"]  # another GPU of the driver's node
    assert h.carriers(S0) == ["shm", "file"]
    assert h.carriers(REMOTE) == ["broadcast", "object"]  # another node
    assert h.carriers(C0, version=2) == ["shm", "file"]  # not the version the core holds


@pytest.mark.parametrize(
    "core_kw",
    [{"device": "cpu"}, {"offloaded": True}, {"version": 4}],
    ids=["cpu-core", "offloaded", "stepped-since"],
)
def test_no_ipc_unless_the_cores_device_parameters_hold_the_version(writer, core_kw):
    w, model = writer
    assert _handoff(w, _core(model, **core_kw)).carriers(C0) == ["shm", "file"]


def test_a_vllm_engine_on_the_cores_gpu_gets_no_ipc(writer):
    w, model = writer
    h = _handoff(w, _core(model), engines=_engines(vllm_cell0=True))
    assert h.carriers(C0) == ["shm", "file"]


def test_without_a_segment_only_the_files_carriers_and_a_forced_carrier_comes_first(writer):
    w, model = writer
    h = _handoff(w, _core(model), force="broadcast")
    assert h.carriers(C1) == ["broadcast", "shm", "file"]
    assert h.carriers(REMOTE) == ["broadcast", "object"]
    w.segment = None  # the version went to the file alone (no shared memory)
    h = _handoff(w, _core(model, device="cpu"))
    assert h.carriers(C1) == ["file"] and h.carriers(REMOTE) == ["object"]


def test_the_ipc_source_is_the_cores_own_tensors(writer):
    w, model = writer
    named = core_ipc_source(_core(model))(3)
    assert named is not None and set(named) == set(ParamLayout.of(model).names)
    assert all(named[n].data_ptr() == p.data_ptr() for n, p in model.named_parameters())


def test_a_blocked_broadcast_send_never_holds_the_process_at_exit():
    """The broadcast's sending half runs in a daemon thread of its own: its result and its
    error reach the awaiting task, and a send still blocked (a gloo group whose other member
    died) when its caller gives up neither keeps the loop waiting nor holds the interpreter
    at exit, as a worker of the default executor would (seen: pytest hung after a node loss)."""
    import asyncio
    import threading

    from tidal.runtime.handoff import in_daemon_thread

    release = threading.Event()

    def boom():
        raise OSError("the group broke")

    async def main():
        assert await in_daemon_thread(lambda: 7, "t-ok") == 7
        try:
            await in_daemon_thread(boom, "t-err")
        except OSError as exc:
            err = str(exc)
        blocked = asyncio.ensure_future(in_daemon_thread(release.wait, "t-stuck"))
        await asyncio.sleep(0.05)
        blocked.cancel()
        stuck = [t for t in threading.enumerate() if t.name == "t-stuck"]
        return err, stuck

    err, stuck = asyncio.run(main())  # returns although the send is still blocked
    assert err == "the group broke"
    assert len(stuck) == 1 and stuck[0].daemon and stuck[0].is_alive()
    release.set()
    stuck[0].join(5)
    assert not stuck[0].is_alive()
