from __future__ import annotations

from tidal.serving.router import Member, Router


class _Adapter:  # the router never calls its adapters; it only needs their url and flags
    url = "http://engine"
    supports_kv_handoff = True


def _router(*specs) -> Router:
    r = Router()
    for engine_id, kind, cell, cap in specs:
        r.join(Member(engine_id, _Adapter(), kind, cell, cap))
    return r


def test_sticky_per_execution_least_loaded_otherwise():
    r = _router(("s0", "standalone", 0, 4), ("c0", "cell", 0, 4), ("c1", "cell", 1, 4))
    first = r.pick("ex-1")
    first.inflight["a"] = object()
    assert r.pick("ex-1") is first  # sticky even though others are emptier
    second = r.pick("ex-2")
    assert second is not first  # least loaded
    assert r.pick(None).load == 0


def test_admission_caps_are_respected():
    r = _router(("s0", "standalone", 0, 1), ("c0", "cell", 0, 1))
    for name in ("a", "b"):
        r.pick(name).inflight[name] = object()
    assert r.pick("c") is None and r.capacity() == 2


def test_destinations_standalone_first_then_cells_descending():
    r = _router(
        ("c0", "cell", 0, 4),
        ("c1", "cell", 1, 4),
        ("c2", "cell", 2, 4),
        ("s0", "standalone", 0, 4),
        ("s1", "standalone", 0, 4),
    )
    r.members["s0"].inflight["x"] = object()
    order = [m.engine_id for m in r.destinations(exclude="c1")]
    assert order == ["s1", "s0", "c2", "c0"]


def test_drained_engine_is_never_picked_and_reservations_are_honoured():
    r = _router(("s0", "standalone", 0, 4), ("c0", "cell", 0, 4), ("c1", "cell", 1, 4))
    assert r.pick("ex").engine_id == "s0"
    r.set_admitting("s0", False)
    dest = r.reserve("ex", "s0")
    assert dest.engine_id == "c1" and dest.reserved == 1  # no other standalone: highest cell
    assert r.pick("ex") is dest and dest.reserved == 0
    for _ in range(20):
        assert r.pick(None).engine_id != "s0"
    r.leave("c1")
    assert r.pick("ex").engine_id == "c0"  # the route to a departed engine is dropped


def test_a_live_execution_whose_engine_left_routing_is_counted_as_rerouted():
    r = _router(("s0", "standalone", 0, 1), ("c0", "cell", 0, 4))
    r.members["s0"].inflight["busy"] = object()  # full: ex-1 goes to c0
    assert r.pick("ex-1").engine_id == "c0"
    r.pick("ex-2").inflight["x"] = object()  # a spill for room is not a reroute
    assert r.rerouted_executions == 0
    r.set_admitting("c0", False)  # c0 drained between two calls of ex-1
    del r.members["s0"].inflight["busy"]
    assert r.pick("ex-1").engine_id == "s0"
    assert r.rerouted_executions == 1
    assert r.pick("ex-1").engine_id == "s0" and r.rerouted_executions == 1  # sticky again
