"""The execution lifecycle's ledger events, for the harness side: the registry lives with the
proxy (``tidal.serving.executions``), which owns every execution's registration and close; the
harness pool reports to a ``LedgerEvents`` what the proxy kept. Re-exported here under the names
the agents package has always used."""

from tidal.serving.executions import EventLog, ExecutionRegistry, LedgerEvents

__all__ = ["EventLog", "ExecutionRegistry", "LedgerEvents"]
