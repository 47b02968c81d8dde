"""The controller's settings: its share of a run's ``ControlConfig``.

In: a ``ControlConfig`` (``control.factory.settings_from`` copies the fields). Out: the frozen
``ControllerSettings`` a ``Controller`` runs with; a field left out takes the config's default.
Moved whole out of ``controller``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config import ControlConfig

_CONTROL = ControlConfig()  # the one source of the defaults below


@dataclass(frozen=True)
class ControllerSettings:
    """The controller's share of a run's ``ControlConfig`` (``tidal.control.factory.
    settings_from`` fills it from one; a field left out takes the config's default), plus
    ``next_burst_quota`` (executions of the burst announced next; 0: none announced) and
    ``max_concurrency`` (groups, verl's max_required_samples: caps the capacity its metrics
    report; None: no cap)."""

    batch_groups: int
    updates_per_burst: int = _CONTROL.updates_per_burst
    supply_fraction: float = _CONTROL.supply_fraction
    supply_hold_s: float = _CONTROL.supply_hold_s
    kv_handoff: bool = _CONTROL.kv_handoff
    next_burst_quota: int = 0
    total_bursts: int | None = _CONTROL.bursts
    max_concurrency: int | None = None
    step_timeout_s: float = _CONTROL.step_timeout_s
    max_step_retries: int = _CONTROL.max_step_retries
    abort_backoff_s: float = _CONTROL.abort_backoff_s
