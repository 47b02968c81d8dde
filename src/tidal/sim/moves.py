"""Moving executions between engines: reroutes, aborts, KV holds and verl's rebalance.

In: an execution and a destination engine (or none: it waits for a free slot, keeping its
progress). Out: the execution bound to its new engine; re-prefill of its context paid unless
its KV cache was handed off; a ``RequestRetried`` event when a request was in flight (the
harness sees one normal answer: invariant 4). Counts reroutes and re-prefilled tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.sim import dispatch, slot_waits
from tidal.types import RequestRetried

if TYPE_CHECKING:
    from tidal.sim.dispatch import ExecRec
    from tidal.sim.engines import Engine
    from tidal.sim.world import World


def pick_destination(w: World, dests: list[Engine], ordered: bool) -> Engine | None:
    ok = [d for d in dests if d.admitting and d.free_slots > 0]
    if not ok:
        return None
    return ok[0] if ordered else max(ok, key=lambda d: d.free_slots)


def move(w: World, ex: ExecRec, dest: Engine | None, kv: bool, hold: bool) -> None:
    """Moves an execution off its engine (a reroute or abort); its harness lives on. Its
    request keeps the decode tokens its turn has left; without a KV handoff its cache stays
    behind, so the request prefills its context once where it restarts."""
    w.reroutes += 1
    if ex.seg is not None:
        ex.pending = w.stop_seq(ex)
        w.emit(RequestRetried(w.now, ex.eid))
    if not kv:
        ex.cached = 0
    if ex.engine is not None:
        ex.engine.members.discard(ex)
        ex.engine = None
    if dest is None:
        ex.hold = False
        w.waiting[ex] = None
        slot_waits.start(w, ex)
        return
    ex.hold = hold
    dispatch.bind(w, ex, dest)


def release_hold(w: World, ex: ExecRec, kv: bool) -> None:
    """The KV handoff of a held execution is over (``kv``) or failed (its cache is lost);
    its request restarts here."""
    if not ex.hold:
        return
    ex.hold = False
    if not kv:
        ex.cached = 0
    if ex.engine is not None and ex.pending is not None and not ex.in_tool:
        work, ex.pending = ex.pending, None
        w.start_seq(ex, work)


def rebalance(w: World) -> None:
    """verl rebalance: abort in-flight everywhere, resume least-loaded."""
    ready = [e for e in w.engines if e.admitting]
    if not ready:
        return
    execs = sorted((ex for e in ready for ex in e.members), key=lambda x: x.seq_no)
    per = -(-len(execs) // len(ready)) if execs else 0
    for ex in execs:
        e = ex.engine
        if e is not None and len(e.members) > per:
            move(w, ex, pick_destination(w, ready, ordered=False), kv=False, hold=False)
        elif ex.seg is not None:
            rem = w.stop_seq(ex)
            ex.cached = 0  # an aborted request's blocks are freed: it prefills again
            w.emit(RequestRetried(w.now, ex.eid))
            w.start_seq(ex, rem)
