"""The built-in engine's settings, and where a level-1 sleep spills its weights.

In: what ``tidal engine`` (``contracts.launch.EngineSettings``) or a test asks for. Out: the
validated ``EngineConfig`` an ``Engine`` runs with, and ``spill_path``. Moved whole out of
``engine``.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tidal.contracts.trainer import DEVICE_PATTERN


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "tidal"
    max_batch: int = Field(32, ge=1)
    max_waiting: int = Field(1024, ge=0)
    kv_lease_s: float = Field(30.0, gt=0)
    wait_timeout_s: float = Field(60.0, gt=0)
    seed: int = 0
    # a model step of a tiny model is mostly Python holding the GIL: running it in a worker
    # thread only adds GIL hand-offs; big models release the GIL in their kernels
    step_in_thread: bool = False
    device: str = Field("cpu", pattern=DEVICE_PATTERN, description="'cpu', 'cuda' or 'cuda:N'")
    # KV of finished requests kept for the next call of their conversation (0: off, the
    # default: a prefill from cached KV can differ from a fresh one in the last float bits,
    # which seeded replays of a run must not see)
    prefix_cache_mb: float = Field(0.0, ge=0)
    # runtime.deterministic: each request's forward runs alone and one token at a time (its
    # prompt too), so a row's float ops never depend on which requests share its batch nor on
    # how its tokens were cut into steps by a move (a re-prefill elsewhere, a KV handoff)
    deterministic: bool = False
    spill_dir: str | None = Field(
        None,
        description="where a level-1 sleep writes the weights "
        "(a run's spill/ directory, removed with the run's parts); "
        "None: they are held in CPU memory, never written to /tmp",
    )


def spill_path(spill_dir: str | Path, name: str) -> Path:
    """The file a level-1 sleep of engine ``name`` (this process) writes its weights to."""
    return Path(spill_dir) / f"tidal-spill-{name}-{os.getpid()}.safetensors"
