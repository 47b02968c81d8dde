"""The parts of a run, built in one place and wired through narrow interfaces.

In: the run config, the run directory, a checkpoint (resume) or None, the started engines and
proxy, the run's ``Parts`` (task owner). Out: ``Wired``: the trajectory buffer and core trainer,
the Ray actuator, the controller (real ``tidal.control`` objects on the wall clock) and its
guarded ``handle`` (every event goes through it: a failure stops the run with its cause), the
harness bridge, the publisher, the trainer loop, the cell supervisor, the dispatcher, the run
outputs and the decode meter (the proxy's counts for the controller's observations). The run's
``task:`` section (``tidal.agents.workload``: the user's rows, agent kind and reward) is checked
with the config and handed to the dispatcher. Data flow: dispatcher ->
harness pool -> proxy -> engines; ledger callbacks -> bridge ->
controller -> plans -> actuator; closed executions -> bridge -> buffer -> trainer loop ->
publisher -> engines. A resumed run's trainer, weights and metrics are restored here.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import httpx

from tidal.backends import configured_backends, engine_backend, load, published_dtype
from tidal.clock import Clock, await_until
from tidal.config import RunConfig
from tidal.control.carry_over import max_policy_lag
from tidal.errors import ConfigError
from tidal.runtime import deterministic
from tidal.runtime.actuator import CoreLink, RayActuator, Weights
from tidal.runtime.bridge import LedgerBridge
from tidal.runtime.cell import trainer_device
from tidal.runtime.checkpoint import Checkpoint
from tidal.runtime.control_plane import ControlPlane
from tidal.runtime.decode_meter import DecodeMeter
from tidal.runtime.dispatcher import Dispatcher
from tidal.runtime.engines import EngineId, Engines
from tidal.runtime.outputs import RunOutputs, merge_counts
from tidal.runtime.publisher import Publisher
from tidal.runtime.supervisor import CellSupervisor
from tidal.runtime.tasks import Parts
from tidal.runtime.trainer_loop import TrainerLoop

if TYPE_CHECKING:
    from tidal.agents.workload import Workload
    from tidal.contracts.trainer import ShardConfig
    from tidal.control.controller import Controller
    from tidal.control.policy import Policy
    from tidal.serving.proxy_set import ProxySet
    from tidal.training.core import CoreTrainer, TrainerConfig
    from tidal.training.trajectory_buffer import TrajectoryBuffer
    from tidal.types import Event

log = logging.getLogger(__name__)


def check_config(cfg: RunConfig) -> Workload:
    """What ``tidal run`` refuses before it starts anything (one line naming the field). Out:
    the ``task:`` section's workload, built (its rows loaded, its code imported) once."""
    deterministic.check(cfg)  # what runtime.deterministic cannot make token-identical
    c = cfg.control
    if c.bursts is None:
        raise ConfigError("control.bursts", "tidal run needs a number of bursts")
    if c.quota_groups is not None and c.quota_groups != c.batch_groups * c.updates_per_burst:
        raise ConfigError(
            "control.quota_groups",
            "this runtime trains every dispatched group: "
            "quota_groups must equal batch_groups * updates_per_burst",
        )
    if c.staleness > 0 and (cfg.runtime.checkpoint_every_steps or cfg.runtime.deterministic):
        raise ConfigError(
            "control.staleness_threshold",
            "carried groups are not checkpointed and have no fixed training order yet: "
            "a staleness budget needs runtime.checkpoint_every_steps 0 and "
            "runtime.deterministic off",
        )
    if cfg.policy.args.get("rebalance"):
        raise ConfigError(
            "policy.args.rebalance",
            "verl's rebalance (abort every in-flight "
            "request to re-spread load) is not supported by the runtime",
        )
    for backend in configured_backends(cfg):  # e.g. 'sglang' cells: GPUs, SGLang's python
        if backend.check is not None:
            load(backend.check)(cfg)
    from tidal.agents.workload import check_workload

    workload = check_workload(cfg)  # the task: section's rows, agent and reward
    rt = cfg.runtime
    standalone = engine_backend(rt.standalone_backend)
    if rt.cell_cpus is not None:
        for bad, why in (
            (rt.ray_address, "joins a Ray cluster (the quota is per host)"),
            (rt.use_gpus, "uses GPUs (cells already own their devices)"),
            (
                standalone.server,
                f"serves standalone engines with "
                f"{standalone.label} (the quota covers built-in engines)",
            ),
        ):
            if bad:
                raise ConfigError("runtime.cell_cpus", f"not supported when the run {why}")
    return workload


@dataclass
class Wired:
    admin: httpx.AsyncClient
    decisions: IO[str]
    buffer: TrajectoryBuffer
    core: CoreTrainer
    outputs: RunOutputs
    actuator: RayActuator
    ctl: Controller
    handle: Callable[[Event], None]
    bridge: LedgerBridge
    publisher: Publisher
    trainer: TrainerLoop
    supervisor: CellSupervisor
    dispatcher: Dispatcher
    clock: Clock
    meter: DecodeMeter  # the proxy's decode counts for the controller (``ctl.decode_meter``)
    plane: ControlPlane  # the control plane's own costs (summary.json: control_plane)
    proxy_queued: int | None = None  # calls waiting at the proxy for a slot (None: unknown)

    def state(self) -> dict[str, Any]:
        """What the live display shows (read on the loop; cheap)."""
        lg, m = self.ctl.ledger, self.outputs.metrics
        return {
            "burst": self.bridge.burst,
            "step": len(m),
            "version": self.publisher.weights.version,
            "reward": m[-1]["mean_reward"] if m else None,
            "waterlevel": lg.waterlevel,
            "queued": lg.total.queued,
            "running": lg.total.running,
            "ready_groups": lg.ready_unassigned,
            "roles": [r.value for r in self.ctl.cells.roles()],
            "switches": len(self.ctl.plans_done),
            "replaced": len(self.supervisor.replaced),
            "closed": sum(self.bridge.close_counts.values()),
            "proxy_queued": self.proxy_queued,
        }

    async def probe_proxy_queue(self, every_s: float) -> None:
        """Forever: the proxy's admission queue (its ``/health``) for the live state; the
        state sampler never waits on the proxy."""
        while True:
            try:
                self.proxy_queued = (
                    (await self.admin.get("/health", timeout=2.0)).json().get("queued")
                )
            except (httpx.HTTPError, ValueError):
                self.proxy_queued = None
            await self.clock.asleep(every_s)

    async def satellites_up(self, timeout_s: float) -> None:
        """Cells that train from the start (e.g. ``static``) begin the run with their
        satellites connected (bounded wait), so the first steps can use them."""
        want = set(self.actuator.satellite_pids)
        await await_until(
            self.clock,
            lambda: want <= set(self.core.coordinator.registered()),
            timeout_s,
            f"satellites of cells {sorted(want)} connected (see logs/satellite-c*.log)",
            every_s=0.1,
        )

    async def settle(self, timeout_s: float) -> None:
        """Bounded wait until no transition plan is in flight (the run ends in a known
        state: every engine either serving or asleep with its cell training)."""
        await await_until(
            self.clock,
            lambda: self.ctl.inflight is None and not self.supervisor.busy,
            timeout_s,
            "every transition plan and cell replacement done after the last step",
        )

    async def close(self) -> None:
        from tidal.agents.pool import HarnessPool

        HarnessPool.end_all()  # no agent program or Python worker outlives the run
        self.buffer.close()
        self.core.close()
        if self.publisher.handoff is not None:  # the segments in shared memory
            self.publisher.handoff.writer.close()
        await self.admin.aclose()
        self.decisions.close()
        self.outputs.write_steps(self.actuator.step_log)


def _core(
    cfg: RunConfig,
    out: Path,
    model_dir: Path,
    clock: Clock,
    gpu_ids: list[int],
    host: str = "127.0.0.1",
):
    """The trajectory buffer, the core trainer and the file publisher it writes versions to;
    ``host``: the driver node's address, where satellites of other nodes reach the core."""
    if cfg.runtime.emulate is not None:  # an emulated run: the scenario's trainer, timed
        from tidal.training.emulated import emulated_core

        return emulated_core(cfg, out, clock)
    import torch

    from tidal.contracts.trainer import ShardConfig
    from tidal.models import HFTokenizer, load_training_model
    from tidal.training.core import CoreTrainer
    from tidal.training.flat import ParamLayout
    from tidal.training.trajectory_buffer import TrajectoryBuffer, TrajectoryBufferConfig
    from tidal.training.transport import FilePublisher

    rt, c = cfg.runtime, cfg.control
    buffer = TrajectoryBuffer(
        TrajectoryBufferConfig(
            group_size=c.group_size,
            max_policy_lag=max_policy_lag(c.updates_per_burst, c.staleness),
            ordered=rt.deterministic,
        ),
        clock,
    )
    model = load_training_model(model_dir)  # transformers: any architecture
    tok = HFTokenizer(model_dir)
    device = trainer_device(
        rt.resolved_device(torch.cuda.is_available()),
        gpu_ids,
        os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
    # in bfloat16 when every engine serves in it (half the bytes each version; vLLM on GPUs)
    from tidal.runtime.handoff import version_writer

    files = FilePublisher(
        out / "weights", ParamLayout.of(model), keep=2, dtype=getattr(torch, published_dtype(cfg))
    )
    files = version_writer(files, out)  # a shared-memory segment per version, the file after
    if rt.fsdp == "on" and torch.device(device).type != "cpu":
        raise ConfigError(
            "runtime.fsdp",
            "'on' needs a CPU trainer (a sharded core cannot "
            "be offloaded while cell 0 serves); use 'auto'",
        )
    # a cell's ranks join within the run's start-up bound (``runtime.start_timeout_s``)
    # FSDP2 where there is something to shard: 'auto' with more than one rank per cell (one
    # rank holds everything anyway, and FSDP2's buffers cost the demo's core 3.5 GB), 'on' always
    sharded = rt.fsdp == "on" or (rt.fsdp == "auto" and rt.fsdp_ranks > 1)
    shard = (
        ShardConfig(ranks=rt.fsdp_ranks, join_timeout_s=rt.start_timeout_s)
        if sharded and device == "cpu"
        else None
    )
    if shard is None and rt.fsdp_ranks > 1:
        raise ConfigError(
            "runtime.fsdp_ranks",
            "more than one rank per cell needs FSDP2 (runtime.fsdp on a CPU trainer)",
        )
    core = CoreTrainer(
        model,
        trainer_config(cfg, device, shard, host),
        buffer,
        clock,
        publishers=[files],
        pad_id=tok.eos_id,
    )
    files.restream = core.stream_params
    return buffer, core, files


def trainer_config(
    cfg: RunConfig, device: str, shard: ShardConfig | None, host: str
) -> TrainerConfig:
    """The core trainer's settings from the run's config (its bounds are the runtime's)."""
    from tidal.training.coordinator import CoordinatorConfig
    from tidal.training.core import TrainerConfig
    from tidal.training.packing import PackingConfig

    rt, c = cfg.runtime, cfg.control
    return TrainerConfig(
        lr=rt.lr,
        groups_per_step=c.batch_groups,
        step_data_timeout_s=rt.step_data_timeout_s,
        packing=PackingConfig(token_budget=rt.token_budget),
        device=device,
        coordinator=CoordinatorConfig(
            join_timeout_s=rt.satellite_timeout_s,
            gather_timeout_s=rt.satellite_gather_timeout_s,
        ),
        shard=shard,
        host=host,
    )


def wire(
    cfg: RunConfig,
    out: Path,
    ck: Checkpoint | None,
    clock: Clock,
    parts: Parts,
    engines: Engines,
    proxy_url: str,
    token: str,
    core_pool: concurrent.futures.ThreadPoolExecutor,
    outputs: RunOutputs,
    host: str = "127.0.0.1",
    workload: Workload | None = None,
    policy: Policy | None = None,
    proxies: ProxySet | None = None,
) -> Wired:
    """``workload``: the one ``check_config`` built (None: built here); ``proxies``: the run's
    proxy processes (several: executions partitioned by id, ``serving.proxy_set``)."""
    from tidal.agents.pool import HarnessPool, PoolConfig
    from tidal.agents.workload import Workload
    from tidal.control.decision_log import DecisionLog, jsonl_file_sink
    from tidal.control.factory import build_controller

    rt, c = cfg.runtime, cfg.control
    buffer, core, files = _core(
        cfg, out, engines.model_dir, clock, engines.gpu_ids.get(EngineId.cell(0), []), host
    )
    from tidal.serving.shared_http import Sharded

    # the admin calls (a record per execution) over several pools, never one (docs/scale.md)
    fan_out = (proxies.transport() if proxies is not None else None) or Sharded()
    admin = httpx.AsyncClient(
        base_url=proxy_url,
        timeout=300.0,
        headers={"Authorization": f"Bearer {token}"},
        transport=fan_out,
    )
    decisions = open(out / "decisions.jsonl", outputs.mode)  # noqa: SIM115 - Wired.close
    if ck is not None:
        core.load_state_dict(ck.trainer)
    if core.device.type == "cuda":  # cell 0's engine holds the GPU until it trains
        core.offload()
    # deterministic: the core computes every micro-step (a satellite's share of the gradient
    # sum would depend on claim order, and so the sum's last bits)
    if rt.deterministic and rt.satellites:
        log.info("runtime.deterministic: no satellites; the core computes every micro-step")
    link = CoreLink(
        core.address() if rt.satellites and not rt.deterministic else None,
        core if core.device.type == "cuda" else None,
        rt.satellite_timeout_s,
        core.coordinator.expect_departure,
        core.coordinator,
    )
    weights = Weights()
    actuator = RayActuator(clock, admin, engines, weights, c.kv_handoff, parts, link)
    if rt.emulate is not None:  # the emulated core trains at the rate of the cells training
        core.bind(lambda: actuator.training)
    ctl = build_controller(
        cfg,
        clock,
        actuator,
        DecisionLog(outputs.since_first_dispatch(jsonl_file_sink(decisions)), keep=False),
        policy,
    )
    ctl.metrics.budget_groups = c.batch_groups * c.updates_per_burst  # per burst
    plane = ControlPlane(
        lambda: ctl.ledger.total.queued + ctl.ledger.total.running,
        lambda: {
            "ledger_execution": (ctl.ledger.executions, len(ctl.ledger.executions)),
            "buffer_trajectory": (buffer, len(buffer)),
        },
    )
    guarded, listeners = plane.timed(parts.guard_handler(ctl.handle)), []

    def handle(event: Event) -> None:  # then wake whoever waits on the ledger or the policy
        guarded(event)
        for wake in listeners:
            wake()

    actuator.bind(handle)
    bridge = LedgerBridge(
        handle, clock, admin, buffer, c.group_size, parts, tokens=rt.deterministic
    )
    from tidal.runtime.handoff import Handoff, core_ipc_source, core_placement

    publisher = Publisher(
        engines,
        actuator,
        admin,
        weights,
        files.path,
        handle,
        clock,
        # an emulated version is a marker the engines load in the scenario's time
        handoff=None if rt.emulate else Handoff(engines, files, rt.weight_carrier, host=host),
    )
    if publisher.handoff is not None:  # cell 0's engine on the core's GPU: CUDA IPC first
        publisher.handoff.same_device = core_placement(engines, str(core.device))
        publisher.handoff.ipc_source = core_ipc_source(core)
    # executions.jsonl line by line as groups end (a killed run keeps what it closed)
    bridge.file, bridge.t0 = outputs.executions, lambda: outputs.t0
    if ck is not None:
        publisher.restore(ck.state.published_version, ck.state.published_path)
        outputs.restore_metrics(ck.state.metrics_lines)
        outputs.executions.restore(ck.state.execution_lines)
    carried = dict(ck.state.close_reasons) if ck else {}
    trainer = TrainerLoop(
        cfg,
        core,
        buffer,
        actuator,
        publisher,
        outputs,
        ctl,
        handle,
        clock,
        core_pool,
        ck,
        lambda: merge_counts(carried, bridge.close_counts),
    )
    cl = cfg.cluster
    slots = cl.standalone_count * cl.standalone_slots + sum(s.slots for s in cl.cell_specs())
    pool = HarnessPool(
        PoolConfig(
            proxy_url=proxy_url,
            max_concurrent=slots,
            max_turns=cfg.task.max_turns,
            max_tokens_per_turn=rt.max_tokens,
            temperature=rt.temperature,
            timeout_s=rt.execution_timeout_s,
            token=token,
            proxy_urls=proxies.urls if proxies is not None else [],
        ),
        out / "workspaces",
        bridge,
        proxies.transport(keep_open=True) if proxies is not None else None,
    )
    held = {r.execution_id: r for r in ck.records} if ck else {}
    gate = (
        deterministic.Boundaries(clock, admin, engines, buffer, rt.start_timeout_s)
        if rt.deterministic
        else None
    )
    dispatcher = Dispatcher(
        cfg,
        pool,
        bridge,
        handle,
        clock,
        parts,
        set(trainer.trained_groups),
        held,
        ctl,
        workload or Workload(cfg),
        gate,
    )
    listeners.append(dispatcher.notify)  # a group held by the policy looks again
    trainer.settled = dispatcher.settled  # a step short of groups that cannot come goes on
    return Wired(
        admin,
        decisions,
        buffer,
        core,
        outputs,
        actuator,
        ctl,
        handle,
        bridge,
        publisher,
        trainer,
        CellSupervisor(engines, actuator, admin, weights, clock, rt.start_timeout_s),
        dispatcher,
        clock,
        DecodeMeter(admin, ctl, clock),
        plane,
    )
