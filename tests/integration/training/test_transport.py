"""Weight transports and side groups across real processes (gloo on 127.0.0.1)."""

from __future__ import annotations

import multiprocessing as mp
import os

import torch

from tidal.training.flat import ParamLayout
from tidal.training.groups import GroupRegistry
from tidal.training.transport import BroadcastTransport, SharedMemoryTransport

SHM = f"tidal-test-shm-{os.getpid()}"

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
torch.set_num_threads(1)
CTX = mp.get_context("spawn")
N = 1_000_000


class Vec(torch.nn.Module):
    def __init__(self, n: int = N) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))


def _shm_reader(name: str, q) -> None:
    reader = SharedMemoryTransport(name, ParamLayout.of(Vec()), create=False)
    out = torch.empty(N)
    version = reader.pull(out, min_version=2, timeout_s=30)
    q.put((version, float(out.sum()), float(out[0])))
    reader.close()


def test_shared_memory_reader_waits_for_the_version_it_needs():
    layout = ParamLayout.of(Vec())
    shm = SharedMemoryTransport(SHM, layout, create=True)
    q = CTX.Queue()
    proc = CTX.Process(target=_shm_reader, args=(SHM, q))
    try:
        shm.publish(1, torch.full((N,), 1.0))
        proc.start()
        shm.publish(2, torch.full((N,), 2.0))
        version, total, first = q.get(timeout=60)
        assert (version, total, first) == (2, 2.0 * N, 2.0)
    finally:
        proc.join(timeout=30)
        shm.close()


def _satellite(cell: int, port: int, rounds: list[list[int]], q) -> None:
    reg = GroupRegistry(cell, "127.0.0.1", port, f"inc{cell}")
    t = torch.empty(N)
    BroadcastTransport(reg, reg.link(cell, f"inc{cell}")).pull(t)
    seen = [float(t[0])]
    for members in rounds:
        if cell in members:
            pg = reg.prefix([(c, "core" if c == 0 else f"inc{c}") for c in members])
            seen.append(BroadcastTransport(reg, pg).pull(t))
    q.put((cell, seen, reg.known_groups()))


def test_prefix_groups_are_created_once_and_a_join_rebuilds_nothing():
    core = GroupRegistry(0, "127.0.0.1", 0, "core")
    q = CTX.Queue()
    rounds = [[0, 1], [0, 1], [0, 1, 2], [0, 1, 2]]
    procs = [CTX.Process(target=_satellite, args=(c, core.port, rounds, q)) for c in (1, 2)]
    try:
        procs[0].start()
        BroadcastTransport(core, core.link(1, "inc1")).publish(0, torch.full((N,), 1.0))
        members = lambda r: [(c, "core" if c == 0 else f"inc{c}") for c in r]  # noqa: E731
        for version, r in enumerate(rounds[:2], start=1):
            BroadcastTransport(core, core.prefix(members(r))).publish(version, torch.ones(N))
        before = {k: id(core._groups[k]) for k in core.known_groups()}
        procs[1].start()  # satellite 2 joins: only its own link is new
        BroadcastTransport(core, core.link(2, "inc2")).publish(2, torch.full((N,), 2.0))
        after_join = {k: id(core._groups[k]) for k in core.known_groups()}
        assert {k: v for k, v in after_join.items() if k in before} == before
        assert set(after_join) - set(before) == {GroupRegistry.link_key(2, "inc2")}
        for version, r in enumerate(rounds[2:], start=3):
            BroadcastTransport(core, core.prefix(members(r))).publish(version, torch.ones(N))
        results = {}
        for _ in procs:
            cell, seen, groups = q.get(timeout=60)
            results[cell] = (seen, groups)
        assert results[1][0] == [1.0, 1, 2, 3, 4]
        assert results[2][0] == [2.0, 3, 4]
        # One link per satellite, one group per prefix: 2 links + prefixes {0,1} and {0,1,2}.
        assert len(core.known_groups()) == 4
        assert len(results[1][1]) == 3 and len(results[2][1]) == 2
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        core.close()
