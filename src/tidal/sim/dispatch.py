"""The dispatcher: per-version budget, groups drawn and dispatched, executions launched.

In: the world (its engines, roles, ledger and workload) at a version start or whenever slots
free up. Out: ``ExecRec`` records for the drawn groups, ``BurstStarted``,
``ExecutionDispatched`` and ``ExecutionLaunched`` events to the controller, sequences started
on engines. Keeps verl's budget: a version dispatches at most ``budget - carried`` groups
(carried: dispatched, not yet consumed), in the workload's draw order; ``ON_DEMAND`` dispatches
a group only when an admitting slot is free (never during a weight sync), ``BURST`` the whole
quota at the version start (group by group ``sim.dispatch_interval_s`` apart when set, as the
runtime's dispatcher). Either way a group goes only when the policy's dispatch hold admits it
(``tidal.control.dispatch_hold``, the rule the runtime's dispatcher applies to every group: the
waterlevel plus the group's executions within ``Controller.dispatch_limit``). A held burst
group waits in its place (``World.burst_held``), is looked at again after every event the
controller handles (``resume``) and goes as soon as the rule admits it, the next one
``dispatch_interval_s`` later; groups are drawn as they go, so none is dropped or reordered (a
new version recomputes its quota from the groups carried, as verl's budget does). Displaced
executions are placed before queued ones.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from tidal.control.carry_over import quota_groups
from tidal.control.dispatch_hold import may_dispatch
from tidal.control.mechanics import DispatchStyle
from tidal.sim import slot_waits
from tidal.sim.workloads import ExecSpec
from tidal.types import BurstStarted, ExecutionDispatched, ExecutionLaunched

if TYPE_CHECKING:
    from tidal.sim.engines import Engine
    from tidal.sim.world import World


class ExecRec:
    """A simulated execution (the harness side: it survives engine and role changes)."""

    __slots__ = (
        "base",
        "burst",
        "cached",
        "closed",
        "ctx",
        "decoded",
        "eid",
        "engine",
        "first_version",
        "gen",
        "gid",
        "hold",
        "hw",
        "in_tool",
        "launched",
        "pending",
        "seg",
        "seq_no",
        "spec",
        "turn",
        "wait_since",
    )

    def __init__(self, eid: str, gid: str, spec: ExecSpec, burst: int, seq_no: int) -> None:
        self.eid, self.gid, self.spec, self.burst, self.seq_no = eid, gid, spec, burst, seq_no
        self.turn = 0
        self.ctx = spec.prompt_tokens
        self.decoded = 0
        self.engine: Engine | None = None
        self.seg: int | None = None
        # Decode tokens the turn still has to produce, while its request waits to (re)start.
        self.pending: float | None = None
        self.in_tool = False
        self.hold = False
        self.cached = 0  # context tokens in its engine's KV cache (0: none, after a flush)
        self.base = 0  # ``cached`` before the request in flight started (its prefill undone)
        self.hw = 0  # the longest context ever cached (beyond it, a prefill is new work)
        self.first_version = 0
        self.gen = 0
        self.launched = False
        self.closed = False
        self.wait_since: float | None = None  # waiting for a slot since (``sim.slot_waits``)

    def context_now(self) -> int:
        return self.ctx


def start_burst(w: World) -> None:
    w.burst += 1
    carried = len(w.group_open) + w.ledger.ready_unassigned
    quota = quota_groups(w.budget_groups, carried)  # the runtime dispatcher's rule
    w.quota_left = quota
    w.burst_held = False  # a group the last version held is drawn within this quota
    w.emit(BurstStarted(w.now, w.burst, quota * w.group_size, w.version))
    if w.profile.dispatch is DispatchStyle.BURST:
        if w.scenario.sim.dispatch_interval_s > 0:
            on_dispatch(w, w.burst)
            return
        _dispatch_quota(w)
    fill(w)


def on_dispatch(w: World, burst: int) -> None:
    """Paced burst dispatch (``sim.dispatch_interval_s``, as the runtime's dispatcher): one
    group now (once the dispatch hold admits it), the next one interval later, until the
    burst's quota is out."""
    if burst != w.burst or w.quota_left <= 0:
        return
    if not _admits(w):
        w.burst_held = True  # ``resume`` sends it once the hold admits it
        return
    dispatch_group(w)
    if w.quota_left > 0:
        from tidal.sim.world import DISPATCH

        w.push(w.now + w.scenario.sim.dispatch_interval_s, DISPATCH, None, burst)
    fill(w)


def _dispatch_quota(w: World) -> None:
    """Unpaced burst dispatch: the quota's groups in order, each once the hold admits it."""
    while w.quota_left > 0:
        if not _admits(w):
            w.burst_held = True
            return
        dispatch_group(w)


def resume(w: World) -> None:
    """Called after every event the controller handled while a burst group is held (the
    waterlevel or the policy's limit may have changed): the held group goes now if the hold
    admits it, and the burst goes on from there as ``start_burst`` would have."""
    if not _admits(w):
        return
    w.burst_held = False
    if w.scenario.sim.dispatch_interval_s > 0:
        on_dispatch(w, w.burst)
        return
    _dispatch_quota(w)
    fill(w)


def dispatch_group(w: World) -> None:
    w.quota_left -= 1
    specs = w.workload.group(w.group_size)
    gid = f"b{w.burst}g{w.quota_left}"
    members = []
    for j, spec in enumerate(specs):
        w.n_exec += 1
        ex = ExecRec(f"{gid}e{j}", gid, spec, w.burst, w.n_exec)
        members.append(ex)
    w.groups[gid] = members
    w.group_open[gid] = len(members)
    for ex in members:
        w.queue.append(ex)
        slot_waits.start(w, ex)
        w.emit(ExecutionDispatched(w.now, ex.eid, gid, len(members), w.burst))


def fill(w: World) -> None:
    """Launches displaced, then queued executions into free admitting slots; dispatches
    more groups on demand within the burst's budget."""
    if w._filling:
        w._refill = True
        return
    w._filling = True
    try:
        w._refill = True
        while w._refill:
            w._refill = False
            _fill_once(w)
    finally:
        w._filling = False


def _admits(w: World) -> bool:
    """The policy's dispatch hold admits the next group (the runtime dispatcher's rule)."""
    return may_dispatch(w.ledger.waterlevel, w.group_size, w.controller.dispatch_limit)


def _may_dispatch(w: World) -> bool:
    """On demand, within the budget, outside a sync, and within the policy's dispatch limit."""
    if w.quota_left <= 0 or w.syncing:
        return False
    pool = w.scenario.sim.max_inflight_groups
    if pool is not None and len(w.group_open) + w.ledger.ready_unassigned >= pool:
        return False  # the total in-flight pool is full
    return _admits(w)


def _fill_once(w: World) -> None:
    on_demand = w.profile.dispatch is DispatchStyle.ON_DEMAND
    if not w.waiting and not w.queue and not (on_demand and _may_dispatch(w)):
        return  # nothing to launch or dispatch
    heap = []
    for i, e in enumerate(w.engines):
        free = e.slots - len(e.members)
        if e.admitting and free > 0:
            heap.append((-free, i, e))
    if not heap:
        return
    heapq.heapify(heap)
    while heap:
        if w.waiting:
            ex = next(iter(w.waiting))
        elif w.queue:
            ex = w.queue[0]
        elif on_demand and _may_dispatch(w):
            dispatch_group(w)
            continue
        else:
            return
        _, i, e = heapq.heappop(heap)
        if not e.admitting or e.free_slots <= 0:
            continue
        if ex.launched:
            del w.waiting[ex]
            bind(w, ex, e)
        else:
            w.queue.popleft()
            launch(w, ex, e)
        if e.admitting and e.free_slots > 0:
            heapq.heappush(heap, (-e.free_slots, i, e))


def launch(w: World, ex: ExecRec, e: Engine) -> None:
    slot_waits.stop(w, ex)
    ex.launched = True
    ex.first_version = w.version
    w.live[ex.eid] = ex
    if ex.spec.timeout_s is not None:
        w.arm_timeout(ex)
    ex.engine = e
    e.members.add(ex)
    w.emit(ExecutionLaunched(w.now, ex.eid))
    if ex.closed:
        return
    if ex.spec.setup_s > 0:  # the harness prepares before the first call
        from tidal.sim.world import TOOL

        ex.in_tool = True
        w.push(w.now + ex.spec.setup_s, TOOL, ex, (ex.gen, -1))
    else:
        w.begin_turn(ex)


def bind(w: World, ex: ExecRec, e: Engine) -> None:
    slot_waits.stop(w, ex)
    ex.engine = e
    e.members.add(ex)
    if ex.pending is not None and not ex.in_tool and not ex.hold:
        work, ex.pending = ex.pending, None
        w.start_seq(ex, work)
