"""The core trainer: owns the authoritative weights and the only optimizer state.

In: ready groups from the ``TrajectoryBuffer`` (staleness enforced at ``take``), satellites'
gradient contributions (via the ``Coordinator``). Out: one optimizer update per step; after a
non-final update the new parameters go to the step's satellites over their prefix group; after
the final update of a burst the new version goes to every ``WeightPublisher`` (engines).

Per step: expose snapshot v (satellites may join and pull it while the core computes) -> stream
groups into the packing buffer and process micro-steps -> when every micro-step is done, close
the join window -> collect contributions (a lost satellite's micro-steps are reopened and done
here) -> aggregate with the global execution count, clip, step -> broadcast or publish.
Keeps invariant 5 (weights fixed during accumulation, each micro-step once, only the core holds
optimizer state) and invariant 6 (the version counter every published vector carries).

Device: the model, the optimizer state and the gradient sum live on ``TrainerConfig.device``;
satellites' gradients (CPU, off gloo) are moved there before aggregation; snapshots, broadcasts,
published vectors and ``state_dict`` (checkpoints) are CPU copies (a sharded core's checkpoint
is written by every rank, its own shards, through ``dcp_state``). While cell 0 serves rollout
on a GPU, ``offload`` parks the model and optimizer state in CPU memory and frees the device
cache; ``onload`` (or the next ``train_step``) brings them back unchanged.

Sharded (``TrainerConfig.shard``): the core cell is k FSDP2 ranks (``cell_ranks``), this process
rank 0; the gradient sum and the optimizer state stay sharded, satellites' full vectors are
sliced into every rank's shards at the update, and snapshots, broadcasts and publications are
gathered one parameter at a time (a single ``FilePublisher`` is streamed into, never handed a
full copy). A sharded core is not offloaded (it trains on a CPU or on GPUs it does not share).

Over 500 lines since the tree took ``ruff format``'s one-argument-per-line style (450 before):
the core's step, its sharded update and its publication share the optimizer state it alone
owns (invariant 5), so they stay in one class.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from tidal.clock import Clock
from tidal.contracts.trainer import DEVICE_PATTERN, Backend, GRPOLossConfig, ShardConfig
from tidal.errors import ConfigError, TidalError, TimeoutExpired
from tidal.models.device import HostStash, release_cached, resolve_device
from tidal.training.aggregate import Normalization, aggregate, clip_
from tidal.training.cell_ranks import OptimizerSpec, start_cell, stop_cell
from tidal.training.coordinator import Coordinator, CoordinatorConfig, StepInfo
from tidal.training.groups import CommError, GroupRegistry
from tidal.training.packing import PackingBuffer, PackingConfig
from tidal.training.rpc import RpcServer
from tidal.training.trajectory_buffer import TrajectoryBuffer, mean_of
from tidal.training.transport import BroadcastTransport, SharedMemoryTransport, WeightPublisher
from tidal.training.worker import GradientWorker, ShardedWorker

log = logging.getLogger(__name__)


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(default=1e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float | None = 1.0
    groups_per_step: int = Field(default=8, ge=1)
    normalization: Normalization = "global"
    step_data_timeout_s: float = Field(default=600.0, gt=0)
    data_poll_s: float = Field(default=0.05, gt=0)
    backend: Backend = "gloo"
    host: str = "127.0.0.1"
    device: str = Field(default="cpu", pattern=DEVICE_PATTERN)
    loss: GRPOLossConfig = GRPOLossConfig()
    packing: PackingConfig = PackingConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    # None: the plain module on one device; a ShardConfig: FSDP2 over the cell's ranks
    shard: ShardConfig | None = None


@dataclass
class StepReport:
    step: int
    version: int  # the version trained on; the update produced version + 1
    final: bool
    n_groups: int
    n_executions: int
    n_tokens: int
    micro_steps_by_cell: dict[int, int]
    reclaimed: int
    reopened: int
    grad_norm: float
    loss: float
    mean_reward: float
    max_staleness: int
    members: list[int] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)
    compute_s: float = 0.0  # the micro-steps of every training cell (until all are delivered)
    update_s: float = 0.0  # aggregation, optimizer step, and the broadcast or publication
    core_compute_s: float = 0.0  # the core's own micro-steps (one cell's speed)
    core_tokens: int = 0  # trainable tokens of the core's own micro-steps
    # each participating cell's trainer GPU peak so far (MB; empty on the CPU)
    device_peak_mb: dict[int, float] = field(default_factory=dict)


class CoreTrainer:
    """Cell 0. Construct, hand ``address()`` to satellites, then call ``train_step``."""

    def __init__(
        self,
        model: nn.Module,
        config: TrainerConfig,
        trajectories: TrajectoryBuffer,
        clock: Clock,
        publishers: list[WeightPublisher] | None = None,
        reference: nn.Module | None = None,
        pad_id: int = 0,
        initial_version: int = 0,
    ) -> None:
        self.device = resolve_device(config.device)
        self.config, self.trajectories, self.clock = config, trajectories, clock
        self._offloaded = False
        self._memory_lock = threading.Lock()
        self._stash = HostStash()
        self.publishers = list(publishers or [])
        self.version = initial_version
        self.sharded, self._cell_procs = None, []
        self._flat: torch.Tensor | None = None
        if config.shard is not None and config.shard.fsdp:
            if reference is not None:
                raise TidalError(
                    "trainer.shard: a KL reference model is not supported on a "
                    "sharded core (set loss.kl_coef to 0 or shard to null)"
                )
            self.sharded, self._cell_procs = start_cell(
                model,
                self.device,
                config.shard,
                config.loss,
                pad_id,
                OptimizerSpec(config.optimizer, config.lr, config.weight_decay),
                config.host,
            )
            self.model = self.sharded.model
            self.worker: GradientWorker | ShardedWorker = ShardedWorker(0, self.sharded)
            self.optimizer = self.sharded.optimizer
        else:
            if config.shard is not None and config.shard.ranks > 1:
                raise TidalError("trainer.shard.ranks: more than one rank needs fsdp: true")
            self.model = model.to(self.device)
            if reference is not None:
                reference.to(self.device)
            self.worker = GradientWorker(0, model, config.loss, reference, pad_id)
            # one vector holds the weights: on the CPU it is also every step's snapshot; a
            # model in another dtype (bf16 on a GPU) keeps its own tensors, snapshots copy
            if all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad):
                self._flat = self.worker.layout.bind(model)
            params = [p for p in model.parameters() if p.requires_grad]
            cls = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.SGD
            self.optimizer = cls(params, lr=config.lr, weight_decay=config.weight_decay)
        self.layout = self.worker.layout
        self.registry = GroupRegistry(0, config.host, 0, "core", config.backend)
        self.packing = PackingBuffer(config.packing, clock)
        self._snap_shm: SharedMemoryTransport | None = None
        shm_name = None
        if config.coordinator.snapshot_transport == "shm":
            shm_name = f"tidal-snap-{secrets.token_hex(4)}"
            self._snap_shm = SharedMemoryTransport(shm_name, self.layout, create=True)
        self.coordinator = Coordinator(
            config.coordinator, self.packing, self.registry, clock, shm_name
        )
        self.coordinator.numel = self.layout.numel
        self.coordinator.fingerprint = self.layout.fingerprint()
        self.coordinator.loss = config.loss.model_dump()
        self.coordinator.pad_id = pad_id
        self._authkey = secrets.token_bytes(16)
        self.rpc = RpcServer(
            self.coordinator.handle, self.coordinator.on_disconnect, self._authkey, config.host
        )
        self._step = 0
        self._groups_wanted = config.groups_per_step
        self._worker_id = "cell0:core"

    def address(self) -> dict[str, object]:
        """What a satellite needs to reach this core."""
        return {
            "host": self.config.host,
            "rpc_port": self.rpc.address[1],
            "store_port": self.registry.port,
            "authkey": self._authkey.hex(),
            "backend": self.config.backend,  # satellites shard the same way
            "shard": self.config.shard.model_dump() if self.config.shard else None,
        }

    def _pump(self) -> None:
        """Move fresh ready groups into the open batch; seal it when full or the stream ended."""
        want = self._groups_wanted - self.packing.n_groups()
        if want > 0:
            timeout = self.config.data_poll_s if not self.packing.progress()["pending"] else 0.0
            groups = self.trajectories.take(want, self.version, timeout_s=timeout)
            if groups:
                self.packing.add_groups(groups)
                self._groups_in_step += len(groups)
                self._last_data_s = self.clock.now()
        if self.packing.n_groups() >= self._groups_wanted or (self.trajectories.exhausted()):
            self.packing.seal()
            self._sealed = True

    def _process_batch(self) -> None:
        while True:
            if not self._sealed:
                self._pump()
            claim = self.packing.claim(self._worker_id)
            if claim.kind == "micro_step":
                assert claim.micro_step is not None
                self.worker.compute(claim.micro_step)
                ms = claim.micro_step
                if self.packing.complete(self._worker_id, ms.batch_id, ms.index):
                    self.worker.commit()
                    self._last_data_s = self.clock.now()
                else:
                    self.worker.discard()
                continue
            if self.packing.all_done():
                self.coordinator.close_window()
                self._contribs = self.coordinator.wait_deliveries()
                if self.packing.all_done():
                    return
                continue
            if self._sealed:
                # Data paused: satellites hold the remaining claims; wait at this point.
                self.clock_wait(self.config.data_poll_s)
            if self.clock.now() - self._last_data_s > self.config.step_data_timeout_s:
                raise TimeoutExpired(
                    f"step {self._step}: no progress for {self.config.step_data_timeout_s}s "
                    f"({self.packing.progress()})"
                )

    def clock_wait(self, seconds: float) -> None:
        # Waiting is not reading the clock; an Event gives a bounded, interruptible sleep.
        threading.Event().wait(seconds)

    def train_step(self, final: bool = True, groups: int | None = None) -> StepReport | None:
        """One optimizer update over ``groups`` groups (default ``groups_per_step``; fewer when
        the caller knows no more can come, e.g. groups of the burst were dropped); None if the
        stream was empty."""
        self._groups_wanted = groups or self.config.groups_per_step
        self.onload()
        step, version = self._step, self.version
        snapshot = self.full_params()
        if self._snap_shm is not None:
            self._snap_shm.publish(version, snapshot)
        self.packing.open_batch(step, version)
        self.worker.reset()
        self._contribs = []
        self._sealed, self._groups_in_step = False, 0
        self._last_data_s = self.clock.now()
        self.coordinator.open_step(StepInfo(step, step, version, final), snapshot)
        t_compute = self.clock.now()
        self._process_batch()
        t_update = self.clock.now()
        summary = self.packing.finish()
        self._step += 1
        if summary.n_executions == 0:
            self.coordinator.post_outcome(step, {"next": "leave", "version": version})
            return None
        contribs = [self.worker.contribution(), *self._contribs]
        loss_sum = sum(c.loss_sum for c in contribs)
        peaks = {c.cell: c.device_peak_mb for c in contribs if c.device_peak_mb is not None}
        if self.sharded is not None:
            norm = self.sharded.update(
                contribs[0],
                contribs[1:],
                summary.n_executions,
                self.config.normalization,
                self.config.max_grad_norm,
            )
        else:
            contribs = [
                contribs[0],
                *(replace(c, grad=c.grad.to(self.device)) for c in contribs[1:]),
            ]
            grad = aggregate(contribs, summary.n_executions, self.config.normalization)
            # the satellites' sums are in ``grad`` now: their memory goes before the optimizer
            # allocates its temporaries (the coordinator keeps who delivered, not the tensors)
            contribs, self._contribs = [], []
            self.coordinator.release_gradients()
            norm = clip_(grad, self.config.max_grad_norm)
            self.layout.flat_to_grads_(self.model, grad)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        members = self.coordinator.members()
        if final:
            self.coordinator.post_outcome(step, {"next": "leave", "version": self.version})
            self.publish()
        else:
            self._broadcast_update(step, members)
        by_cell: dict[int, int] = {}
        for worker in summary.done_by.values():
            cell = int(worker.split(":")[0][4:])
            by_cell[cell] = by_cell.get(cell, 0) + 1
        rewards = [g.mean_reward() for g in summary.groups]
        loss = loss_sum / summary.n_executions
        report = StepReport(
            step,
            version,
            final,
            len(summary.groups),
            summary.n_executions,
            summary.n_trainable_tokens,
            by_cell,
            summary.reclaimed,
            summary.reopened,
            norm,
            loss,
            mean_of(rewards),
            summary.max_staleness,
            [c for c, _ in members],
            [g.group_id for g in summary.groups],
            t_update - t_compute,
            self.clock.now() - t_update,
            self.worker.compute_s,
            self.worker.n_tokens,
            peaks,
        )
        log.info(
            "step %d v%d->v%d: %d groups, micro-steps by cell %s, |g|=%.4f",
            step,
            version,
            self.version,
            report.n_groups,
            by_cell,
            norm,
        )
        return report

    def _broadcast_update(self, step: int, members: list[tuple[int, str]]) -> None:
        group = [(0, "core"), *members]
        self.coordinator.post_outcome(
            step, {"next": "continue", "version": self.version, "members": group}
        )
        if not members:
            return
        flat = self.full_params()
        try:
            pg = self.registry.prefix(group)
            BroadcastTransport(self.registry, pg).publish(self.version, flat)
        except CommError:
            log.exception("parameter broadcast to %s failed; they will pull again", members)
            self.registry.forget(GroupRegistry.prefix_key(group))
            self.coordinator.mark_stale([c for c, _ in members])

    def publish(self) -> None:
        """Hand the current version to every engine-facing publisher; a single streaming
        publisher (``FilePublisher``) gets the parameters one at a time, never a full copy."""
        if len(self.publishers) == 1 and hasattr(self.publishers[0], "publish_stream"):
            self.publishers[0].publish_stream(self.version, self.stream_params())
        else:
            flat = self.full_params()
            for pub in self.publishers:
                pub.publish(self.version, flat)
        log.info("published v%d to %d publishers", self.version, len(self.publishers))

    def full_params(self) -> torch.Tensor:
        """The full parameters as a CPU float32 vector (the wire format of every transport); on
        a sharded core every rank gathers them with rank 0, one parameter at a time."""
        if self.sharded is not None:
            return self.sharded.gather_params()
        if self._flat is not None and self.layout.is_bound(self.model, self._flat):
            # the weights themselves on the CPU (they change only at the update, after every
            # reader of this step's snapshot is done), one copy from a GPU
            return self._flat if self._flat.device.type == "cpu" else self._flat.cpu()
        return self.layout.params_to_flat(self.model)

    def stream_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full parameter) in layout order, one at a time (drain it: on a sharded core
        every rank gathers along)."""
        if self.sharded is not None:
            return self.sharded.stream_params()
        named = dict(self.model.named_parameters())
        return ((n, named[n].detach()) for n in self.layout.names)

    def state_dict(self) -> dict[str, object]:
        """Everything a resumed core needs: weights, optimizer state, version, step counter;
        every tensor on the CPU (a checkpoint written on a GPU loads anywhere). A sharded core
        gathers nothing: ``"dcp"`` is a writer that has every rank write its own shards into
        the checkpoint's directory (``torch.distributed.checkpoint``) and returns the JSON rest
        (the optimizer's param_groups); call it between steps."""
        if self.sharded is not None:
            cell = self.sharded
            return {
                "dcp": lambda path: {"param_groups": cell.save_dcp(str(path))},
                "version": self.version,
                "step": self._step,
            }
        return {
            "model": _to_cpu(self.model.state_dict()),
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "version": self.version,
            "step": self._step,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore ``state_dict()`` output (between steps, before any satellite joins); tensors
        are copied onto the model's device (the optimizer casts its state to its parameters').
        Sharded state (``"dcp"``: its directory) loads into a sharded core of any rank count;
        a full state loads into either kind of core."""
        if "dcp" in state:
            if self.sharded is None:
                raise ConfigError(
                    "runtime.fsdp",
                    f"{state['dcp']} holds the state of a sharded "
                    "(FSDP2) core: resume with runtime.fsdp on (any "
                    "runtime.fsdp_ranks)",
                )
            try:
                self.sharded.load_dcp(str(state["dcp"]), state["param_groups"])  # type: ignore[arg-type]
            except TidalError as exc:
                raise ConfigError("--resume", str(exc)) from None
        elif self.sharded is not None:
            self.sharded.load_full_state(state["model"], state["optimizer"])  # type: ignore[arg-type]
        else:
            self.model.load_state_dict(state["model"])  # type: ignore[arg-type] (copies in)
            self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
        self.version, self._step = int(state["version"]), int(state["step"])  # type: ignore[call-overload]

    # -- device memory --------------------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        return self._offloaded

    def offload(self) -> None:
        """Between steps: model and optimizer state to CPU memory, device cache released (cell
        0 serves rollout on this GPU meanwhile). A no-op on the CPU."""
        with self._memory_lock:
            if self.device.type == "cpu" or self._offloaded:
                return
            if self.sharded is not None:
                raise TidalError(
                    "trainer.shard: a sharded core cannot be offloaded while its "
                    "cell serves rollout; run it without shard on a shared GPU"
                )
            self._move(torch.device("cpu"))
            self.worker.release()
            self._offloaded = True
        release_cached(self.device)
        log.info("core trainer offloaded to CPU memory")

    def onload(self) -> None:
        """Undo ``offload``: the same values back on the trainer's device."""
        with self._memory_lock:
            if not self._offloaded:
                return
            self._move(self.device)
            self._offloaded = False
        log.info("core trainer restored on %s", self.device)

    def _move(self, device: torch.device) -> None:
        # ``.data`` in place: the Parameter objects the optimizer holds stay the module's.
        # Off the GPU through pinned buffers kept between offloads (``HostStash``).
        stash = self._stash
        move = functools.partial(stash.move, device=device)  # move(key, tensor)
        with torch.no_grad():
            for name, t in self.model.named_buffers():
                t.data = move(f"buffer.{name}", t.data)
            if self._flat is not None:  # one copy of the vector, the views rebound to it
                self._flat = self.layout.bind(self.model, move("flat", self._flat))
            else:
                for name, t in self.model.named_parameters():
                    t.data = move(f"param.{name}", t.data)
            for i, state in enumerate(self.optimizer.state.values()):
                for key, value in state.items():
                    # AdamW keeps its non-capturable ``step`` counter on the CPU wherever it runs
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = move(f"optimizer.{i}.{key}", value)
        stash.settle()
        if self.worker.reference is not None:
            self.worker.reference.to(device)

    def close(self) -> None:
        if self.sharded is not None:
            stop_cell(self.sharded, self._cell_procs)
            self.sharded = None
        self.coordinator.shutdown()
        self.rpc.close()
        if self._snap_shm is not None:
            self._snap_shm.close()
        self.registry.close()


def _to_cpu(obj: object) -> object:
    """``obj`` with every tensor in its dicts and lists on the CPU (CPU tensors as they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        out = type(obj)((k, _to_cpu(v)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):  # a module state dict's version record
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj
