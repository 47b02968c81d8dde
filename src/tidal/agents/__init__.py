"""Harness side: the workload (task sources, rewards, agent kinds), executions, workspaces,
environments, and the ledger-event protocol.

``HarnessPool`` runs executions concurrently against the proxy; ``LedgerEvents`` is what the
control plane's ledger implements (``dispatched`` / ``launched`` / ``closed``);
``ExecutionRegistry`` enforces close-exactly-once; external harnesses register through the
proxy (``POST /tidal/executions``, ``POST /tidal/executions/{id}/close``). A run's ``task:``
section is built by ``workload.Workload``: rows from ``tasks``, a reward from ``rewards``, an
agent kind from ``kinds`` (``chat``; ``agent_python``; ``agent_command``, identified at the proxy
by ``identity``'s per-execution URL and key); ``swe_repos`` generates small repositories.
"""

from tidal.agents.environments import ArithmeticTask, Environment, StepResult, WorkspaceTask
from tidal.agents.events import EventLog, ExecutionRegistry, LedgerEvents
from tidal.agents.kinds import AgentContext, AgentOutcome, register_agent_kind
from tidal.agents.pool import ExecutionResult, HarnessPool, PoolConfig
from tidal.agents.tasks import TaskRow

__all__ = ["AgentContext", "AgentOutcome", "ArithmeticTask", "Environment", "EventLog",
           "ExecutionRegistry", "ExecutionResult", "HarnessPool", "LedgerEvents", "PoolConfig",
           "StepResult", "TaskRow", "WorkspaceTask", "register_agent_kind"]
