"""``tidal run``'s ``ipc`` carrier: the core's own cell on its GPU gets a version by CUDA IPC.

Real parts: an ``EngineHost`` with its built-in engine process on the test device (the tiny
model), the ``VersionWriter`` (segment + file) and the ``Handoff`` wired as ``tidal run`` wires
them (``core_placement``, ``core_ipc_source`` over a core holding the trainer's parameters on the
device). Not Ray: the host is called the way Ray calls an actor (see test_handoff.py).

On CUDA: cell 0's carriers start with ``ipc`` while the core's device parameters hold the
version; the version goes by ``ipc`` (the engine maps the core's tensors and copies them device
to device) and every weight the engine serves has the trainer's sha256; once the core is
offloaded (or took a step) the order falls back to ``shm`` and the next version goes by it.
``TIDAL_TEST_DEVICE=cpu`` (the dry run): the carrier choice only (a core on the CPU never
offers ``ipc``; delivery by ``shm`` is test_handoff.py's); the round trip is skipped.
Run: ``python -m pytest tests/gpu/test_core_ipc_handoff.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from types import SimpleNamespace

import pytest
import torch

from tidal.runtime.engines import EngineId

DEVICE = os.environ.get("TIDAL_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="no CUDA device"),
]
TOKEN = "ipc-handoff-test"


class AsActor:
    def __init__(self, host) -> None:
        self.host = host

    def __getattr__(self, name: str):
        method = getattr(self.host, name)
        return SimpleNamespace(remote=lambda *a: asyncio.to_thread(method, *a))


def _hashes(named) -> dict[str, str]:
    return {
        n: hashlib.sha256(
            t.detach().float().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        ).hexdigest()[:16]
        for n, t in named
    }


@pytest.mark.timeout(300)
def test_the_cores_own_cell_gets_a_version_by_cuda_ipc(tmp_path, monkeypatch):
    from tidal.models import create_tiny, load_model
    from tidal.runtime.cell import EngineHost
    from tidal.runtime.handoff import Handoff, VersionWriter, core_ipc_source, core_placement
    from tidal.training.carriers import SegmentRing, segment_root
    from tidal.training.flat import ParamLayout
    from tidal.training.transport import FilePublisher

    monkeypatch.setenv("TIDAL_ENGINE_TOKEN", TOKEN)
    model_dir = create_tiny(tmp_path / "tiny", seed=5)
    trainer, _ = load_model(model_dir)
    trainer.to(DEVICE)
    core = SimpleNamespace(
        device=torch.device(DEVICE), sharded=None, offloaded=False, version=0, model=trainer
    )
    layout = ParamLayout.of(trainer)
    writer = VersionWriter(
        FilePublisher(tmp_path / "weights", layout), SegmentRing(segment_root("ipc-test"), layout)
    )
    engines = SimpleNamespace(transport=lambda eid: "file", is_server=lambda eid: False)
    handoff = Handoff(
        engines,
        writer,
        call_timeout_s=120,
        same_device=core_placement(engines, str(core.device)),
        ipc_source=core_ipc_source(core),
    )
    # the choice per placement, before anything moves
    core.version = 1
    writer.publish_stream(1, ((n, p.detach()) for n, p in trainer.named_parameters()))
    assert handoff.carriers(EngineId.cell(1), 1) == ["shm", "file"]  # another cell's GPU
    if not ON_CUDA:  # a core on the CPU: never ipc
        assert handoff.carriers(EngineId.cell(0), 1) == ["shm", "file"]
        writer.close()
        pytest.skip("the ipc round trip needs CUDA (the carrier choice on the CPU: checked)")
    assert handoff.carriers(EngineId.cell(0), 1) == ["ipc", "shm", "file"]
    assert handoff.carriers(EngineId.cell(0), 2) == ["shm", "file"]  # not the core's version
    host = EngineHost("c0", str(model_dir), 4, str(tmp_path), device=DEVICE)
    host.start(120, None)
    try:
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.add_(1e-3)
                core.version = 2
                writer.publish_stream(2, ((n, p.detach()) for n, p in trainer.named_parameters()))
                core.offloaded = True  # its device tensors are no longer where the engine maps
            named = [(n, p.detach()) for n, p in trainer.named_parameters()]
            order = handoff.carriers(EngineId.cell(0), version)
            d = asyncio.run(
                handoff.deliver(EngineId.cell(0), AsActor(host), version, f"v{version}")
            )
            served = host.weight_hashes()
            assert served["weight_version"] == f"v{version}" and d.failed == ()
            assert served["hashes"] == _hashes(named)  # bit for bit (the engine is float32)
            if version == 1:
                assert order == ["ipc", "shm", "file"] and d.carrier == "ipc", (order, d)
                print(f"ipc: {d.bytes / 1e6:.1f} MB in {d.seconds:.3f} s (pause {d.pause_s:.4f} s)")
            else:
                assert order == ["shm", "file"] and d.carrier == "shm", (order, d)
    finally:
        host.stop()
        writer.close()
