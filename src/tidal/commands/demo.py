"""``tidal demo``: the main job on the embedded default.

Until the runtime and the simulator land, this walks the real control plane through one burst
under the waterlevel policy (events scripted on a virtual clock, plan steps acknowledged by the
shipped fake actuator) and prints every move with its inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command(help="Run the main job on the embedded default (a control-plane walk-through).")
@click.option("--out", type=click.Path(file_okay=False), default="runs/demo", show_default=True)
def command(out: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from tidal.clock import ManualClock
    from tidal.config import RunConfig, validate_model
    from tidal.control.decision_log import DecisionLog
    from tidal.control.factory import build_controller
    from tidal.control.plans import StepKind
    from tidal.testing import FakeActuator
    from tidal.types import (
        BurstStarted,
        CloseReason,
        ExecutionClosed,
        ExecutionDispatched,
        ExecutionLaunched,
        GroupsAssigned,
        TrainerStepDone,
        WeightSyncDone,
    )

    cfg = validate_model(RunConfig, {
        "name": "demo", "cluster": {"cell_count": 4, "cell_gpus": 8, "cell_slots": 8},
        "control": {"group_size": 4, "batch_groups": 4, "updates_per_burst": 1, "bursts": 1,
                    "supply_hold_s": 2.0}})
    clock = ManualClock()
    actuator = FakeActuator(clock, step_s={k: 1.0 for k in StepKind})
    log = DecisionLog()
    ctl = build_controller(cfg, clock, actuator, log)
    actuator.bind(ctl)
    quota = cfg.control.quota_executions
    ctl.handle(BurstStarted(0.0, 0, quota))
    ids = [(f"g{g}e{i}", f"g{g}") for g in range(quota // 4) for i in range(4)]
    for eid, gid in ids:
        ctl.handle(ExecutionDispatched(clock.now(), eid, gid, 4, 0))
        ctl.handle(ExecutionLaunched(clock.now(), eid))
    for k, (eid, _) in enumerate(ids):  # executions finish one every 3 virtual seconds
        clock.advance(3.0)
        ctl.handle(ExecutionClosed(clock.now(), eid, CloseReason.COMPLETED, reward=k % 2))
    ctl.handle(GroupsAssigned(clock.now(), tuple(ctl.ledger.ready_group_ids())))
    clock.advance(10.0)
    ctl.handle(TrainerStepDone(clock.now(), 0, final_of_burst=True))
    ctl.handle(WeightSyncDone(clock.now(), 1))

    table = Table(title="waterlevel policy: moves during one burst (virtual seconds)")
    for col in ("t", "move", "cells", "waterlevel", "capacity", "supply", "reason"):
        table.add_column(col)
    for r in log.records:
        if r["type"] == "decision" and r["action"] != "hold":
            i = r["inputs"]
            table.add_row(f"{r['t']:.0f}", r["action"], str(r["cells"]), str(i["waterlevel"]),
                          str(i["capacity"]), str(i["supply"]), r["reason"])
    console = Console()
    console.print(table)
    console.print(f"final roles: {ctl.cells.describe()}")
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "decisions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log.records))
    (path / "summary.json").write_text(json.dumps(ctl.summary(), indent=2))
    console.print(f"wrote {path / 'decisions.jsonl'} and {path / 'summary.json'}")
