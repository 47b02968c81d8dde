"""The execution lifecycle's ledger events, for the harness side: the registry lives with the
proxy that serves external harnesses (``tidal.serving.executions``); the harness pool uses the
same one. Re-exported here under the names the agents package has always used."""

from tidal.serving.executions import EventLog, ExecutionRegistry, LedgerEvents

__all__ = ["EventLog", "ExecutionRegistry", "LedgerEvents"]
