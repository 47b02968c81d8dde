"""What a trainer process is started with: the satellite's config and the settings it shares
with the core (how a cell shards, the loss).

In: the cell actor (``tidal.runtime.cell``) builds a ``SatelliteConfig`` from the core's
address and its own device, and passes it as JSON on the command line of
``python -m tidal.training.satellite``, which validates it back. The models live here, away
from ``torch``, so the actor checks the config it sends without loading torch (seconds on the
cell's critical path) and a wrong value fails in the actor with the field's name, not in a
child process's log.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# What ``tidal.models.device.resolve_device`` accepts: the CPU, or a CUDA device.
DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"

# The torch.distributed backend of a process group.
Backend = Literal["gloo", "nccl"]


class ShardConfig(BaseModel):
    """How a cell trains: its rank count, FSDP2 on or off, precision, checkpointing."""

    model_config = ConfigDict(extra="forbid")

    ranks: int = Field(default=1, ge=1, description="processes (devices) of this cell")
    fsdp: bool = Field(
        default=True, description="shard with FSDP2 (False: the plain module, one rank only)"
    )
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        default="auto", description="compute dtype: auto = bf16 on CUDA, fp32 on the CPU"
    )
    activation_checkpointing: bool = False
    timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="every collective inside the "
        "cell, including a follower's wait for rank 0's next operation "
        "(a cell idles while it serves rollout); a follower whose rank 0 "
        "died exits at once",
    )
    join_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="bound on rank 0's wait "
        "for ranks 1..k-1 to start and join (a rank that exits "
        "first ends the wait at once)",
    )


class GRPOLossConfig(BaseModel):
    """The loss the core trains with; a satellite receives the core's, never its own."""

    model_config = ConfigDict(extra="forbid")

    clip_eps_low: float = Field(default=0.2, ge=0)
    clip_eps_high: float = Field(default=0.28, ge=0)
    kl_coef: float = Field(default=0.0, ge=0)


class ModelSpec(BaseModel):
    """How a process builds the policy: a Hugging Face model directory, loaded with
    ``transformers`` (the same architecture and parameter layout as the core's;
    ``tidal.training.satellite.build_model``)."""

    model_config = ConfigDict(extra="forbid")

    model_dir: str


class SatelliteConfig(BaseModel):
    """A satellite trainer process: which cell it is, where the core listens, what it builds."""

    model_config = ConfigDict(extra="forbid")

    cell: int = Field(ge=1)
    host: str = "127.0.0.1"
    rpc_port: int
    store_port: int
    authkey: str
    backend: Backend = "gloo"
    model: ModelSpec
    # The frozen reference for the KL term (needed when the core's loss has kl_coef > 0).
    reference: ModelSpec | None = None
    timeout_s: float = Field(default=120.0, gt=0)
    start_delay_s: float = Field(default=0.0, ge=0)
    max_steps: int | None = None
    torch_threads: int = 1
    device: str = Field(default="cpu", pattern=DEVICE_PATTERN)
    # None: the plain module on one device; a ShardConfig: FSDP2 over this cell's ranks
    shard: ShardConfig | None = None
