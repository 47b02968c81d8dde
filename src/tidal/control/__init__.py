"""tidal's control plane: pure decisions, no I/O, no wall clock.

In: events (``tidal.types``); out: transition plans for an Actuator and decision-log records.
Pieces: ``ledger`` (waterlevel, groups), ``supply`` (ready supply + hold), ``cells`` (roles,
prefix order), ``policy`` (protocol + registry) with ``waterlevel``, ``verl``,
``policies_simple``; ``plans`` (step sequences), ``controller`` (events -> plans), ``metrics``
(verl's dynamic_resource/* and role timelines), ``decision_log``.
"""

from tidal.control.cells import Cell, CellSet, Standalone
from tidal.control.controller import Actuator, Controller, ControllerSettings
from tidal.control.decision_log import DecisionLog
from tidal.control.ledger import Ledger
from tidal.control.plans import PlanStep, StepKind, TransitionPlan
from tidal.control.policy import (
    Action,
    Decision,
    Observation,
    Policy,
    make_policy,
    parse_policy_spec,
    register_policy,
    registered,
)

__all__ = [
    "Action",
    "Actuator",
    "Cell",
    "CellSet",
    "Controller",
    "ControllerSettings",
    "Decision",
    "DecisionLog",
    "Ledger",
    "Observation",
    "PlanStep",
    "Policy",
    "Standalone",
    "StepKind",
    "TransitionPlan",
    "make_policy",
    "parse_policy_spec",
    "register_policy",
    "registered",
]
