"""Checks a validated ``RunConfig`` against the control plane and builds its objects.

In: a ``RunConfig`` (``tidal.config``: it never imports this package, so what only the
control plane knows is checked here). Out: the config checked (``check_known``: the admission
rule parses, ``policy.module`` imports and registers its policies, ``policy.name`` is
registered; ``checked_policy``: that, and the policy built against the cluster, once per
run), or the cells,
policy and controller of a run; a bad value is one ``ConfigError`` naming the field
(``control.admission``, ``policy.module``, ``policy.name``, ``policy.args.X``). No I/O but the
import of the user's policy module (``tidal.plugins``).
"""

from __future__ import annotations

from pathlib import Path

from tidal.clock import Clock
from tidal.config import ClusterConfig, ControlConfig, PolicyConfig, RunConfig, in_file
from tidal.control.admission import AdmissionRule
from tidal.control.cells import Cell, CellSet, Standalone
from tidal.control.controller import Actuator, Controller, ControllerSettings
from tidal.control.decision_log import DecisionLog
from tidal.control.policy import CellView, Policy, make_policy, registered
from tidal.errors import ConfigError
from tidal.plugins import broken_plugins, load_policies
from tidal.types import Role


def build_cells(cluster: ClusterConfig) -> CellSet:
    cells = [Cell(i, s.slots, s.gpus, s.kind) for i, s in enumerate(cluster.cell_specs())]
    standalone = [
        Standalone(f"standalone-{j}", cluster.standalone_slots, cluster.standalone_gpus)
        for j in range(cluster.standalone_count)
    ]
    return CellSet(cells, standalone)


def cell_views(cells: CellSet) -> tuple[CellView, ...]:
    return tuple(CellView(c.index, c.slots, c.gpus, c.kind, Role.ROLLOUT) for c in cells.cells)


def check_policy(cfg: RunConfig, source: str | Path | None = None) -> RunConfig:
    """``cfg`` once ``checked_policy`` passes (the policy built, then dropped)."""
    checked_policy(cfg, source)
    return cfg


def checked_policy(cfg: RunConfig, source: str | Path | None = None) -> Policy:
    """The run's policy: ``check_known`` once, then the policy built once against its cluster;
    a bad argument, or a policy that cannot start on this cluster, is one ``ConfigError``
    naming the field (``policy.args.X``). The config layer names policies but never builds
    them; whoever turns a file or a spec into a config to run calls this (``source``: see
    ``check_known``) and hands the policy on (``build_controller(policy=...)``)."""
    return build_policy(check_known(cfg, source))


def check_known(cfg: RunConfig, source: str | Path | None = None) -> RunConfig:
    """``cfg`` once what it names is known to the control plane: ``control.admission``
    (``check_control``), then ``policy.module`` and ``policy.name`` (``check_policy_config``).
    With ``source`` (the file ``cfg`` was loaded from) an error names the file as
    ``load_yaml``'s do."""
    try:
        check_control(cfg.control)
        check_policy_config(cfg.policy)
    except ConfigError as exc:
        if source is None:
            raise
        raise in_file(exc, source) from None
    return cfg


def check_control(control: ControlConfig, prefix: str = "control") -> ControlConfig:
    """``control`` once its admission rule parses (``tidal.control.admission``); else a
    ``ConfigError`` naming ``{prefix}.admission`` or ``{prefix}.admission_order``."""
    AdmissionRule.parse(control.admission, control.admission_order, field=f"{prefix}.admission")
    return control


def check_policy_config(policy: PolicyConfig, prefix: str = "policy") -> PolicyConfig:
    """``policy`` once its ``module`` (if any) and the ``tidal.policies`` entry points are
    loaded and its ``name`` is registered; else a ``ConfigError`` naming ``{prefix}.module``
    (the module's own one-line error) or ``{prefix}.name`` (the known policies, and the entry
    points that did not load, listed)."""
    try:
        load_policies([policy.module] if policy.module else [])
    except ConfigError as exc:
        raise ConfigError(f"{prefix}.module", exc.message) from None
    if policy.name not in registered():
        broken = "".join(f"; entry point {k} not loaded: {v}" for k, v in broken_plugins().items())
        where = f" after loading {policy.module}" if policy.module else ""
        raise ConfigError(
            f"{prefix}.name",
            f"unknown policy {policy.name!r}{where} (known: {', '.join(registered())}{broken})",
        )
    return policy


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


def build_controller(
    cfg: RunConfig,
    clock: Clock,
    actuator: Actuator,
    log: DecisionLog | None = None,
    policy: Policy | None = None,
) -> Controller:
    """The run's controller around ``policy`` (``checked_policy``'s, fresh: nothing else holds
    it); without one ``cfg`` is checked first (``checked_policy``), so a config built in code
    runs with its policy module loaded, as one loaded from a file does."""
    if policy is None:
        policy = checked_policy(cfg)
    return Controller(
        build_cells(cfg.cluster),
        policy,
        clock,
        actuator,
        settings_from(cfg),
        log,
        initial_prefix=(
            len(cfg.cluster.start_training) if cfg.cluster.start_training is not None else None
        ),
    )
