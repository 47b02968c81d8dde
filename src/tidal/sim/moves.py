"""Moving executions between engines: reroutes, aborts, KV holds, verl's rebalance and its V1
trainer's redistribution.

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


def redistribute(w: World) -> None:
    """verl's V1 separate-async switch to rollout: the hybrids join the load balancer with its
    sticky cache cleared just before the standalone weight sync aborts every standalone
    request, so each retry goes to the least-loaded replica of all (standalone and hybrid);
    the requests that land on the standalone replicas are not aborted a second time.
    Here: requests move from engines above their replicas' share of the requests in flight
    to engines below it, those whose prefill has not started first (in verl they were
    never placed on the standalone engine), then the others in a seeded random order (verl's
    placement is arbitrary); each moved request prefills its context where it lands.
    Executions between turns (tool waits) stay where they are."""
    import random

    ready = [e for e in w.engines if e.admitting]
    if len(ready) < 2:
        return
    live = {
        e: [ex for ex in e.members if ex.seg is not None or ex.pending is not None] for e in ready
    }
    total = sum(len(v) for v in live.values())
    replicas = sum(e.replicas for e in ready)
    share = {e: total * e.replicas / replicas for e in ready}
    rng = random.Random(w.scenario.seed * 1000003 + w.version)
    movers: list[ExecRec] = []
    for e in ready:
        excess = len(live[e]) - round(share[e])
        if excess <= 0:
            continue
        execs = sorted(live[e], key=lambda x: x.seq_no)
        rng.shuffle(execs)
        queued = [p[0] for p in e.prefills()]
        waiting = {w.seqs[s] for s in queued[1:] if s in w.seqs}  # the head is under way
        execs.sort(key=lambda x: 0 if (x.seg is None or x in waiting) else 1)
        movers += execs[:excess]
    for ex in movers:
        dest = min(
            (d for d in ready if d.free_slots > 0),
            key=lambda d: (len(live[d]) - share[d], d.name),
            default=None,
        )
        if dest is None or len(live[dest]) + 1 > share[dest] + 0.5:
            break
        live[ex.engine].remove(ex)
        live[dest].append(ex)
        w.move(ex, dest, kv=False, hold=False)
