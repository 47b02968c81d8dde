"""Invariant checks over the simulated world, run after every event with ``check=True``.

DESIGN.md invariants 1 (ledger counters, via ``Ledger.check``), 2 (training prefix, via
``CellSet.check_prefix``), 3 (a waterlevel-safe policy's move to training is one cell), 4 (a
live execution's request is in flight on one engine, pending retry or between turns — never
dropped, never twice) and 7 (no execution lost: every launched, unfinished execution is bound to
exactly one engine or waiting for a slot), plus the world's own: engines of cells admit only
in ``Role.ROLLOUT``, a training cell holds no execution, no engine holds more executions than
slots, the trainer uses exactly the GPUs of cells in ``Role.TRAINING``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.errors import InvariantViolation
from tidal.types import Role

if TYPE_CHECKING:
    from tidal.sim.dispatch import ExecRec
    from tidal.sim.world import World


def check(w: World) -> None:
    """DESIGN.md invariants 1, 2, 3, 4 and 7 plus the world's own bookkeeping."""
    c = w.controller
    w.ledger.check()
    c.cells.check_prefix()
    check_engines(w)
    check_bound(w)
    check_plan(w)
    if w.trainer.gpus != c.cells.training_gpus:
        raise InvariantViolation("the trainer uses GPUs of cells not in training")
    in_flight = sum(check_execution(w, ex) for ex in w.live.values())
    if in_flight != len(w.seqs):
        raise InvariantViolation(f"{len(w.seqs)} requests on engines, {in_flight} expected")


def check_engines(w: World) -> None:
    """Engines of cells admit only in rollout and hold nothing while training; no engine
    prefills more than a context or holds more executions than slots."""
    for cell, e in zip(w.controller.cells.cells, w.cell_engines, strict=True):
        if e.admitting != (cell.role is Role.ROLLOUT):
            raise InvariantViolation(f"{e.name} admits={e.admitting} in role {cell.role}")
        if cell.role is Role.TRAINING and e.members:
            raise InvariantViolation(f"{e.name} trains while holding executions")
    for e in w.engines:
        for seq, left_s, ctx in e.prefills():
            if left_s > e.prefill_s(ctx) * (1 + 1e-9) + 1e-9:
                raise InvariantViolation(
                    f"{e.name}: request {seq} prefills more than its {ctx:.0f}-token context"
                )
        if len(e.members) > e.slots:
            raise InvariantViolation(f"{e.name} holds {len(e.members)} > {e.slots} slots")


def check_bound(w: World) -> None:
    """Invariant 7: every running execution is bound to one engine or waits for a slot."""
    running = sum(len(e.members) for e in w.engines) + len(w.waiting)
    if running != w.ledger.total.running or running != len(w.live):
        raise InvariantViolation(
            f"executions lost: {running} bound or waiting, ledger "
            f"running {w.ledger.total.running}, live "
            f"{len(w.live)}"
        )
    if len(w.queue) != w.ledger.total.queued:
        raise InvariantViolation("dispatch queue disagrees with the ledger")


def check_plan(w: World) -> None:
    """Invariant 3: a waterlevel-safe policy's move to training is one cell."""
    c, fl = w.controller, w.controller.inflight
    if (
        w.waterlevel_safe
        and fl is not None
        and fl.step == 0
        and fl.plan.direction.value == "to_training"
    ):
        cell = c.cells.cells[fl.plan.cells[0]]
        if len(fl.plan.cells) != 1 or cell.role is not Role.MOVING_TO_TRAINING:
            raise InvariantViolation(f"unsafe plan {fl.plan.to_json()}")


def check_execution(w: World, ex: ExecRec) -> int:
    """Invariant 4 for one live execution; 1 if its request is in flight on an engine."""
    # A live execution's model request is in flight on exactly one engine, or waiting to be
    # retried, or it is between requests (tool wait) — never dropped. No re-prefill debt:
    # what a request has left is at most its turn's decode tokens (prefill is queued on the
    # engine, never added to the decode work).
    dec = ex.spec.turns[ex.turn][0] + 1e-6
    if ex.pending is not None and ex.pending > dec:
        raise InvariantViolation(f"{ex.eid}: {ex.pending:.0f} tokens pending, turn {dec:.0f}")
    if ex.cached > ex.ctx + dec:
        raise InvariantViolation(f"{ex.eid}: more cached than its context")
    if ex.seg is None:
        if not ex.in_tool and ex.pending is None:
            raise InvariantViolation(f"{ex.eid}: its model request was dropped")
        return 0
    if ex.engine is not None and ex.engine.has(ex.seg) and ex.engine.remaining(ex.seg) > dec:
        raise InvariantViolation(f"{ex.eid}: more work left than its turn decodes")
    if w.seqs.get(ex.seg) is not ex or ex.engine is None or not ex.engine.has(ex.seg):
        raise InvariantViolation(f"{ex.eid}: request not on its engine")
    if ex.pending is not None:
        raise InvariantViolation(f"{ex.eid}: request both in flight and pending")
    return 1
