"""Harness side: executions, workspaces, environments, and the ledger-event protocol.

``HarnessPool`` runs executions concurrently against the proxy; ``LedgerEvents`` is what the
control plane's ledger implements (``dispatched`` / ``launched`` / ``closed``);
``ExecutionRegistry`` enforces close-exactly-once; external harnesses register through the
proxy (``POST /tidal/executions``, ``POST /tidal/executions/{id}/close``).
"""

from tidal.agents.environments import ArithmeticTask, Environment, StepResult, WorkspaceTask
from tidal.agents.events import EventLog, ExecutionRegistry, LedgerEvents
from tidal.agents.pool import ExecutionResult, HarnessPool, PoolConfig

__all__ = ["ArithmeticTask", "Environment", "EventLog", "ExecutionRegistry", "ExecutionResult",
           "HarnessPool", "LedgerEvents", "PoolConfig", "StepResult", "WorkspaceTask"]
