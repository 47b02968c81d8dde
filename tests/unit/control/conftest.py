from dataclasses import replace

import pytest

from tidal.control.policy import CellView, Observation
from tidal.control.supply import SupplyView
from tidal.types import CellKind, Role


def make_obs(
    roles="RRRR",
    slots=10,
    standalone_slots=0,
    waterlevel=0,
    supply=4,
    held=True,
    kind=CellKind.ELASTIC,
    **kw,
):
    short = {"R": Role.ROLLOUT, "T": Role.TRAINING}
    cells = tuple(CellView(i, slots, 8, kind, short[r]) for i, r in enumerate(roles))
    cap = sum(c.slots for c in cells if c.role is Role.ROLLOUT) + standalone_slots
    base = Observation(
        now_s=0.0,
        trigger="Tick",
        cells=cells,
        standalone_slots=standalone_slots,
        standalone_gpus=8 if standalone_slots else 0,
        rollout_capacity=cap,
        waterlevel=waterlevel,
        queued=0,
        running=waterlevel,
        pending_dispatch=0,
        supply=SupplyView(supply, 8, 4.0, supply >= 4, 10.0 if held else 0.0, supply >= 4 and held),
        ready_groups=supply,
        groups_generated=0,
        batch_groups=8,
        updates_per_burst=4,
        trainer_waiting=False,
        trainer_step=0,
        steps_in_version=0,
        version=0,
        bursts_ended=0,
        in_flight=False,
    )
    return replace(base, **kw)


@pytest.fixture
def obs():
    return make_obs
