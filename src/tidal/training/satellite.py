"""A satellite cell's training loop (runs in its own process; cells 1..K-1).

In: the core's address (RPC port, store port, auth key) and a ``ModelSpec`` to build the same
architecture. Per step: join (in cell order) -> pull snapshot v if it does not hold v -> claim,
compute, complete micro-steps until the batch is drained (waiting at a consistent point when
data pauses) -> deliver its gradient sum and counts over its link -> wait for the update: after a
non-final update receive the new parameters over the prefix group and continue; after the final
update leave. The process lives for the run: when its cell leaves training (the core's
coordinator says ``park``: at a join, at a claim, or after its delivery) it drops its gradient
buffers, moves the model off the device and waits in ``park``, keeping its model, the version it
holds and its link group; back in training it pulls only a version it does not hold. Out:
gradient contributions; never an optimizer step (invariant 5: only the core
holds optimizer state; weights change only between steps, by a pull or a broadcast).
The model (and the KL reference) run on ``SatelliteConfig.device``; pulled vectors arrive on the
CPU and are copied in, and the gradient sum goes back as a CPU copy (gloo sends CPU tensors).
With ``shard`` the cell is k FSDP2 ranks (``cell_ranks``): this process is rank 0, pulled vectors
are loaded into every rank's shards and the delivered sum is gathered from them; the wire format
to the core is the same full vector, so cells of different rank counts work together.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any

import torch
from torch import nn

from tidal import malloc
from tidal.contracts.trainer import GRPOLossConfig, ModelSpec, SatelliteConfig
from tidal.models.device import HostStash, release_cached, resolve_device
from tidal.training.cell_ranks import start_cell, stop_cell
from tidal.training.flat import ParamLayout
from tidal.training.groups import GroupRegistry
from tidal.training.rpc import RpcClient
from tidal.training.transport import BroadcastTransport, SharedMemoryTransport
from tidal.training.worker import GradientWorker, ShardedWorker

log = logging.getLogger(__name__)

PARK_WAIT_S = 30.0  # one ``park`` call's bound; a parked satellite calls again


def build_model(spec: ModelSpec) -> nn.Module:
    """The policy ``spec`` names, built the way the core builds its own."""
    from tidal.models import load_training_model

    return load_training_model(spec.model_dir)


class Satellite:
    def __init__(self, config: SatelliteConfig) -> None:
        self.config = config
        self.incarnation = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.device = resolve_device(config.device)
        model = build_model(config.model)
        self.layout = ParamLayout.of(model)
        self.version = -1
        self._flat = torch.empty(0)  # where pulls land: the weights themselves on the CPU
        self.client = RpcClient((config.host, config.rpc_port), bytes.fromhex(config.authkey))
        hello = self.client.call(
            "hello",
            cell=config.cell,
            incarnation=self.incarnation,
            fingerprint=self.layout.fingerprint(),
        )
        # The loss is the core's, never a local copy: the invariance of the update depends on it.
        loss = GRPOLossConfig.model_validate(hello["loss"])
        reference = (
            build_model(config.reference).to(self.device).eval() if config.reference else None
        )
        if loss.kl_coef > 0 and reference is None:
            raise ValueError(
                f"cell {config.cell}: the core's loss has a KL term; "
                "SatelliteConfig.reference is required"
            )
        self.sharded, self._cell_procs = None, []
        if config.shard is not None and config.shard.fsdp:
            if reference is not None:
                raise ValueError(
                    f"cell {config.cell}: shard: a KL reference model is not "
                    "supported on a sharded cell"
                )
            # the cell's ranks are processes of this node: their store is on loopback (the
            # core's address, ``config.host``, may be another node's)
            self.sharded, self._cell_procs = start_cell(
                model, self.device, config.shard, loss, hello["pad_id"], None, "127.0.0.1"
            )
            self.model = self.sharded.model
            self.worker: GradientWorker | ShardedWorker = ShardedWorker(config.cell, self.sharded)
        else:
            self.model = model.to(self.device)
            self.worker = GradientWorker(config.cell, self.model, loss, reference, hello["pad_id"])
            if self.device.type == "cpu" and all(  # one copy of the weights: pulls load in place
                p.dtype == torch.float32 for p in self.model.parameters()
            ):
                self._flat = self.layout.bind(self.model)
        if self._flat.numel() == 0:  # gloo receives on the CPU, then copied in
            self._flat = torch.empty(self.layout.numel, dtype=torch.float32)
        self.offloaded = False
        self._stash = HostStash()  # pinned host buffers kept between offloads
        self.registry = GroupRegistry(
            config.cell,
            config.host,
            config.store_port,
            self.incarnation,
            config.backend,
            config.timeout_s,
        )
        self.client.call_with("link", lambda: self.registry.link(config.cell, self.incarnation))
        self.shm: SharedMemoryTransport | None = None
        if hello["shm_name"]:
            self.shm = SharedMemoryTransport(hello["shm_name"], self.layout, create=False)

    @property
    def link(self):
        return self.registry.link(self.config.cell, self.incarnation)

    def _pull(self, version: int) -> None:
        if self.shm is not None:
            got = self.shm.pull(self._flat, version, self.config.timeout_s)
        else:
            reader = BroadcastTransport(self.registry, self.link)
            _, got = self.client.call_with("pull", lambda: reader.pull(self._flat, version))
        if got != version:
            raise RuntimeError(f"cell {self.config.cell}: pulled v{got}, step trains v{version}")
        self._load_flat()
        self.version = version
        self.client.call("pulled", version=version)

    def _load_flat(self) -> None:
        """The pulled full vector into the model (into every rank's shards on a sharded cell;
        nothing to copy where the model's weights are the pulled vector)."""
        if self.sharded is not None:
            self.sharded.load_params(self._flat)
        elif not self.layout.is_bound(self.model, self._flat):
            self.layout.flat_to_params_(self.model, self._flat)

    def run_step(self, join: dict[str, Any]) -> dict[str, Any]:
        step, version = join["step"], join["version"]
        if join["pull"] or self.version != version:
            self._pull(version)
        self.worker.reset()
        while True:
            claim = self.client.call("claim", timeout_s=self.config.timeout_s)
            if claim["kind"] == "drained":
                break
            if claim["kind"] == "wait":
                continue
            ms = claim["micro_step"]
            self.worker.compute(ms)
            done = self.client.call("complete", batch_id=ms.batch_id, index=ms.index)
            if done["accepted"]:
                self.worker.commit()
            else:
                self.worker.discard()
        self.client.call("deliver_begin", step=step)
        grad = self.worker.cpu_grad_sum()
        self.client.call_with(
            "deliver",
            lambda: self.registry.broadcast(self.link, grad, 1),
            counts=self.worker.counts(),
        )
        outcome = self.client.call("await_update", step=step, timeout_s=self.config.timeout_s * 3)
        if outcome["next"] == "continue" and self.config.cell in [m[0] for m in outcome["members"]]:
            members = [tuple(m) for m in outcome["members"]]
            pg = self.registry.prefix(members)
            got = BroadcastTransport(self.registry, pg).pull(self._flat, outcome["version"])
            self._load_flat()
            self.version = got
        log.info(
            "cell %d: step %d done (%d micro-steps), next=%s",
            self.config.cell,
            step,
            self.worker.n_micro_steps,
            outcome["next"],
        )
        return outcome

    def park(self) -> str:
        """Between training stints (the cell serves rollout): the model leaves the device,
        the gradient buffers are dropped, and the process waits in the core's ``park`` (its
        groups and the weights it holds kept) until the cell trains again; returns ``join``
        or ``shutdown``."""
        self.offload()
        log.info("cell %d: parked (holds v%d)", self.config.cell, self.version)
        while True:
            reply = self.client.call(
                "park", wait_s=PARK_WAIT_S, timeout_s=PARK_WAIT_S + self.config.timeout_s
            )
            if reply["next"] != "park":
                break
        if reply["next"] == "join":
            self.onload()
            log.info("cell %d: back in training", self.config.cell)
        return reply["next"]

    def offload(self) -> None:
        """The model in CPU memory (pinned buffers kept between offloads), the device's cache
        released (a no-op on the CPU beyond dropping the gradient sum)."""
        self.worker.release()
        if self.device.type != "cpu" and self.sharded is None and not self.offloaded:
            self._move(torch.device("cpu"))
            if self.worker.reference is not None:
                self.worker.reference.to("cpu")
            release_cached(self.device)
            self.offloaded = True

    def onload(self) -> None:
        if self.offloaded:
            self._move(self.device)
            if self.worker.reference is not None:
                self.worker.reference.to(self.device)
            self.offloaded = False

    def _move(self, device: torch.device) -> None:
        stash = self._stash
        with torch.no_grad():
            for kind, named in (
                ("buffer", self.model.named_buffers()),
                ("param", self.model.named_parameters()),
            ):
                for name, t in named:
                    t.data = stash.move(f"{kind}.{name}", t.data, device)
        stash.settle()

    def run(self) -> int:
        steps = 0
        while self.config.max_steps is None or steps < self.config.max_steps:
            join = self.client.call("join", timeout_s=self.config.timeout_s * 2)
            if join["next"] == "park":
                if self.park() == "shutdown":
                    break
                continue
            if join["next"] == "shutdown":
                break
            self.run_step(join)
            steps += 1
        self.client.call("bye")
        self.client.close()
        if self.sharded is not None:
            stop_cell(self.sharded, self._cell_procs)
        return steps


def run_satellite(config_json: str) -> None:
    """Process entry point (``multiprocessing`` spawn target or ``python -m``)."""
    malloc.tune()  # freed gradients and activations go back to the system
    config = SatelliteConfig.model_validate_json(config_json)
    torch.set_num_threads(config.torch_threads)
    logging.basicConfig(
        level=os.environ.get("TIDAL_LOG", "WARNING"),
        format=f"%(asctime)s cell{config.cell} %(levelname)s %(name)s: %(message)s",
    )
    if config.start_delay_s:
        time.sleep(config.start_delay_s)
    Satellite(config).run()


if __name__ == "__main__":
    import sys

    run_satellite(sys.argv[1])
