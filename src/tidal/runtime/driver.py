"""The driver of ``tidal run``: wires the real parts together and runs bursts to the end.

In: a validated ``RunConfig`` and a run directory. Out: in the run directory ``config.yaml``
(resolved), ``metrics.jsonl`` (one line per optimizer step; the final step of a burst also
carries verl's ``dynamic_resource/*`` metrics of that weight version), ``decisions.jsonl`` (every
scheduling decision and plan record of the controller), ``steps.jsonl`` (every plan step the
actuator ran, with its duration), ``state.jsonl`` (a sample of the live state every
``runtime.state_every_s``: time since the first dispatch, waterlevel, queue, running, ready
groups, roles), ``timeline.json`` (per cell, the ``[start_s, end_s, role]`` segments, in seconds
since the first dispatch), ``executions.jsonl`` (per execution: times, and per model call its
tokens and timings; ``tidal calibrate`` fits the simulator on it) and ``summary.json``; engine
and proxy logs under ``logs/``.

Data flow: dispatcher (one quota per burst) -> harness pool -> proxy (a process) -> engines
(processes owned by Ray actors: standalone engines and cells) ; ledger callbacks -> controller
(real ``tidal.control`` objects on the wall clock) -> plans -> ``RayActuator`` ; closed executions
-> proxy records -> trajectory buffer -> ``CoreTrainer`` (in the driver, active only while cell 0
holds the training role; the other training cells run satellite processes that join its steps, pull
its weights and claim micro-steps) -> ``FilePublisher`` -> engines load the new version in place.
Everything runs on one asyncio loop; blocking work (optimizer steps, Ray calls) is awaited off the
loop, so controller events are handled in order on one thread.
Devices (``runtime.device``): each cell actor puts its engine and satellite on its own GPU; the
core trainer runs on cell 0's GPU and is offloaded to CPU memory whenever cell 0 serves.
CPU quota (``runtime.cell_cpus``, ``cpuquota``): one cgroup per cell and standalone engine; the
actors and their processes join theirs, the core trainer computes on one thread in cell 0's; the
summary adds the seconds each group was throttled."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import random
import secrets
import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from tidal.clock import WallClock
from tidal.config import RunConfig, dump_yaml
from tidal.errors import ConfigError, TimeoutExpired
from tidal.runtime import checkpoint, vllm_host
from tidal.runtime.actuator import RayActuator, Weights
from tidal.runtime.bridge import LedgerBridge
from tidal.runtime.cell import EngineHost, RuntimeFailure, trainer_device
from tidal.runtime.placement import Placement
from tidal.runtime.supervisor import CellSupervisor
from tidal.types import (
    BurstStarted,
    GroupsAssigned,
    Role,
    Tick,
    TrainerReady,
    TrainerStepDone,
    WeightSyncDone,
)

log = logging.getLogger(__name__)


def _check(cfg: RunConfig) -> None:
    c = cfg.control
    if c.bursts is None:
        raise ConfigError("control.bursts", "tidal run needs a number of bursts")
    if c.quota_groups is not None and c.quota_groups != c.batch_groups * c.updates_per_burst:
        raise ConfigError("control.quota_groups", "this runtime trains every dispatched group: "
                          "quota_groups must equal batch_groups * updates_per_burst")
    if cfg.policy.args.get("rebalance"):
        raise ConfigError("policy.args.rebalance", "verl's rebalance (abort every in-flight "
                          "request to re-spread load) is not supported by the runtime")
    if cfg.runtime.standalone_backend == "vllm":
        vllm_host.check(cfg)
    rt = cfg.runtime
    if rt.cell_cpus is not None:
        for bad, why in ((rt.ray_address, "joins a Ray cluster (the quota is per host)"),
                         (rt.use_gpus, "uses GPUs (cells already own their devices)"),
                         (rt.standalone_backend == "vllm", "serves standalone engines with "
                          "vLLM (the quota covers built-in engines)")):
            if bad:
                raise ConfigError("runtime.cell_cpus", f"not supported when the run {why}")



def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _trap_sigterm() -> Any:
    """Turn SIGTERM into KeyboardInterrupt (main thread only); returns the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _interrupt)

class Runtime:
    def __init__(self, cfg: RunConfig, out: str | Path,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 on_state: Callable[[dict[str, Any]], None] | None = None,
                 resume: bool = False) -> None:
        _check(cfg)
        self.cfg, self.out, self.on_step, self.on_state = cfg, Path(out), on_step, on_state
        self.rt = cfg.runtime
        self.clock = WallClock()
        self.token = secrets.token_hex(16)
        self.actors: dict[str, Any] = {}
        self.proxy = None
        self.metrics: list[dict[str, Any]] = []
        self._ray_started = False
        self.cpu_groups = None  # runtime.cell_cpus: one CPU-quota cgroup per cell / engine
        self.cpu_stats: dict[str, dict[str, float]] = {}
        self.core_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.ck = checkpoint.load(self.out) if resume else None
        self.trained_groups: list[str] = list(self.ck.state.trained_groups) if self.ck else []

    # ------------------------------------------------------------------ setup / teardown
    def run(self) -> dict[str, Any]:
        import ray

        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(exist_ok=True)
        if self.ck is None:  # a fresh run: nothing of an earlier run in this directory
            checkpoint.clear(self.out)
            (self.out / "config.yaml").write_text(dump_yaml(self.cfg))
        else:
            checkpoint.end_stale_processes(self.out)
        t0 = time.perf_counter()
        # SIGTERM (kill, a scheduler's stop) ends the run like Ctrl-C: everything this run
        # started is stopped, and the checkpoint lets `tidal run --resume` continue it
        prev = _trap_sigterm()
        try:
            self._start_parts(ray)
            summary = asyncio.run(asyncio.wait_for(self._main(), self.rt.run_timeout_s))
        except TimeoutError:
            raise TimeoutExpired(f"run not finished in runtime.run_timeout_s = "
                                 f"{self.rt.run_timeout_s} s") from None
        finally:
            try:
                self._stop_parts(ray)
            finally:
                if prev is not None:
                    signal.signal(signal.SIGTERM, prev)
        summary["run_time_s"] = round(time.perf_counter() - t0, 2)
        if self.rt.cell_cpus is not None:
            summary["cell_cpus"] = self.rt.cell_cpus
            summary["cpu_throttled_s"] = {k: v["throttled_s"] for k, v in self.cpu_stats.items()}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _start_parts(self, ray) -> None:
        from tidal.models import create_tiny
        from tidal.models.fetch import KNOWN, fetch
        from tidal.serving.launch import start_proxy

        rt = self.rt
        if rt.model == "tiny":
            self.model_dir = create_tiny(self.out / "model", seed=self.cfg.seed,
                                         n_layers=rt.tiny_layers, d_model=rt.tiny_d_model,
                                         n_heads=4, d_ff=4 * rt.tiny_d_model,
                                         max_seq_len=rt.tiny_max_seq_len)
        elif rt.model in KNOWN:  # a bundled pretrained model, converted once (no download)
            self.model_dir = fetch(rt.model)
        else:
            self.model_dir = Path(rt.model)
            if not (self.model_dir / "config.json").is_file():
                raise ConfigError("runtime.model", f"{rt.model}: not 'tiny', a bundled model "
                                  f"({', '.join(KNOWN)}) or a model directory with config.json")
        names = [f"s{j}" for j in range(self.cfg.cluster.standalone_count)]
        names += [f"c{i}" for i in range(len(self.cfg.cluster.cell_specs()))]
        if rt.cell_cpus is not None:  # before Ray and any actor (their processes join it)
            from tidal.runtime.cpuquota import CpuGroups

            self.cpu_groups = CpuGroups(rt.cell_cpus, names)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if not ray.is_initialized():
            if rt.ray_address:
                ray.init(address=rt.ray_address)
            else:
                ray.init(num_cpus=rt.ray_num_cpus, num_gpus=rt.ray_num_gpus,
                         include_dashboard=False, _node_ip_address="127.0.0.1",
                         log_to_driver=False)
            self._ray_started = True
            _trap_sigterm()  # Ray's core worker installs its own (crashing) SIGTERM handler
        self._actor_cls = ray.remote(EngineHost)
        self._vllm = vllm_host.actor_class(ray, self.rt)  # None: built-in standalone engines
        self.placement = Placement(ray, self.cfg, names, rt.start_timeout_s)
        for name in names:
            self.actors[name] = self.new_actor(name)
        self.proxy = start_proxy([], [], self.token, kv_handoff=self.cfg.control.kv_handoff,
                                 log_path=self.out / "logs" / "proxy.log")
        try:
            urls = ray.get([a.start.remote(rt.start_timeout_s) for a in self.actors.values()],
                           timeout=rt.start_timeout_s + 30)
        except ray.exceptions.RayTaskError as exc:  # an engine's own one-line error
            raise (exc.cause if isinstance(exc.cause, RuntimeFailure) else exc) from None
        self.urls = dict(zip(self.actors, urls, strict=True))
        described = ray.get([a.describe.remote() for a in self.actors.values()])
        self.start_pids = {d["name"]: d["pid"] for d in described}
        self.gpu_ids = {d["name"]: d["gpu_ids"] for d in described}
        self.pids = dict(self.start_pids)
        self.proxy.wait_healthy(rt.start_timeout_s)
        checkpoint.record_processes(self.out)

    def new_actor(self, name: str):
        """An engine actor pinned to its reserved bundle (a replacement reuses it)."""
        env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        # Threaded (max_concurrency): a health probe is answered while a long sleep, wake or
        # weight load runs; the actuator never sends one cell two state changes at once.
        engine_device = self.rt.device if self.rt.use_gpus else "cpu"
        groups = self.cpu_groups
        cls, extra = ((self._vllm, [vllm_host.vllm_settings(self.rt)])
                      if self._vllm is not None and name.startswith("s") else
                      (self._actor_cls, [engine_device,
                                         groups.path(name) if groups is not None else None]))
        return cls.options(runtime_env={"env_vars": env}, max_concurrency=4,
                           **self.placement.options(name)).remote(
            name, str(self.model_dir), self.rt.engine_max_batch, str(self.out / "logs"), *extra)

    def join_body(self, name: str, url: str) -> dict[str, Any]:
        cl = self.cfg.cluster
        if name.startswith("s"):
            return {"id": name, "url": url, "kind": "standalone", "cap": cl.standalone_slots,
                    "backend": self.rt.standalone_backend}
        i = int(name[1:])
        return {"id": name, "url": url, "kind": "cell", "cell_index": i,
                "cap": cl.cell_specs()[i].slots}

    def _stop_parts(self, ray) -> None:
        if self.actors:
            try:
                ray.wait([a.stop.remote() for a in self.actors.values()],
                         num_returns=len(self.actors), timeout=60)
            except Exception:
                log.exception("stopping engines")
            pids = list(getattr(self, "pids", {}).values())
            if getattr(self, "actuator", None) is not None:
                pids += list(self.actuator.satellite_pids.values())
            for pid in pids:  # engines and satellites this runtime started
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.proxy is not None:
            self.proxy.stop()
        if getattr(self, "placement", None) is not None:
            self.placement.remove()
        if self._ray_started:
            ray.shutdown()
        if self.core_pool is not None:
            self.core_pool.shutdown(wait=False, cancel_futures=True)
        if self.cpu_groups is not None:
            self.cpu_stats = self.cpu_groups.stats()
            left = self.cpu_groups.remove()
            if left:
                log.warning("cgroups still busy, left in place: %s", ", ".join(left))

    # ------------------------------------------------------------------ the run
    async def _main(self) -> dict[str, Any]:
        import torch

        from tidal.agents import HarnessPool, PoolConfig
        from tidal.control.decision_log import DecisionLog, jsonl_file_sink
        from tidal.control.factory import build_controller
        from tidal.models import HFTokenizer, load_training_model
        from tidal.training.coordinator import CoordinatorConfig
        from tidal.training.core import CoreTrainer, TrainerConfig
        from tidal.training.flat import ParamLayout
        from tidal.training.packing import PackingConfig
        from tidal.training.sharded import ShardConfig
        from tidal.training.trajectory_buffer import TrajectoryBuffer, TrajectoryBufferConfig
        from tidal.training.transport import FilePublisher

        cfg, rt, c = self.cfg, self.rt, self.cfg.control
        torch.manual_seed(cfg.seed)
        threads, join = rt.torch_threads, None
        if self.cpu_groups is not None:
            # the core trainer computes on one thread that lives in cell 0's group (its OpenMP
            # team is born there too); more threads than cores would spin on the quota
            from tidal.runtime.cpuquota import join_thread

            threads = min(threads, max(1, int(rt.cell_cpus)))
            join = functools.partial(join_thread, self.cpu_groups.path("c0"))
        self.core_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="tidal-core", initializer=join)
        torch.set_num_threads(threads)
        specs = cfg.cluster.cell_specs()
        admin = httpx.AsyncClient(base_url=self.proxy.url, timeout=300.0,
                                  headers={"Authorization": f"Bearer {self.token}"})
        mode = "a" if self.ck else "w"  # a resumed run continues the logs
        decisions = open(self.out / "decisions.jsonl", mode)  # noqa: SIM115 - closed below
        self.buffer = TrajectoryBuffer(TrajectoryBufferConfig(
            group_size=c.group_size, max_policy_lag=c.updates_per_burst), self.clock)
        model = load_training_model(self.model_dir)  # transformers: any architecture
        tok = HFTokenizer(self.model_dir)
        device = trainer_device(rt.resolved_device(torch.cuda.is_available()),
                                getattr(self, "gpu_ids", {}).get("c0", []),
                                os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.publisher = FilePublisher(self.out / "weights", ParamLayout.of(model), keep=2)
        if rt.fsdp == "on" and torch.device(device).type != "cpu":
            raise ConfigError("runtime.fsdp", "'on' needs a CPU trainer (a sharded core cannot "
                              "be offloaded while cell 0 serves); use 'auto'")
        shard = (ShardConfig(ranks=rt.fsdp_ranks) if rt.fsdp != "off" and device == "cpu"
                 else None)
        if shard is None and rt.fsdp_ranks > 1:
            raise ConfigError("runtime.fsdp_ranks", "more than one rank per cell needs FSDP2 "
                              "(runtime.fsdp on a CPU trainer)")
        self.core = CoreTrainer(model, TrainerConfig(
            lr=rt.lr, groups_per_step=c.batch_groups, step_data_timeout_s=rt.step_data_timeout_s,
            packing=PackingConfig(token_budget=rt.token_budget), device=device,
            coordinator=CoordinatorConfig(join_timeout_s=rt.satellite_timeout_s), shard=shard),
            self.buffer, self.clock, publishers=[self.publisher], pad_id=tok.eos_id)
        self.weights = Weights()
        if self.ck is not None:
            self._restore_trainer()
        cells = [self.actors[f"c{i}"] for i in range(len(specs))]
        self.actuator = RayActuator(self.clock, admin, cells, self.weights, c.kv_handoff)
        if self.core.device.type == "cuda":  # cell 0's engine holds the GPU until it trains
            self.core.offload()
            self.actuator.core_memory = self.core
        if rt.satellites:
            self.actuator.core_address = self.core.address()
            self.actuator.satellite_timeout_s = rt.satellite_timeout_s
        self.ctl = build_controller(cfg, self.clock, self.actuator,
                                    DecisionLog(jsonl_file_sink(decisions), keep=False))
        self.actuator.bind(self.ctl)
        self.bridge = LedgerBridge(self.ctl, self.clock, admin, self.buffer, c.group_size)
        self.admin = admin
        self.supervisor = CellSupervisor(self)
        try:
            if self.ck is not None:
                await self._load_published()
            await self._join_engines(admin, specs)
            await self._satellites_up(rt.start_timeout_s)
            cl = cfg.cluster
            slots = cl.standalone_count * cl.standalone_slots + sum(s.slots for s in specs)
            pool = HarnessPool(PoolConfig(
                proxy_url=self.proxy.url, max_concurrent=slots,
                max_turns=rt.max_turns, max_tokens_per_turn=rt.max_tokens,
                temperature=rt.temperature,
                timeout_s=rt.execution_timeout_s), self.out / "workspaces", self.bridge)
            self._published = asyncio.Condition()
            first_step = self.ck.state.step if self.ck else 0
            self._bursts_published = first_step // c.updates_per_burst
            self.t_first = self.clock.now()
            self.t_offset = self.ck.state.elapsed_s if self.ck else 0.0
            ticks = asyncio.create_task(self._ticks())
            watch = asyncio.create_task(self.supervisor.run())
            trainer = asyncio.create_task(self._trainer(first_step))
            runs = []
            held = {r.execution_id: r for r in self.ck.records} if self.ck else {}
            trained = set(self.trained_groups)
            quota_groups = c.quota_executions // c.group_size
            for b in range(self._bursts_published, c.bursts):
                await self._wait_published(b, trainer)
                self.bridge.burst = b
                done = sum(f"b{b}-g{g}" in trained for g in range(quota_groups))
                quota = c.quota_executions - done * c.group_size  # less, after a resume
                self.ctl.handle(BurstStarted(self.clock.now(), b, quota, self.weights.version))
                for g in range(quota_groups):  # group by group, dispatch_interval_s apart
                    gid = f"b{b}-g{g}"
                    if gid in trained:
                        continue  # trained before the resume
                    ids = [f"{gid}-e{k}" for k in range(c.group_size)]
                    for eid in ids:  # closed before the resume: its record goes back
                        if eid in held:
                            self.bridge.restore(held.pop(eid))
                    ids = [e for e in ids if e not in self.bridge.restored]
                    if not ids:
                        continue
                    if g and rt.dispatch_interval_s:
                        await asyncio.sleep(rt.dispatch_interval_s)
                    make = self._task(cfg.seed * 1_000_003 + b * 1000 + g)
                    runs.append(asyncio.create_task(pool.run([(gid, make)] * len(ids), ids)))
            await trainer
            self.bursts_s = self.elapsed()  # first dispatch to last publish
            results = [r for batch in await asyncio.gather(*runs) for r in batch]
            await self.bridge.flush(60.0)
            self.bridge.write_executions(self.out / "executions.jsonl", results,
                                         self.t_first - self.t_offset, mode)
            await self._settle(self.cfg.control.step_timeout_s)
            ticks.cancel()
            watch.cancel()
            self._write_timeline()
            stats = (await admin.get("/tidal/stats")).json()
            engines = await asyncio.gather(*[a.describe.remote() for a in self.actors.values()],
                                           return_exceptions=True)
            engines = [e for e in engines if isinstance(e, dict)]
            return self._summary(results, stats, engines)
        finally:
            self.buffer.close()
            self.core.close()
            await admin.aclose()
            decisions.close()
            with open(self.out / "steps.jsonl", mode) as fh:
                fh.writelines(json.dumps(s) + "\n" for s in self.actuator.step_log)

    def _task(self, seed: int) -> Callable[[], Any]:
        """The environment factory of one group (every execution of a group gets the same
        problem: GRPO compares answers to one prompt)."""
        from tidal.agents import ArithmeticTask, WorkspaceTask
        from tidal.agents.environments import ToolLatency

        if self.rt.task == "arithmetic":
            return partial(ArithmeticTask, seed)
        latency = partial(ToolLatency, median_s=self.rt.tool_latency_s)
        return lambda: WorkspaceTask(seed, latency=latency(random.Random(seed + 1)))

    def elapsed(self) -> float:
        """Run time since the first dispatch, over every incarnation of a resumed run."""
        return self.t_offset + self.clock.now() - self.t_first

    def _restore_trainer(self) -> None:
        st = self.ck.state
        self.core.load_state_dict(self.ck.trainer)
        self.weights.version, self.weights.path = st.published_version, st.published_path
        if st.published_path is not None and not Path(st.published_path).is_file():
            raise ConfigError("--resume", f"published weights {st.published_path} are gone")
        lines = (self.out / "metrics.jsonl").read_text().splitlines()[:st.metrics_lines]
        (self.out / "metrics.jsonl").write_text("".join(x + "\n" for x in lines))
        self.metrics = [json.loads(x) for x in lines]
        log.warning("resuming %s at step %d (v%d trained, v%d published, %d records held)",
                    self.out, st.step, self.core.version, st.published_version,
                    len(self.ck.records))

    async def _load_published(self) -> None:
        """A resumed run's engines serve the version published before the interruption."""
        w = self.weights
        if w.path is not None:
            await asyncio.gather(*[a.load_weights.remote(w.path, w.label)
                                   for a in self.actors.values()])

    async def _checkpoint(self, step: int, final: bool) -> None:
        every = self.rt.checkpoint_every_steps
        if not every or ((step + 1) % every and not final):
            return
        st = checkpoint.RunState(
            step=step + 1, bursts_published=self._bursts_published + int(final),
            published_version=self.weights.version, published_path=self.weights.path,
            trained_groups=list(self.trained_groups), metrics_lines=len(self.metrics),
            elapsed_s=round(self.elapsed(), 3),
            resumes=(self.ck.state.resumes + 1) if self.ck else 0)
        records, trainer = self.buffer.held_records(), self.core.state_dict()
        await asyncio.to_thread(checkpoint.save, self.out, st, records, trainer)
        await asyncio.to_thread(checkpoint.record_processes, self.out)

    async def _join_engines(self, admin: httpx.AsyncClient, specs) -> None:
        for name, url in self.urls.items():
            body = self.join_body(name, url)
            resp = await admin.post("/tidal/engines", json=body)
            if resp.status_code != 200:
                raise RuntimeFailure(f"proxy refused engine {body['id']}: {resp.text[:200]}")
        # Cells the policy starts in training (e.g. static): out of routing, engine asleep.
        for i in range(self.ctl.cells.prefix_len):
            resp = await admin.post(f"/tidal/engines/c{i}/drain")
            if resp.status_code != 200:
                raise RuntimeFailure(f"drain of c{i} at start: {resp.text[:200]}")
            await self.actuator.cells[i].sleep.remote()
            self.actuator.asleep.add(i)
            await self.actuator.activate(i)

    async def _satellites_up(self, timeout_s: float) -> None:
        """Cells that train from the start (e.g. ``static``) begin the run with their
        satellites connected (bounded wait), so the first steps can use them."""
        want = set(self.actuator.satellite_pids)
        deadline = self.clock.now() + timeout_s
        while not want <= set(self.core.coordinator.registered()):
            if self.clock.now() > deadline:
                raise TimeoutExpired(f"satellites of cells {sorted(want)} not connected within "
                                     f"{timeout_s} s (see logs/satellite-c*.log)")
            await asyncio.sleep(0.1)

    async def _settle(self, timeout_s: float) -> None:
        """Bounded wait until no transition plan is in flight (the run ends in a known
        state: every engine either serving or asleep with its cell training)."""
        deadline = self.clock.now() + timeout_s
        while self.ctl.inflight is not None or self.supervisor.busy:
            if self.clock.now() > deadline:
                raise TimeoutExpired(f"plan {self.ctl.inflight.plan.plan_id} still in flight "
                                     f"{timeout_s} s after the last step")
            await asyncio.sleep(0.05)

    async def _ticks(self) -> None:
        n, every = 0, max(1, round(self.rt.state_every_s / self.rt.tick_s))
        with open(self.out / "state.jsonl", "a") as fh:
            while True:
                await asyncio.sleep(self.rt.tick_s)
                self.ctl.handle(Tick(self.clock.now()))
                n += 1
                if n % every:
                    continue
                st = self.state()
                fh.write(json.dumps({"t": round(self.elapsed(), 3), **st})
                         + "\n")
                fh.flush()
                if self.on_state is not None:
                    self.on_state(st)

    def _write_timeline(self) -> None:
        t0 = self.t_first - self.t_offset
        segs = self.ctl.timeline.close(self.clock.now())
        cells = [[[round(max(0.0, a - t0), 3), round(b - t0, 3), r.value] for a, b, r in cell]
                 for cell in segs]
        (self.out / "timeline.json").write_text(json.dumps({"cells": cells}))

    def state(self) -> dict[str, Any]:
        """What the live display shows (read on the loop; cheap)."""
        lg = self.ctl.ledger
        return {"burst": self.bridge.burst, "step": len(self.metrics),
                "version": self.weights.version,
                "reward": self.metrics[-1]["mean_reward"] if self.metrics else None,
                "waterlevel": lg.waterlevel, "queued": lg.total.queued,
                "running": lg.total.running, "ready_groups": lg.ready_unassigned,
                "roles": [r.value for r in self.ctl.cells.roles()],
                "switches": len(self.ctl.plans_done),
                "replaced": len(self.supervisor.replaced)}

    async def _wait_published(self, burst: int, trainer: asyncio.Task) -> None:
        async with self._published:
            while self._bursts_published < burst:
                if trainer.done():
                    trainer.result()  # raises the trainer's error
                    raise RuntimeFailure("the trainer ended before the run did")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._published.wait(), 1.0)

    async def _core_active(self) -> float:
        """Wait until cell 0's trainer worker is active and a full batch of groups is ready
        (so a step never holds the trainer lock while waiting for data, which would keep the
        core from returning to rollout); returns the wait."""
        t0, need = self.clock.now(), self.cfg.control.batch_groups
        while 0 not in self.actuator.training or len(self.buffer) < need:
            self.actuator.training_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.actuator.training_changed.wait(), 0.05)
        return self.clock.now() - t0

    async def _trainer(self, step: int) -> None:
        c = self.cfg.control
        first_b, first_u = divmod(step, c.updates_per_burst)
        for b in range(first_b, c.bursts or 0):
            for u in range(first_u if b == first_b else 0, c.updates_per_burst):
                final = u == c.updates_per_burst - 1
                wait_s, queue = 0.0, len(self.buffer)
                self.ctl.handle(TrainerReady(self.clock.now(), step))  # wants the next batch
                while True:
                    wait_s += await self._core_active()
                    await self.actuator.revive_satellites()
                    async with self.actuator.trainer_lock:
                        if 0 not in self.actuator.training:
                            continue  # offloaded between the check and the lock
                        t0 = self.clock.now()
                        report = await asyncio.get_running_loop().run_in_executor(
                            self.core_pool, self.core.train_step, final)
                        break
                dt = self.clock.now() - t0
                if report is None:
                    raise RuntimeFailure(f"step {step}: the trainer got no data")
                self.ctl.handle(GroupsAssigned(self.clock.now(), tuple(report.group_ids)))
                self.ctl.handle(TrainerStepDone(self.clock.now(), step, wait_s=wait_s,
                                                queue_at_start=queue, compute_s=dt, alloc_s=dt,
                                                final_of_burst=final))
                if final:
                    await self._publish()
                self.trained_groups += report.group_ids
                self._record_step(b, step, report, dt, wait_s)
                await self._checkpoint(step, final)
                step += 1
            async with self._published:
                self._bursts_published = b + 1
                self._published.notify_all()

    async def _publish(self) -> None:
        """The core already wrote the new version (FilePublisher); awake engines load it."""
        t0 = self.clock.now()
        w = self.weights
        async with w.lock:
            w.version = self.core.version
            w.path = self.publisher.path(w.version)
            targets = [(n, a) for n, a in self.actors.items() if n.startswith("s")]
            targets += [(f"c{i}", a) for i, a in enumerate(self.actuator.cells)
                        if i not in self.actuator.asleep]
            outs = await asyncio.gather(*[vllm_host.load_weights(  # vLLM: out of routing
                self.admin, n, a, w.path, w.label, drained=self._vllm is not None and n[0] == "s")
                for n, a in targets], return_exceptions=True)
        for out in outs:  # a lost engine is replaced by the supervisor with this version
            if isinstance(out, BaseException):
                log.warning("publishing %s: an engine did not load it: %s", w.label,
                            str(out).splitlines()[0])
        self.ctl.handle(WeightSyncDone(self.clock.now(), w.version, self.clock.now() - t0))

    def _record_step(self, burst: int, step: int, report, dt: float, wait_s: float) -> None:
        roles = self.ctl.cells.roles()
        line = {"t": round(self.elapsed(), 3), "burst": burst, "step": step,
                "version": self.core.version, "mean_reward": report.mean_reward,
                "loss": report.loss, "grad_norm": report.grad_norm,
                "n_groups": report.n_groups, "n_tokens": report.n_tokens,
                "max_staleness": report.max_staleness, "step_s": round(dt, 3),
                "compute_s": round(report.compute_s, 3), "update_s": round(report.update_s, 3),
                "core_compute_s": round(report.core_compute_s, 3),
                "core_tokens": report.core_tokens,
                "wait_s": round(wait_s, 3), "waterlevel": self.ctl.ledger.waterlevel,
                "ready_groups": self.ctl.ledger.ready_unassigned,
                "roles": [r.value for r in roles],
                "training_cells": sum(r is Role.TRAINING for r in roles),
                "satellites": list(report.members), "groups": list(report.group_ids),
                "micro_steps_by_cell": {str(k): v for k, v in
                                        sorted(report.micro_steps_by_cell.items())}}
        rows = self.ctl.metrics.rows
        if report.final and rows:  # the weight version just closed: verl's metric names
            line.update({k: round(v, 4) for k, v in rows[-1].items() if "/" in k})
        self.metrics.append(line)
        with open(self.out / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(line) + "\n")
        if self.on_step is not None:
            self.on_step(line)

    def _summary(self, results, stats: dict[str, Any], engines: list[dict]) -> dict[str, Any]:
        s = self.ctl.summary()
        reasons: dict[str, int] = {}
        for r in results:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
        return {
            "policy": s["policy"],
            "bursts": self.cfg.control.bursts,
            "trainer_steps": len(self.metrics),
            "bursts_s": round(self.bursts_s, 2),
            "version": self.weights.version,
            "switches_to_training": s["switches_to_training"],
            "switches_to_rollout": s["switches_to_rollout"],
            "plans_aborted": s["plans_aborted"],
            "final_roles": self.ctl.cells.describe(),
            # live model requests that went to another engine: in-flight ones retried
            # elsewhere, and next calls of executions whose engine left routing between calls
            "rerouted_requests": stats["retries"] + stats["rerouted_executions"],
            "retried_inflight_requests": stats["retries"],
            "rerouted_executions": stats["rerouted_executions"],
            "drained_requests": sum(d["moved"] for d in self.actuator.drains),
            "kv_handoffs": stats["kv_handoffs"],
            "engine_failures": stats["engine_failures"],
            "failed_requests": reasons.get("failed", 0),
            "timed_out_executions": reasons.get("timeout", 0),
            "dispatched": self.bridge.n_dispatched,
            "closed": len(results),
            "close_reasons": reasons,
            "trained_executions": sum(m["n_groups"] for m in self.metrics)
            * self.cfg.control.group_size,
            "lost_executions": self.bridge.lost,
            "record_errors": self.bridge.record_errors[:10],
            "ledger_waterlevel_end": s["waterlevel"],
            "duplicate_closes": s["duplicate_closes"],
            "engines": {e["name"]: {"state": e["state"], "version": e["version"],
                                    "gpu_ids": e["gpu_ids"],
                                    "restarted": e["pid"] != self.start_pids[e["name"]]}
                        for e in engines},
            "resumed": ({"at_step": self.ck.state.step, "restored_records": len(self.ck.records),
                         "resumes": self.ck.state.resumes + 1} if self.ck else None),
            "cells_replaced": [r["name"] for r in self.supervisor.replaced],
            "tokens_by_engine_version": self.bridge.tokens_by_engine_version,
            "engine_handoffs": self.bridge.engine_handoffs,
            "satellite_joins": sum(len(m["satellites"]) for m in self.metrics),
            "satellite_starts": self.actuator.satellite_starts,
            "micro_steps_by_cell": _sum_by_cell(self.metrics),
            "mean_reward_per_step": [round(m["mean_reward"], 4) for m in self.metrics],
            "mean_reward": (sum(r.reward for r in results) / len(results)) if results else 0.0,
        }


def _sum_by_cell(metrics: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in metrics:
        for cell, n in m["micro_steps_by_cell"].items():
            out[cell] = out.get(cell, 0) + n
    return dict(sorted(out.items()))
