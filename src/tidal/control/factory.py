"""Builds control-plane objects from a validated ``RunConfig`` (no I/O)."""

from __future__ import annotations

from tidal.clock import Clock
from tidal.config import ClusterConfig, RunConfig
from tidal.control.cells import Cell, CellSet, Standalone
from tidal.control.controller import Actuator, Controller, ControllerSettings
from tidal.control.decision_log import DecisionLog
from tidal.control.policy import CellView, Policy, make_policy
from tidal.types import Role


def build_cells(cluster: ClusterConfig) -> CellSet:
    cells = [Cell(i, s.slots, s.gpus, s.kind) for i, s in enumerate(cluster.cell_specs())]
    standalone = [Standalone(f"standalone-{j}", cluster.standalone_slots, cluster.standalone_gpus)
                  for j in range(cluster.standalone_count)]
    return CellSet(cells, standalone)


def cell_views(cells: CellSet) -> tuple[CellView, ...]:
    return tuple(CellView(c.index, c.slots, c.gpus, c.kind, Role.ROLLOUT) for c in cells.cells)


def check_policy(cfg: RunConfig) -> RunConfig:
    """``cfg`` once its policy is built against its cluster: a bad argument, or a policy that
    cannot start on this cluster, is one ``ConfigError`` naming the field (``policy.args.X``).
    The config layer names policies but never builds them; whoever turns a file or a spec into
    a config to run calls this."""
    build_policy(cfg)
    return cfg


def build_policy(cfg: RunConfig) -> Policy:
    policy = make_policy(cfg.policy.name, dict(cfg.policy.args))
    policy.initial_prefix(cell_views(build_cells(cfg.cluster)))  # validates against the cluster
    return policy


def settings_from(cfg: RunConfig) -> ControllerSettings:
    c = cfg.control
    return ControllerSettings(
        batch_groups=c.batch_groups,
        updates_per_burst=c.updates_per_burst,
        supply_fraction=c.supply_fraction,
        supply_hold_s=c.supply_hold_s,
        kv_handoff=c.kv_handoff,
        next_burst_quota=c.quota_executions,
        total_bursts=c.bursts,
        step_timeout_s=c.step_timeout_s,
        max_step_retries=c.max_step_retries,
        abort_backoff_s=c.abort_backoff_s,
    )


def build_controller(cfg: RunConfig, clock: Clock, actuator: Actuator,
                     log: DecisionLog | None = None) -> Controller:
    return Controller(build_cells(cfg.cluster), build_policy(cfg), clock, actuator,
                      settings_from(cfg), log,
                      initial_prefix=(len(cfg.cluster.start_training)
                                      if cfg.cluster.start_training is not None else None))
