"""The driver of ``tidal run``: starts the real parts, runs the bursts to the end, stops them.

In: a validated ``RunConfig`` and a run directory. Out: in the run directory ``config.yaml``
(resolved), the files of ``outputs`` (metrics, state, timeline, steps, summary),
``decisions.jsonl`` (every scheduling decision and plan record of the controller),
``executions.jsonl`` (per execution: times, and per model call its tokens and timings; ``tidal
calibrate`` fits the simulator on it), the checkpoint, and engine and proxy logs under ``logs/``.

This module owns what lives outside the event loop (Ray, the placement, the engines, the proxy,
the CPU-quota groups, the core trainer's thread); the parts on the loop are built in ``wiring``
and every background task runs under one owner (``tasks.Parts``): the first failure of any part
ends the run with its cause. Everything runs on one asyncio loop; blocking work (optimizer steps,
Ray calls) is awaited off the loop, so controller events are handled in order on one thread.
Devices (``runtime.device``): each cell actor puts its engine and satellite on its own GPU; the
core trainer runs on cell 0's GPU and is offloaded to CPU memory whenever cell 0 serves.
CPU quota (``runtime.cell_cpus``, ``cpuquota``): one cgroup per cell and standalone engine; the
actors and their processes join theirs, the core trainer computes on one thread in cell 0's; the
summary adds the seconds each group was throttled."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal.clock import WallClock
from tidal.config import RunConfig, dump_yaml
from tidal.contracts import run_files as schema
from tidal.control.policy import policy_mechanics
from tidal.errors import ConfigError
from tidal.runtime import checkpoint, preflight, proxy_watch, spill
from tidal.runtime.engines import EngineId, Engines, engine_ids, model_path
from tidal.runtime.outputs import RunOutputs, summary
from tidal.runtime.placement import Placement
from tidal.runtime.proxy_watch import ProxyLost
from tidal.runtime.tasks import Parts, remote
from tidal.runtime.trainer_loop import core_pool
from tidal.runtime.wiring import Wired, wire
from tidal.types import Tick

log = logging.getLogger(__name__)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _trap_sigterm() -> Any:
    """Turn SIGTERM into KeyboardInterrupt (main thread only); returns the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _interrupt)


def _ray_init(ray: Any, **kwargs: object) -> None:
    """``ray.init`` keeping this run's SIGTERM handler: Ray's init installs one that calls
    ``sys.exit(15)`` wherever the signal lands, so a SIGTERM while Ray starts ended the run
    with no line and exit code 0 (seen once in CI) instead of stopping its parts (130). Ray's
    ``_private.utils.set_sigterm_handler`` is held inert for the call."""
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    install = getattr(utils, "set_sigterm_handler", None)
    if install is None:  # another Ray layout: its handler, then ours again right after
        ray.init(**kwargs)
        return
    utils.set_sigterm_handler = lambda handler: None
    try:
        ray.init(**kwargs)
    finally:
        utils.set_sigterm_handler = install


def _init_loopback_ray(ray: Any, num_cpus: int, num_gpus: int | None,
                       object_store_bytes: int) -> None:
    """A one-machine Ray whose every process (GCS, raylet, workers, this driver) listens on
    loopback only, without a dashboard. Ray turns ``_node_ip_address="127.0.0.1"`` into the
    host's address unless it believes clusters are off (its Windows/macOS default), so that
    belief is held for the start (the raylet and workers get 127.0.0.1 on their command line)
    and given back after it: a later ``--address`` run resolves node addresses as usual."""
    from ray._private import ray_constants

    key = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    env, flag = os.environ.get(key), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[key], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        _ray_init(ray, num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                  object_store_memory=object_store_bytes,
                  _node_ip_address="127.0.0.1", log_to_driver=False,
                  # no idle Python workers started ahead of need: every worker this run uses
                  # hosts a named actor, started on its creation (3 idle ones held ~240 MB)
                  _system_config={"enable_worker_prestart": False,
                                  "prestart_worker_first_driver": False})
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = flag
        if env is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = env


def _alive_nodes(ray: Any) -> set[str]:
    """The ids of the Ray nodes alive now (``nodes_lost``: those of the start gone since)."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


class Runtime:
    def __init__(self, cfg: RunConfig, out: str | Path,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 on_state: Callable[[dict[str, Any]], None] | None = None,
                 resume: bool = False) -> None:
        # what `tidal check` checks too, before anything starts; the task's workload is built once
        self.workload = preflight.check_run(cfg)
        self.cfg, self.out, self.on_step, self.on_state = cfg, Path(out), on_step, on_state
        self.rt = cfg.runtime
        self.clock = WallClock()
        # two secrets: the admin token (the proxy's admin routes, the harnesses) and the
        # engine token (the proxy's and the actors' calls to engines); neither is ever on a
        # command line or in Ray's runtime_env (README "Security")
        self.token = secrets.token_hex(16)
        self.engine_token = secrets.token_hex(16)
        self.ck = checkpoint.load(self.out) if resume else None
        # owns every background task: none dies unseen; a dead proxy is the cause it names
        self.parts = Parts(root_cause=self._proxy_lost)
        self.ray_started = False
        self.cpu_groups: Any = None  # runtime.cell_cpus: one CPU-quota cgroup per engine
        self.cpu_stats: dict[str, dict[str, float]] = {}
        self.placement: Placement | None = None
        self.engines: Engines | None = None
        self.proxy: Any = None
        self.core_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.wired: Wired | None = None  # the parts on the event loop (``wiring``)
        self.node: Any = None  # ``nodes.Node`` of the driver, once Ray runs
        self.nodes_at_start: set[str] = set()  # Ray node ids alive when the engines started
        self.ray: Any = None

    def _proxy_lost(self) -> ProxyLost | None:
        """The dead proxy as the root cause of a failure (None: it runs, or never started)."""
        if self.proxy is None:
            return None
        return proxy_watch.lost(self.proxy.proc, self.out, grace_s=0.5)

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
        spill.remove(self.out)  # weights an earlier, killed run's sleeping engines left here
        t0 = time.perf_counter()
        # SIGTERM (kill, a scheduler's stop) ends the run like Ctrl-C: everything this run
        # started is stopped, and the checkpoint lets `tidal run --resume` continue it
        prev = _trap_sigterm()
        from tidal.runtime.footprint import MemorySampler

        sampler = MemorySampler(os.getpid(), self.rt.memory_sample_s).start()
        try:
            self._start_parts(ray)
            sampler.rename({pid: f"engine-{eid}" for eid, pid in self.engines.start_pids.items()})
            out = asyncio.run(self._supervised())
        finally:
            try:
                self._stop_parts(ray)
            finally:
                memory = sampler.stop()
                if prev is not None:
                    signal.signal(signal.SIGTERM, prev)
        out["run_time_s"] = round(time.perf_counter() - t0, 2)
        out["memory"] = memory
        if self.rt.cell_cpus is not None:
            out["cell_cpus"] = self.rt.cell_cpus
            out["cpu_throttled_s"] = {k: v["throttled_s"] for k, v in self.cpu_stats.items()}
        schema.check(schema.Summary, out, "summary.json (written)")
        (self.out / "summary.json").write_text(json.dumps(out, indent=2))
        # a successful run: nothing to resume, only what the user asked to keep stays
        freed = checkpoint.retain(self.out, self.rt.keep_checkpoints, self.rt.keep_weights)
        log.info("run directory: %.0f MB of checkpoints and weights deleted "
                 "(runtime.keep_checkpoints %d, runtime.keep_weights %d)", freed / 1e6,
                 self.rt.keep_checkpoints, self.rt.keep_weights)
        return out

    def _start_parts(self, ray: Any) -> None:
        from tidal.serving.launch import start_proxy

        rt, self.ray = self.rt, ray
        ctl = self.cfg.control
        if ctl.admission != "off" and ctl.engine_curve is None:  # before anything starts
            raise ConfigError("control.engine_curve", "admission control in a run needs the "
                              "engines' throughput curve [[batch, tokens/s], ...]")
        model_dir = model_path(self.cfg, self.out)
        names = [str(e) for e in engine_ids(self.cfg)]
        if rt.cell_cpus is not None:  # before Ray and any actor (their processes join it)
            from tidal.runtime.cpuquota import CpuGroups

            self.cpu_groups = CpuGroups(rt.cell_cpus, names)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if not ray.is_initialized():
            if rt.ray_address:
                _ray_init(ray, address=rt.ray_address, log_to_driver=False)  # logs: logs/
            else:
                _init_loopback_ray(ray, rt.ray_num_cpus, rt.ray_num_gpus,
                                   rt.ray_object_store_mb * 1024 * 1024)
            self.ray_started = True
            _trap_sigterm()  # Ray's core worker installs its own (crashing) SIGTERM handler
        if rt.ray_address:  # the cluster's nodes, before any placement
            preflight.check_cluster(self.cfg, ray.nodes())
        from tidal.runtime.nodes import here

        self.node = here()  # the driver's node: satellites of other nodes reach the core here
        os.environ["GLOO_SOCKET_IFNAME"] = self.node.gloo_iface()
        self.nodes_at_start = _alive_nodes(ray)
        if self.ck is not None and rt.ray_address:  # what a killed run left on other nodes
            from tidal.runtime.nodes import sweep

            left = sweep(ray, str(self.out))
            if any(left.values()):
                log.warning("resume: ended leftover processes of this run on nodes %s", left)
        self.placement = Placement(ray, self.cfg, names, rt.start_timeout_s)
        self.engines = Engines(ray, self.cfg, self.out, model_dir, self.placement,
                               self.cpu_groups, self.engine_token)
        ctl = self.cfg.control
        self.proxy = start_proxy([], [], self.token, engine_token=self.engine_token,
                                 kv_handoff=ctl.kv_handoff,
                                 log_path=self.out / "logs" / "proxy.log", seed=self.cfg.seed,
                                 admission=ctl.admission, admission_order=ctl.admission_order,
                                 engine_curve=ctl.engine_curve,
                                 backend_modules=rt.backend_modules)
        self.engines.start()
        self.proxy.wait_healthy(rt.start_timeout_s)
        checkpoint.record_processes(self.out)

    def _stop_parts(self, ray: Any) -> None:
        if self.engines is not None:
            sats = [pid for c, pid in (self.wired.actuator.satellite_pids.items()
                                       if self.wired else [])
                    if self.engines.on_this_host(EngineId.cell(c))]  # others' pids: not ours
            self.engines.stop(list(sats))
        if self.proxy is not None:
            self.proxy.stop()
        if self.placement is not None:
            self.placement.remove()
        if self.rt.ray_address and self.engines is not None:  # a lost actor's orphans
            from tidal.runtime.nodes import sweep

            try:
                ended = sweep(ray, str(self.out))
            except Exception:
                log.exception("ending this run's processes on the other nodes")
            else:
                if any(ended.values()):
                    log.info("ended leftover processes on nodes: %s", ended)
        if self.engines is not None:  # after the engines' end: what they spilled while asleep
            spill.remove(self.out)
        if self.ray_started:
            ray.shutdown()
        if self.core_pool is not None:
            self.core_pool.shutdown(wait=False, cancel_futures=True)
        if self.cpu_groups is not None:
            self.cpu_stats = self.cpu_groups.stats()
            left = self.cpu_groups.remove()
            if left:
                log.warning("cgroups still busy, left in place: %s", ", ".join(left))

    # ------------------------------------------------------------------ the run
    async def _supervised(self) -> dict[str, Any]:
        """``_main`` under the task owner: the first failure of any part ends the run."""
        try:
            return await self.parts.run(self._main(), self.rt.run_timeout_s)
        finally:
            await self.parts.aclose()

    async def _main(self) -> dict[str, Any]:
        assert self.engines is not None and self.proxy is not None, "_start_parts first"
        self.core_pool = core_pool(self.cfg, self.cpu_groups)
        outputs = RunOutputs(self.out, self.clock, self.ck.state.elapsed_s if self.ck else 0.0,
                             self.ck is not None, self.on_step, self.on_state)
        w = self.wired = wire(self.cfg, self.out, self.ck, self.clock, self.parts,
                              self.engines, self.proxy.url, self.token, self.core_pool, outputs,
                              self.node.ip, self.workload)
        if self.ck is not None:
            log.warning("resuming %s at step %d (v%d trained, v%d published, %d records held)",
                        self.out, self.ck.state.step, w.core.version,
                        self.ck.state.published_version, len(self.ck.records))
        # the proxy is a part of the run: its death stops the run in one line (``proxy_watch``)
        self.parts.spawn("proxy", proxy_watch.watch(self.proxy.proc, self.out, self.clock))
        try:
            if self.ck is not None:
                await w.publisher.load_published()
            await self._join_engines(w)
            await w.satellites_up(self.rt.start_timeout_s)
            outputs.start_clock()
            self.parts.spawn("controller ticks", outputs.sample_state(
                lambda: w.handle(Tick(self.clock.now())), w.state, self.rt.tick_s,
                self.rt.state_every_s))
            self.parts.spawn("cell supervisor", w.supervisor.run())
            self.parts.spawn("proxy queue probe", w.probe_proxy_queue(self.rt.state_every_s))
            self.parts.spawn("decode meter", w.meter.run())
            trainer = self.parts.spawn("trainer loop", w.trainer.run())
            await w.dispatcher.run(w.trainer.bursts_published, lambda: w.publisher.weights.version,
                                   functools.partial(w.trainer.wait_published, trainer=trainer))
            await trainer
            return await self._finish(w, bursts_s=outputs.elapsed())
        finally:
            # the background parts end before the clients they use are closed (a probe that
            # wakes after ``w.close()`` would fail the run on a closed client)
            await self.parts.aclose()
            await w.close()

    async def _finish(self, w: Wired, bursts_s: float) -> dict[str, Any]:
        """After the last publication: every record delivered, ``executions.jsonl``, the
        controller settled, the timeline and the summary."""
        results = await w.dispatcher.results()
        await w.bridge.flush(60.0)
        w.bridge.write_executions(self.out / "executions.jsonl", results, w.outputs.t0,
                                  w.outputs.mode)
        await w.settle(self.cfg.control.step_timeout_s)
        w.outputs.write_timeline(w.ctl.timeline.close(self.clock.now()))
        stats = (await w.admin.get("/tidal/stats")).json()
        if stats["engine_step_failures"]:  # retried by the proxy, but never silent
            log.warning("%d engine model steps failed (their calls were retried); see "
                        "logs/engine-*.log", stats["engine_step_failures"])
        engines = await asyncio.gather(*[remote(a.describe.remote(), f"{eid} describe", 30.0)
                                         for eid, a in self.engines.actors.items()],
                                       return_exceptions=True)
        undescribed = {eid: e for eid, e in zip(self.engines.actors, engines, strict=True)
                       if not isinstance(e, dict)}
        for eid, exc in undescribed.items():  # the summary lacks them: say so, never silently
            log.warning("engine %s did not describe itself at the end (%s: %s); the summary "
                        "lists it under engines_undescribed", eid, type(exc).__name__, exc)
        st = self.ck.state if self.ck else None
        lost = sorted(self.nodes_at_start - _alive_nodes(self.ray))
        if lost:
            log.warning("%d Ray nodes lost during the run: %s", len(lost), ", ".join(lost))
        mechanics = policy_mechanics(self.cfg.policy.name).model_dump(mode="json")
        return {"t0_utc": w.outputs.t0_utc(), "nodes": len(self.nodes_at_start),
                "policy_mechanics": mechanics,
                "nodes_lost": len(lost), "engines_undescribed": sorted(undescribed),
                "deterministic": self.rt.deterministic,
                **(w.dispatcher.gate.hold.report() if w.dispatcher.gate else {}),
                **summary(
            ctl=w.ctl, bursts=self.cfg.control.bursts or 0, metrics=w.outputs.metrics,
            version=w.publisher.weights.version, bursts_s=bursts_s,
            group_size=self.cfg.control.group_size, results=results, stats=stats,
            engines=[e for e in engines if isinstance(e, dict)],
            start_pids={str(k): v for k, v in self.engines.start_pids.items()},
            bridge=w.bridge, actuator=w.actuator, replaced=w.supervisor.replaced,
            resumed=({"at_step": st.step, "restored_records": len(self.ck.records),
                      "resumes": st.resumes + 1} if st else None),
            closed_before=dict(st.close_reasons) if st else {},
            publication=w.publisher.report())}

    async def _join_engines(self, w: Wired) -> None:
        from tidal.runtime.cell import RuntimeFailure

        for eid, url in self.engines.urls.items():
            resp = await w.admin.post("/tidal/engines", json=self.engines.join_body(eid, url))
            if resp.status_code != 200:
                raise RuntimeFailure(f"proxy refused engine {eid}: {resp.text[:200]}")
        for i in range(w.ctl.cells.prefix_len):  # cells the policy starts in training
            await w.actuator.begin_in_training(i)
