"""A policy's decision checked against the controller's invariant and written as its record.

In: the controller's observation, the policy's decision, the policy and the cells. Out:
``record``: the decision log line (what was decided, on which inputs); ``check``: nothing, or
``InvariantViolation`` naming the policy and the move that breaks invariant 3 (DESIGN.md).
Pure: no I/O, no state. Moved whole out of ``controller``.
"""

from __future__ import annotations

from typing import Any

from tidal.control.cells import CellSet
from tidal.control.policy import Action, Decision, Observation, Policy
from tidal.errors import InvariantViolation
from tidal.types import Role


def record(obs: Observation, d: Decision, policy: Policy, cells: CellSet) -> dict[str, Any]:
    """The decision log line of ``d``: what was decided, and the inputs it was decided on."""
    return {
        "t": round(obs.now_s, 6),
        "trigger": obs.trigger,
        "policy": policy.name,
        "action": d.action.value,
        "cells": list(d.cells),
        "reason": d.reason,
        **({"oversubscribe": True} if d.oversubscribe else {}),
        "inputs": {
            "waterlevel": obs.waterlevel,
            "queued": obs.queued,
            "running": obs.running,
            "capacity": obs.rollout_capacity,
            "pending_dispatch": obs.pending_dispatch,
            "supply": obs.supply.supply,
            "supply_held_s": round(obs.supply.held_s, 6),
            "ready_groups": obs.ready_groups,
            "version": obs.version,
            "trainer_step": obs.trainer_step,
            "roles": cells.describe(),
        },
        "state": policy.state(),
    }


def check(obs: Observation, d: Decision, policy: Policy, cells: CellSet) -> None:
    """``d`` (not a hold) keeps invariant 3, else ``InvariantViolation``: a contiguous block at
    the edge of the training prefix, and for a ``waterlevel_safe`` policy a move to training
    of one cell that leaves capacity >= waterlevel (unless an over-subscription the policy may
    make) with the ready supply held."""
    n, k = obs.prefix_len, len(d.cells)
    if k == 0:
        raise InvariantViolation(f"{policy.name}: a move without cells")
    if d.action is Action.TO_TRAINING:
        want, role = tuple(range(n, n + k)), Role.ROLLOUT
    else:
        want, role = tuple(range(n - k, n)), Role.TRAINING
    if d.cells != want or any(
        obs.cells[i].role is not role for i in d.cells if 0 <= i < len(obs.cells)
    ):
        raise InvariantViolation(
            f"{policy.name}: {d.action.value} {list(d.cells)} breaks the prefix order "
            f"(roles {cells.describe()}, expected cells {list(want)})"
        )
    if policy.waterlevel_safe and d.action is Action.TO_TRAINING:
        cell = obs.cells[d.cells[0]]
        after = obs.rollout_capacity - cell.slots
        # Over-subscription (decision 2) waives only the waterlevel, only for a policy
        # that declares it may (tidal), and only on a move that says so.
        waived = d.oversubscribe and getattr(policy, "may_oversubscribe", False)
        if k != 1 or (after < obs.waterlevel and not waived) or not obs.supply.ok:
            raise InvariantViolation(
                f"{policy.name}: unsafe move of {list(d.cells)}: capacity after "
                f"{after}, waterlevel {obs.waterlevel}, supply ok {obs.supply.ok}"
            )
