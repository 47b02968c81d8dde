"""Records verl's hook calls, with verl's context and the rollouter statistics verl's policies
could ask for, from a simulated verl-default run (``tests/fixtures/verl/contexts.jsonl``: what
``tests/unit/integrations/test_verl_bridge.py`` drives tidal's policies inside verl with).

    .venv/bin/python benchmarks/verl_contexts.py [--out FILE] [--bursts N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from tidal.sim.scenario import load
from tidal.sim.world import World

OUT = Path(__file__).resolve().parents[1] / "tests/fixtures/verl/contexts.jsonl"


class Recorder:
    def __init__(self, hooks, world: World, lines: list[dict]) -> None:
        self.hooks, self.world, self.lines = hooks, world, lines

    def __getattr__(self, name):
        attr = getattr(self.hooks, name)
        if name not in (
            "should_deactivate",
            "deactivate_wait_samples",
            "should_activate_after_step",
            "update_after_step",
        ):
            return attr

        def call(*args):
            *head, ctx = args
            c = self.world.controller
            m = c.metrics
            budget = m.budget_groups or 0
            pending = c.pending_dispatch // max(1, self.world.group_size)
            stats = {
                "monitor/active_tasks_size": m.active_groups,
                "monitor/queue/mq_queue_size": c.ledger.ready_unassigned,
                "static/max_concurrent_samples": m.capacity_groups(c.cells.rollout_capacity),
                "static/max_required_samples": budget,
                "count/staleness_samples": max(0, budget - pending),
                "count/total_generated_samples": c.ledger.groups_ready_total,
            }
            out = attr(*args)
            self.lines.append(
                {
                    "t": round(self.world.now, 3),
                    "hook": name,
                    "args": head,
                    "ctx": dataclasses.asdict(ctx),
                    "stats": stats,
                    "verl_default": out,
                }
            )
            return out

        return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--bursts", type=int, default=6)
    a = ap.parse_args()
    world = World(load("dapo-math-32gpu").scaled(1.0, bursts=a.bursts), "verl-default")
    lines: list[dict] = []
    world.controller.policy.hooks = Recorder(world.controller.policy.hooks, world, lines)
    world.run()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    hooks = {}
    for x in lines:
        hooks[x["hook"]] = hooks.get(x["hook"], 0) + 1
    print(
        f"{len(lines)} hook calls from {a.bursts} versions of dapo-math-32gpu "
        f"(verl-default): {hooks} -> {a.out}"
    )


if __name__ == "__main__":
    main()
