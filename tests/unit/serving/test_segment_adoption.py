"""A built-in engine serves a version straight from the trainer's shared-memory segment.

Real parts: the tiny model in real ``Engine`` s, the core's ``SegmentRing`` in /dev/shm (the
engine maps a segment, adopts its pages as its weights and holds a shared lock on it), greedy
decoding compared with an engine that read the same weights from a file. Checked: the served
bytes are the trainer's (sha256 per tensor) and are the segment's pages (no copy); the ring
rewrites a segment in place only when no engine serves from it; a segment being rewritten, torn
or of another label is refused while the old version keeps serving; sleep, wake, a file load
after adoption, a segment of another dtype (copied in); a NaN deep inside a tensor stops the
writer.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os

import pytest
import torch

from tidal.errors import TidalError
from tidal.models import load_model
from tidal.serving.engine import Engine, EngineConfig
from tidal.serving.protocol import GenerateRequest, SamplingParams
from tidal.training.carriers import CHECK_PIECE, SHM_ROOT, SegmentRing, segment_root
from tidal.training.flat import ParamLayout
from tidal.training.segment_maps import on_tmpfs
from tidal.training.transport import FilePublisher, TransportError

pytestmark = pytest.mark.skipif(
    not SHM_ROOT.is_dir() or not on_tmpfs(SHM_ROOT), reason="no /dev/shm tmpfs"
)


def _hashes(named) -> dict[str, str]:
    return {
        n: hashlib.sha256(
            t.detach().float().contiguous().reshape(-1).view(torch.uint8).numpy()
        ).hexdigest()
        for n, t in named
    }


class Parts:
    def __init__(self, tiny_dir, dtype=torch.float32) -> None:
        self.tiny_dir = tiny_dir
        self.trainer, self.tok = load_model(tiny_dir)
        self.layout = ParamLayout.of(self.trainer)
        self.ring = SegmentRing(segment_root(f"adopt{id(self)}"), self.layout, dtype=dtype)
        self.engine = self.new_engine("e")

    def new_engine(self, name: str) -> Engine:
        return Engine(
            load_model(self.tiny_dir)[0], self.tok, self.tiny_dir, EngineConfig(name=name)
        )

    def publish(self, version: int) -> dict[str, str]:
        """The trainer's weights moved a little, written as ``version``; their hashes as the
        ring's dtype holds them."""
        with torch.no_grad():
            for p in self.trainer.parameters():
                p.add_(1e-3)
        named = [(n, p.detach()) for n, p in self.trainer.named_parameters()]
        self.ring.publish_stream(version, iter(named))
        return _hashes((n, t.to(self.ring.dtype)) for n, t in named)

    def served(self) -> dict[str, str]:
        return _hashes(self.engine.model.named_parameters())

    def ino(self, version: int) -> int:
        return os.stat(self.ring.path(version)).st_ino


@pytest.fixture
def parts(tiny_dir):
    p = Parts(tiny_dir)
    yield p
    p.engine._segments.close()  # an engine started in a test is stopped there, on its loop
    p.ring.close()


async def _greedy(engine: Engine) -> list[int]:
    req = GenerateRequest("g", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0))
    return [t async for c in engine.generate(req) for t in c.token_ids]


def _is_view_of_segment(engine: Engine) -> bool:
    seg = engine._segments.serving
    return seg is not None and all(
        p.data_ptr() == seg.views[n].data_ptr() for n, p in engine.model.named_parameters()
    )


def test_a_cpu_engine_serves_the_segments_own_pages_bit_for_bit(parts, tmp_path):
    async def main():
        e = parts.engine
        await e.start()
        want = parts.publish(1)
        await e.update_weights(parts.ring.path(1), "v1")
        assert e.weight_version == "v1" and parts.served() == want
        assert _is_view_of_segment(e)  # no copy: the weights are the segment's pages
        files = FilePublisher(tmp_path / "w", parts.layout)
        files.publish_stream(1, ((n, p.detach()) for n, p in parts.trainer.named_parameters()))
        ref = parts.new_engine("ref")
        await ref.start()
        await ref.update_weights(files.path(1), "v1")
        assert await _greedy(e) == await _greedy(ref)  # the same tokens as from the file
        await ref.stop()
        await e.stop()

    asyncio.run(main())


def test_the_ring_rewrites_a_segment_in_place_only_when_no_engine_serves_from_it(parts):
    async def main():
        e = parts.engine
        parts.publish(1)
        await e.update_weights(parts.ring.path(1), "v1")
        parts.publish(2)
        await e.update_weights(parts.ring.path(2), "v2")  # lets go of v1's segment
        want3 = parts.publish(3)
        ino1 = parts.ino(3)  # v1's file, its pages rewritten in place
        await e.update_weights(parts.ring.path(3), "v3")
        assert parts.served() == want3 and _is_view_of_segment(e)
        # the engine stays on v3 while v4 and v5 are written: v5 does not rewrite v3's pages
        parts.publish(4)
        parts.publish(5)
        assert parts.ino(5) != ino1 and not os.path.exists(parts.ring.path(3))
        assert parts.served() == want3
        want6 = parts.publish(6)
        await e.update_weights(parts.ring.path(6), "v6")
        assert parts.served() == want6 and _is_view_of_segment(e)
        assert len(e._segments._maps) <= 3  # mappings of unlinked files are dropped

    asyncio.run(main())


def test_a_segment_being_rewritten_torn_or_of_another_label_is_refused(parts):
    async def main():
        e = parts.engine
        want = parts.publish(1)
        await e.update_weights(parts.ring.path(1), "v1")
        parts.publish(2)
        fd = os.open(parts.ring.path(2), os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the writer holds it while it rewrites
        with pytest.raises(TransportError, match="being rewritten"):
            await e.update_weights(parts.ring.path(2), "v2")
        os.close(fd)
        with pytest.raises(TransportError, match="holds v2, not v7"):
            await e.update_weights(parts.ring.path(2), "v7")
        os.truncate(parts.ring.path(2), os.path.getsize(parts.ring.path(2)) - 8)
        with pytest.raises(TidalError, match="torn"):
            await e.update_weights(parts.ring.path(2), "v2")
        assert e.weight_version == "v1" and parts.served() == want and _is_view_of_segment(e)

    asyncio.run(main())


def test_sleep_wake_and_a_file_after_adoption(parts, tmp_path):
    async def main():
        e = parts.engine
        want1 = parts.publish(1)
        await e.update_weights(parts.ring.path(1), "v1")
        await e.sleep(2)  # lets go of the segment: the writer may rewrite it
        fd = os.open(parts.ring.path(1), os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
        await e.wake_up()  # the segment it served, still v1: adopted again
        assert parts.served() == want1 and _is_view_of_segment(e)
        await e.sleep(1)  # keeps the segment's views (and its lock) while asleep
        parts.publish(2)
        parts.publish(3)  # not into v1's pages
        await e.wake_up()
        assert parts.served() == want1 and e._segments.serving is None  # copied on wake
        files = FilePublisher(tmp_path / "w", parts.layout)
        files.publish_stream(3, ((n, p.detach()) for n, p in parts.trainer.named_parameters()))
        await e.update_weights(parts.ring.path(3), "v3")
        await e.update_weights(files.path(3), "v3f")  # its own memory again, then the file
        assert e._segments.serving is None and e.weight_version == "v3f"
        assert parts.served() == _hashes(parts.trainer.named_parameters())

    asyncio.run(main())


def test_a_segment_of_another_dtype_is_copied_in(tiny_dir):
    p = Parts(tiny_dir, dtype=torch.bfloat16)
    try:
        want = p.publish(1)
        asyncio.run(p.engine.update_weights(p.ring.path(1), "v1"))
        assert p.engine._segments.serving is None  # copied: float32 weights of bf16 values
        assert p.served() == want
    finally:
        p.engine._segments.close()
        p.ring.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_deep_inside_a_tensor_stops_the_writer(tmp_path, bad, dtype):
    big = torch.nn.Linear(CHECK_PIECE // 64 + 7, 256).to(dtype)
    layout = ParamLayout.of(big)
    ring = SegmentRing(tmp_path / "seg", layout, dtype=dtype)
    with torch.no_grad():
        big.weight.view(-1)[CHECK_PIECE * 2 + 3] = bad
    with pytest.raises(TransportError, match="weight holds NaN"):
        ring.publish_stream(1, ((n, p.detach()) for n, p in big.named_parameters()))
    assert not any(tmp_path.joinpath("seg").iterdir())


def test_a_non_finite_value_in_a_small_tensor_checked_with_its_neighbours_is_named(tmp_path):
    """Tensors written back to back are checked together (one reduction per ``CHECK_SPAN``
    bytes); a NaN in the small one among them is still found and named."""
    big = torch.nn.Linear(CHECK_PIECE // 64 + 7, 256)
    with torch.no_grad():
        big.bias.view(-1)[7] = float("nan")
    ring = SegmentRing(tmp_path / "seg", ParamLayout.of(big))
    with pytest.raises(TransportError, match="parameter bias holds NaN"):
        ring.publish_stream(1, ((n, p.detach()) for n, p in big.named_parameters()))
    assert not any(tmp_path.joinpath("seg").iterdir())


def test_huge_finite_values_are_published_whole(tmp_path):
    """Values whose squares (the float32 check's reduction) overflow are still finite: the
    exact check decides, and the version is written bit for bit."""
    big = torch.nn.Linear(CHECK_PIECE // 64 + 7, 256)
    with torch.no_grad():
        big.weight.view(-1)[CHECK_PIECE + 5] = 3e38
        big.weight.view(-1)[CHECK_PIECE + 6] = -3e38
    ring = SegmentRing(tmp_path / "seg", ParamLayout.of(big))
    named = [(n, p.detach()) for n, p in big.named_parameters()]
    ring.publish_stream(1, iter(named))
    from safetensors.torch import load_file

    assert _hashes(load_file(ring.path(1)).items()) == _hashes(named)
    ring.close()


def test_a_prepared_ring_is_mapped_ahead_and_later_versions_need_no_new_mapping(tiny_dir):
    p = Parts(tiny_dir)
    try:
        p.ring.prepare()  # its two files made ahead, as tidal run's writer does at start
        spares = sorted(f.name for f in p.ring.dir.iterdir())
        assert spares == [".spare-0", ".spare-1"]

        async def main():
            e = p.engine
            p.publish(1)  # into a spare: its pages and the writer's mapping made ahead
            await e.update_weights(p.ring.path(1), "v1")
            await e._premap  # the engine maps the ring's other file after its reply
            maps = dict(e._segments._maps)
            assert len(maps) == 2
            for v in (2, 3, 4):
                want = p.publish(v)
                await e.update_weights(p.ring.path(v), f"v{v}")
                assert p.served() == want and _is_view_of_segment(e)
            assert e._segments._maps.keys() == maps.keys()  # no new mapping since
            await e.stop()

        asyncio.run(main())
    finally:
        p.engine._segments.close()
        p.ring.close()
