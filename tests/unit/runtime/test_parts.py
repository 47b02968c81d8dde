"""The runtime's parts without Ray: what the dispatcher runs (a fresh run and a resumed one
dispatch, restore and skip exactly the burst's executions, each once), what the publisher loads
(every serving engine, never an asleep cell; a failed load does not stop it), and that a failing
task or controller event ends the run with its cause instead of vanishing."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.agents.workload import Workload
from tidal.clock import ManualClock
from tidal.config import load_yaml
from tidal.contracts.calls import ExecutionRecord
from tidal.control.factory import build_controller
from tidal.errors import InvariantViolation, TimeoutExpired
from tidal.runtime.actuator import Weights
from tidal.runtime.dispatcher import Dispatcher, plan_burst
from tidal.runtime.engines import EngineId, Engines
from tidal.runtime.outputs import RunOutputs
from tidal.runtime.publisher import Publisher
from tidal.runtime.tasks import PartFailed, Parts
from tidal.testing.actuator import FakeActuator
from tidal.types import BurstStarted, Tick, WeightSyncDone

CFG = load_yaml(Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml")
GROUPS = CFG.control.quota_executions // CFG.control.group_size
SIZE = CFG.control.group_size


def _record(eid: str) -> ExecutionRecord:
    return ExecutionRecord(execution_id=eid, group_id=eid.rsplit("-", 1)[0], calls=[], reward=0.0)


@settings(max_examples=60, deadline=None)
@given(
    burst=st.integers(0, 3),
    trained=st.sets(st.integers(0, GROUPS - 1)),
    held=st.sets(st.tuples(st.integers(0, GROUPS - 1), st.integers(0, SIZE - 1))),
)
def test_a_burst_plan_covers_every_execution_once(burst, trained, held):
    """Trained groups are skipped, held records restored, the rest run: together exactly
    the uninterrupted burst, and the quota counts what the ledger will see."""
    trained_ids = {f"b{burst}-g{g}" for g in trained}
    held_recs = {
        f"b{burst}-g{g}-e{k}": _record(f"b{burst}-g{g}-e{k}") for g, k in held if g not in trained
    }
    quota, plans = plan_burst(CFG, burst, trained_ids, held_recs)
    ran = [e for p in plans for e in p.run]
    restored = [r.execution_id for p in plans for r in p.restore]
    skipped = [f"{g}-e{k}" for g in trained_ids for k in range(SIZE)]
    everything = sorted(ran + restored + skipped)
    assert everything == sorted(f"b{burst}-g{g}-e{k}" for g in range(GROUPS) for k in range(SIZE))
    assert len(set(everything)) == len(everything)
    assert sorted(restored) == sorted(held_recs)
    assert quota == len(ran) + len(restored)
    assert [p.group_id for p in plans] == sorted(
        (p.group_id for p in plans), key=lambda g: int(g.rsplit("g", 1)[1])
    )


def test_group_task_seeds_never_repeat_across_bursts():
    """Every group of every burst draws its task from its own seed, however many groups a
    burst has (a burst of 1500 groups once gave group 1000 of burst b burst b+1's group 0)."""
    big = CFG.model_copy(
        update={
            "control": CFG.control.model_copy(update={"batch_groups": 750, "updates_per_burst": 2})
        }
    )
    seeds = [p.seed for b in range(3) for p in plan_burst(big, b, set(), {})[1]]
    assert len(seeds) == 3 * 1500 and len(set(seeds)) == len(seeds)
    again = [p.seed for p in plan_burst(big, 1, set(), {})[1]]
    assert again == seeds[1500:3000]  # a pure function of (run seed, burst, group)


class _Pool:
    """The harness pool's interface: runs executions, returns one result each."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    async def run(self, tasks, ids):
        self.ran += ids
        return [SimpleNamespace(execution_id=i) for i in ids]


class _Bridge:
    def __init__(self) -> None:
        self.burst, self.restored, self.n_dispatched = 0, [], 0

    def restore(self, rec):
        self.restored.append(rec.execution_id)

    async def lines_after(self, run):  # executions.jsonl: not this test's
        return await run


def test_dispatch_of_a_resumed_run_runs_only_what_was_not_closed():
    """Resume at burst 1 with group 0 trained and one record of group 1 held."""

    async def go():
        events, published = [], []
        pool, bridge, parts = _Pool(), _Bridge(), Parts()
        held = {"b1-g1-e0": _record("b1-g1-e0")}
        clock = ManualClock()
        d = Dispatcher(
            CFG,
            pool,
            bridge,
            events.append,
            clock,
            parts,
            trained={"b1-g0"},
            held=held,
            ctl=build_controller(CFG, clock, FakeActuator(clock)),
            workload=Workload(CFG),
        )

        async def wait_published(b):
            published.append(b)

        await d.run(1, lambda: 2, wait_published)
        results = await d.results()
        return events, published, pool, bridge, results

    events, published, pool, bridge, results = asyncio.run(go())
    assert published == [1]  # bursts 1..bursts-1, each after the previous one's weights
    (ev,) = [e for e in events if isinstance(e, BurstStarted)]
    assert (ev.burst, ev.version) == (1, 2)
    assert ev.quota_executions == (GROUPS - 1) * SIZE
    assert bridge.restored == ["b1-g1-e0"]
    expected = [f"b1-g{g}-e{k}" for g in range(1, GROUPS) for k in range(SIZE)]
    expected.remove("b1-g1-e0")
    assert pool.ran == expected and [r.execution_id for r in results] == expected


class _Actor:
    def __init__(self, fail: bool = False) -> None:
        self.loaded: list[tuple[str, str]] = []
        self.load_weights = SimpleNamespace(remote=self._load)
        self.load_weights_blob = SimpleNamespace(remote=self._load_blob)
        self.fail = fail

    async def _load(self, path, label):
        if self.fail:
            raise RuntimeError("engine gone")
        self.loaded.append((path, label))
        return label

    async def _load_blob(self, ref, label):
        self.loaded.append((ref, label))
        return label


def _engines(actors: dict, nodes: dict, driver_node: str | None) -> SimpleNamespace:
    """The placement half of ``Engines`` (its own methods) over plain actors; ``ray.put``
    hands back what it was given, so a test sees which bytes crossed nodes."""
    e = SimpleNamespace(
        actors=actors,
        vllm=False,
        nodes=nodes,
        driver_node=driver_node,
        _blob=None,
        ray=SimpleNamespace(put=lambda b: ("object", b)),
        is_vllm=lambda eid: False,
        is_server=lambda eid: False,
    )
    for name in ("transport", "blob", "load"):
        setattr(e, name, functools.partial(getattr(Engines, name), e))
    return e


def test_publication_loads_every_serving_engine_and_skips_asleep_cells(tmp_path):
    actors = {
        EngineId("s", 0): _Actor(),
        EngineId.cell(0): _Actor(),
        EngineId.cell(1): _Actor(),
        EngineId.cell(2): _Actor(fail=True),
    }
    engines = _engines(actors, {}, None)  # embedded: no placement known, every load a file
    cells = SimpleNamespace(is_asleep=lambda i: i == 0, forget_satellite=lambda i: None)
    events: list = []
    pub = Publisher(
        engines,
        cells,
        None,
        Weights(),
        lambda v: f"{tmp_path}/v{v}.bin",
        events.append,
        ManualClock(),
    )
    asyncio.run(pub.publish(3))
    assert (pub.weights.version, pub.weights.label) == (3, "v3")
    assert actors[EngineId("s", 0)].loaded == [(f"{tmp_path}/v3.bin", "v3")]
    assert actors[EngineId.cell(1)].loaded == [(f"{tmp_path}/v3.bin", "v3")]
    assert actors[EngineId.cell(0)].loaded == []  # asleep: loads when it wakes
    (done,) = events
    assert isinstance(done, WeightSyncDone) and done.version == 3
    assert dict(done.transports) == {"s0": "file", "c1": "file", "c2": "file"}


def test_publication_sends_weights_across_nodes_through_the_object_store(tmp_path):
    (tmp_path / "v1.bin").write_bytes(b"weights of v1")
    s0, c0, c1 = EngineId("s", 0), EngineId.cell(0), EngineId.cell(1)
    actors = {s0: _Actor(), c0: _Actor(), c1: _Actor()}
    engines = _engines(actors, {s0: "head", c0: "head", c1: "node-2"}, "head")
    events: list = []
    cells = SimpleNamespace(is_asleep=lambda i: False)
    pub = Publisher(
        engines,
        cells,
        None,
        Weights(),
        lambda v: f"{tmp_path}/v{v}.bin",
        events.append,
        ManualClock(),
    )
    asyncio.run(pub.publish(1))
    assert actors[s0].loaded == actors[c0].loaded == [(f"{tmp_path}/v1.bin", "v1")]
    assert actors[c1].loaded == [(("object", b"weights of v1"), "v1")]  # the file's bytes
    assert dict(events[0].transports) == {"s0": "file", "c0": "file", "c1": "object"}
    engines.nodes[c1] = "head"  # a replacement landed on the driver's node: a file again
    assert engines.transport(c1) == "file"


def test_a_resumed_publisher_refuses_weights_that_are_gone(tmp_path):
    pub = Publisher(
        SimpleNamespace(actors={}, is_vllm=lambda eid: False, is_server=lambda eid: False),
        None,
        None,
        Weights(),
        str,
        lambda e: None,
        ManualClock(),
    )
    with pytest.raises(Exception, match=r"published weights .* are gone"):
        pub.restore(2, str(tmp_path / "v2.bin"))


def test_resumed_metrics_keep_exactly_the_checkpointed_steps(tmp_path):
    lines = [{"step": i, "micro_steps_by_cell": {}} for i in range(5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = RunOutputs(tmp_path, ManualClock(10.0), resumed_elapsed_s=7.5, append=True)
    out.restore_metrics(3)
    assert [m["step"] for m in out.metrics] == [0, 1, 2]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    out.start_clock()
    assert out.elapsed() == 7.5  # time continues over incarnations


def test_a_failing_task_or_event_stops_the_run_with_its_cause():
    async def main_forever():
        await asyncio.sleep(3600)

    async def broken():
        raise ValueError("boom")

    async def with_task():
        parts = Parts()
        parts.spawn("trainer loop", broken())
        try:
            await parts.run(main_forever(), timeout_s=30)
        finally:
            await parts.aclose()

    with pytest.raises(PartFailed, match="trainer loop failed: ValueError: boom"):
        asyncio.run(with_task())

    def handle(event):
        raise InvariantViolation("ledger broke")

    async def with_event():
        parts = Parts()
        guarded = parts.guard_handler(handle)

        async def main():
            asyncio.get_running_loop().call_soon(lambda: _swallow(guarded, Tick(0.0)))
            await asyncio.sleep(3600)

        await parts.run(main(), timeout_s=30)

    with pytest.raises(
        PartFailed, match="controller handling Tick failed: InvariantViolation: ledger broke"
    ) as info:
        asyncio.run(with_event())
    assert info.value.exit_code == 3

    with pytest.raises(TimeoutExpired):
        asyncio.run(Parts().run(main_forever(), timeout_s=0.05))


def _swallow(fn, event):
    """A callback site that drops exceptions (as a harness callback could): the failure
    still reaches the run."""
    with contextlib.suppress(Exception):
        fn(event)


class _LoadingActor:
    """An engine host whose load reads the version it is handed (the whole file, as the
    built-in engine checks it), or refuses it."""

    def __init__(self, fail: bool = False) -> None:
        self.read: list[tuple[str, str, int]] = []
        self.fail = fail
        self.load_version = SimpleNamespace(remote=self._load)

    async def _load(self, path, label):
        if self.fail:
            raise RuntimeError("engine gone")
        self.read.append((path, label, len(Path(path).read_bytes())))
        return {"label": label, "seconds": 0.01, "pause_s": 0.002}


def test_a_publication_by_handoff_names_each_engines_carrier_and_writes_the_file(tmp_path):
    import torch

    from tidal.runtime.handoff import Handoff, VersionWriter
    from tidal.training.carriers import SegmentRing
    from tidal.training.flat import ParamLayout
    from tidal.training.transport import FilePublisher

    model = torch.nn.Linear(4, 3)
    layout = ParamLayout.of(model)
    writer = VersionWriter(
        FilePublisher(tmp_path / "weights", layout), SegmentRing(tmp_path / "shm", layout)
    )
    writer.publish_stream(1, ((n, p.detach()) for n, p in model.named_parameters()))
    s0, c1, c2 = EngineId("s", 0), EngineId.cell(1), EngineId.cell(2)
    actors = {s0: _LoadingActor(), c1: _LoadingActor(), c2: _LoadingActor(fail=True)}
    engines = _engines(actors, {}, None)
    events: list = []
    cells = SimpleNamespace(is_asleep=lambda i: False)
    pub = Publisher(
        engines,
        cells,
        None,
        Weights(),
        writer.path,
        events.append,
        ManualClock(),
        handoff=Handoff(engines, writer),
    )
    asyncio.run(pub.publish(1))
    seg = str(tmp_path / "shm" / "v1.safetensors")
    assert actors[s0].read == actors[c1].read == [(seg, "v1", writer.segments.nbytes)]
    (done,) = events
    assert dict(done.transports) == {"s0": "shm", "c1": "shm"}  # c2 failed: logged, left out
    assert done.detail["engines"]["s0"] == {
        "carrier": "shm",
        "bytes": writer.segments.nbytes,
        "seconds": done.detail["engines"]["s0"]["seconds"],
        "pause_s": 0.002,
    }
    assert Path(writer.path(1)).read_bytes() == Path(seg).read_bytes()  # the checkpoint's file
    report = pub.report()
    assert report["carriers"] == {"shm": 2} and report["memcpy_gbps"] > 0
    # the copy speed measured beside each version too, and each version's share of it
    assert done.detail["memcpy_gbps"] > 0 and report["memcpy_beside_gbps"]["p50"] > 0
    share = (done.detail["gbps"] or 0) / done.detail["memcpy_gbps"]  # 60 bytes: about 0
    expect = {"p50": round(share, 4), "max": round(share, 4)} if done.detail["gbps"] else None
    assert report["share_of_memcpy_beside"] == expect
    assert pub.weights.handoff is pub.handoff  # the actuator's loads take the same road
