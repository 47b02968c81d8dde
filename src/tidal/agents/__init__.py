"""Harness side: the workload (task sources, rewards, agent kinds), executions, workspaces, and
the ledger-event protocol.

``HarnessPool`` runs executions concurrently against the proxy; ``LedgerEvents`` is what the
control plane's ledger implements (``dispatched`` / ``launched`` / ``closed``). Every execution
goes task source -> agent kind -> ``Outcome`` (``tidal.contracts.executions``): a run's ``task:``
section is built by ``workload.Workload``: rows from ``tasks`` (or a built-in source of
``builtin_tasks``), a reward from ``rewards``, an agent kind from ``kinds`` (``chat``;
``python``; ``command``, identified at the proxy by ``identity``'s per-execution URL and key);
``swe_repos`` generates small repositories. The proxy owns each execution's registration and
close (``POST /tidal/executions``, ``POST /tidal/executions/{id}/close``); the pool asks it.
The runtime imports ``HarnessPool``, ``PoolConfig``, ``Workload`` and ``check_workload`` and
nothing else of this package (``tests/unit/test_layers.py``).
"""

from tidal.agents.events import EventLog, ExecutionRegistry, LedgerEvents
from tidal.agents.kinds import AgentContext, register_agent_kind
from tidal.agents.pool import HarnessPool, PoolConfig
from tidal.agents.tasks import TaskRow

__all__ = [
    "AgentContext",
    "EventLog",
    "ExecutionRegistry",
    "HarnessPool",
    "LedgerEvents",
    "PoolConfig",
    "TaskRow",
    "register_agent_kind",
]
