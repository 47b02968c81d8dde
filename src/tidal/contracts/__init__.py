"""The contracts: one pydantic model for every value that crosses a package or process
boundary. Producers build these models; consumers receive them (``model_validate`` at the
wire); dicts exist only on the wire.

- ``close``: why an execution closed (``CloseReason``), for the ledger, training and the run
  directory alike.
- ``executions``: how an execution ends (``Outcome``, its ``Turn``s): what an agent kind returns
  and the runtime reads.
- ``calls``: a model call (``CallRecord``, its engine ``Segment``s) and a closed execution
  (``ExecutionRecord``), from the proxy's admin route to the trajectory buffer and checkpoints.
- ``run_files``: one model per line of each run-directory file, for its writer and its readers.
- ``trainer``: a satellite trainer process's config and the settings it shares with the core.

Layer: imports pydantic, the standard library and ``tidal.errors`` (a leaf) only: never torch,
ray or another tidal package (``tests/unit/test_layers.py``), so every process can read them.
"""

from tidal.contracts.calls import (
    NO_VERSION,
    CallRecord,
    ExecutionRecord,
    Segment,
    version_number,
    version_spans,
)
from tidal.contracts.close import CLOSE_REASONS, CloseReason
from tidal.contracts.executions import ExecutionOutcome, Outcome, Turn, finite_reward

__all__ = [
    "CLOSE_REASONS",
    "NO_VERSION",
    "CallRecord",
    "CloseReason",
    "ExecutionOutcome",
    "ExecutionRecord",
    "Outcome",
    "Segment",
    "Turn",
    "finite_reward",
    "version_number",
    "version_spans",
]
