"""The driver of ``tidal run``: starts the real parts, runs the bursts to the end, stops them.

In: a validated ``RunConfig`` and a run directory. Out: in the run directory ``config.yaml``
(resolved), the files of ``outputs`` (metrics, state, timeline, steps, summary),
``decisions.jsonl`` (every scheduling decision and plan record of the controller),
``executions.jsonl`` (per execution: times, and per model call its tokens and timings; ``tidal
calibrate`` fits the simulator on it), the checkpoint, and engine and proxy logs under ``logs/``.

This module owns what lives outside the event loop (Ray, the placement, the engines, the proxy,
the CPU-quota groups, the core trainer's thread; Ray's start in ``ray_start``, the end of the
run and the stop of its parts in ``run_end``); the parts on the loop are built in ``wiring``
and every background task runs under one owner (``tasks.Parts``): the first failure of any part
ends the run with its cause. Everything runs on one asyncio loop; blocking work (optimizer steps,
Ray calls) is awaited off the loop, so controller events are handled in order on one thread.
Devices (``runtime.device``): each cell actor puts its engine and satellite on its own GPU; the
core trainer runs on cell 0's GPU and is offloaded to CPU memory whenever cell 0 serves.
CPU quota (``runtime.cell_cpus``, ``cpuquota``): one cgroup per cell and standalone engine; the
actors and their processes join theirs, the core trainer computes on one thread in cell 0's; the
summary adds the seconds each group was throttled."""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tidal.clock import WallClock
from tidal.config import RunConfig, dump_yaml
from tidal.contracts import run_files as schema
from tidal.control.policy import Policy
from tidal.errors import ConfigError
from tidal.runtime import checkpoint, preflight, proxy_watch, run_end, spill
from tidal.runtime.engines import Engines, engine_ids, model_path
from tidal.runtime.outputs import RunOutputs
from tidal.runtime.placement import Placement
from tidal.runtime.proxy_watch import ProxyLost
from tidal.runtime.ray_start import alive_nodes, init_loopback_ray, ray_init, trap_sigterm
from tidal.runtime.stopping import run_loop
from tidal.runtime.tasks import Parts
from tidal.runtime.trainer_loop import core_pool
from tidal.runtime.wiring import Wired, wire
from tidal.types import Tick

log = logging.getLogger(__name__)


class Runtime:
    def __init__(
        self,
        cfg: RunConfig,
        out: str | Path,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        on_state: Callable[[dict[str, Any]], None] | None = None,
        resume: bool = False,
        policy: Policy | None = None,
    ) -> None:
        # what `tidal check` checks too, before anything starts; the task's workload and the
        # policy (``policy``: the caller's, built by ``checked_policy``) are built once
        checked = preflight.check_run(cfg, policy=policy)
        self.workload, self.policy = checked.workload, checked.policy
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
        self.ray_temp: Path | None = None  # a one-machine Ray's own session folder (ray_temp)
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
        return next(
            (x for p in self.proxy.procs if (x := proxy_watch.lost(p, self.out, grace_s=0.5))),
            None,
        )

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
            from tidal.runtime import ray_temp

            ray_temp.sweep(self.out)  # the Ray folder a killed incarnation left in /tmp
        spill.remove(self.out)  # weights an earlier, killed run's sleeping engines left here
        t0 = time.perf_counter()
        # SIGTERM (kill, a scheduler's stop) ends the run like Ctrl-C: everything this run
        # started is stopped, and the checkpoint lets `tidal run --resume` continue it
        prev = trap_sigterm()
        from tidal.runtime.footprint import MemorySampler

        sampler = MemorySampler(os.getpid(), self.rt.memory_sample_s).start()
        try:
            self._start_parts(ray)
            sampler.rename({pid: f"engine-{eid}" for eid, pid in self.engines.start_pids.items()})
            sampler.rename({p.pid: f"proxy-{i}" for i, p in enumerate(self.proxy.procs) if i})
            # a stop bounds the tasks' end and never waits for a stuck thread (``stopping``)
            out = run_loop(self._supervised())
        finally:
            try:
                run_end.stop_parts(self, ray)
            finally:
                memory = sampler.stop()
                if prev is not None:
                    signal.signal(signal.SIGTERM, prev)
        out["run_time_s"] = round(time.perf_counter() - t0, 2)
        out["memory"] = memory
        if self.rt.cell_cpus is not None:
            out["cell_cpus"] = self.rt.cell_cpus
            out["cpu_throttled_s"] = {k: v["throttled_s"] for k, v in self.cpu_stats.items()}
        if self.rt.emulate is not None:  # its first key says so (a test double's figures)
            from tidal.runtime.emulated_run import emulated_banner

            out = {"emulated": emulated_banner(self.rt.emulate), **out}
        schema.check(schema.Summary, out, "summary.json (written)")
        (self.out / "summary.json").write_text(json.dumps(out, indent=2))
        # a successful run: nothing to resume, only what the user asked to keep stays
        freed = checkpoint.retain(self.out, self.rt.keep_checkpoints, self.rt.keep_weights)
        log.info(
            "run directory: %.0f MB of checkpoints and weights deleted "
            "(runtime.keep_checkpoints %d, runtime.keep_weights %d)",
            freed / 1e6,
            self.rt.keep_checkpoints,
            self.rt.keep_weights,
        )
        return out

    def _start_parts(self, ray: Any) -> None:
        from tidal.serving.proxy_set import start_proxies

        rt, self.ray = self.rt, ray
        ctl = self.cfg.control
        if ctl.admission != "off" and ctl.engine_curve is None:  # before anything starts
            raise ConfigError(
                "control.engine_curve",
                "admission control in a run needs the "
                "engines' throughput curve [[batch, tokens/s], ...]",
            )
        model_dir = model_path(self.cfg, self.out)
        names = [str(e) for e in engine_ids(self.cfg)]
        if rt.cell_cpus is not None:  # before Ray and any actor (their processes join it)
            from tidal.runtime.cpuquota import CpuGroups

            self.cpu_groups = CpuGroups(rt.cell_cpus, names)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if not ray.is_initialized():
            if rt.ray_address:
                ray_init(ray, address=rt.ray_address, log_to_driver=False)  # logs: logs/
            else:
                from tidal.runtime import ray_temp

                self.ray_temp = ray_temp.make(self.out)
                init_loopback_ray(
                    ray,
                    rt.ray_num_cpus,
                    rt.ray_num_gpus,
                    rt.ray_object_store_mb * 1024 * 1024,
                    ray_temp.for_ray(self.ray_temp),
                )
            self.ray_started = True
            trap_sigterm()  # Ray's core worker installs its own (crashing) SIGTERM handler
        if rt.ray_address:  # the cluster's nodes, before any placement
            preflight.check_cluster(self.cfg, ray.nodes())
        from tidal.runtime.nodes import here

        self.node = here()  # the driver's node: satellites of other nodes reach the core here
        os.environ["GLOO_SOCKET_IFNAME"] = self.node.gloo_iface()
        self.nodes_at_start = alive_nodes(ray)
        if self.ck is not None and rt.ray_address:  # what a killed run left on other nodes
            from tidal.runtime.nodes import sweep

            left = sweep(ray, str(self.out))
            if any(left.values()):
                log.warning("resume: ended leftover processes of this run on nodes %s", left)
        self.placement = Placement(ray, self.cfg, names, rt.start_timeout_s)
        self.engines = Engines(
            ray, self.cfg, self.out, model_dir, self.placement, self.cpu_groups, self.engine_token
        )
        ctl = self.cfg.control
        cl = self.cfg.cluster  # every slot's execution may be open at one proxy process
        slots = cl.standalone_count * cl.standalone_slots + sum(s.slots for s in cl.cell_specs())
        self.proxy = start_proxies(
            rt.proxy_processes,
            self.token,
            max_open_executions=max(10_000, slots),
            engine_token=self.engine_token,
            kv_handoff=ctl.kv_handoff,
            log_path=self.out / "logs" / "proxy.log",
            seed=self.cfg.seed,
            admission=ctl.admission,
            admission_order=ctl.admission_order,
            engine_curve=ctl.engine_curve,
            backend_modules=rt.backend_modules,
            max_prompt_tokens=rt.max_prompt_tokens,
        )
        self.engines.start()
        self.proxy.wait_healthy(rt.start_timeout_s)
        checkpoint.record_processes(self.out)

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
        outputs = RunOutputs(
            self.out,
            self.clock,
            self.ck.state.elapsed_s if self.ck else 0.0,
            self.ck is not None,
            self.on_step,
            self.on_state,
        )
        w = self.wired = wire(
            self.cfg,
            self.out,
            self.ck,
            self.clock,
            self.parts,
            self.engines,
            self.proxy.url,
            self.token,
            self.core_pool,
            outputs,
            self.node.ip,
            self.workload,
            self.policy,
            proxies=self.proxy,
        )
        if self.ck is not None:
            log.warning(
                "resuming %s at step %d (v%d trained, v%d published, %d records held)",
                self.out,
                self.ck.state.step,
                w.core.version,
                self.ck.state.published_version,
                len(self.ck.records),
            )
        # the proxy is a part of the run: its death stops the run in one line (``proxy_watch``)
        for i, proc in enumerate(self.proxy.procs):
            name = "proxy" if i == 0 else f"proxy {i}"
            self.parts.spawn(name, proxy_watch.watch(proc, self.out, self.clock))
        try:
            if self.ck is not None:
                await w.publisher.load_published()
            await self._join_engines(w)
            await w.satellites_up(self.rt.start_timeout_s)
            outputs.start_clock()
            await w.plane.begin(w.admin)  # the proxy's counts at the first dispatch
            self.parts.spawn("control plane", w.plane.run())
            self.parts.spawn(
                "controller ticks",
                outputs.sample_state(
                    lambda: w.handle(Tick(self.clock.now())),
                    w.state,
                    self.rt.tick_s,
                    self.rt.state_every_s,
                ),
            )
            self.parts.spawn("cell supervisor", w.supervisor.run())
            self.parts.spawn("proxy queue probe", w.probe_proxy_queue(self.rt.state_every_s))
            self.parts.spawn("decode meter", w.meter.run())
            trainer = self.parts.spawn("trainer loop", w.trainer.run())
            await w.dispatcher.run(
                w.trainer.bursts_published,
                lambda: w.publisher.weights.version,
                functools.partial(w.trainer.wait_published, trainer=trainer),
            )
            await trainer
            return await run_end.finish(self, w, bursts_s=outputs.elapsed())
        finally:
            # the background parts end before the clients they use are closed (a probe that
            # wakes after ``w.close()`` would fail the run on a closed client)
            await self.parts.aclose()
            await w.close()

    async def _join_engines(self, w: Wired) -> None:
        from tidal.runtime.cell import RuntimeFailure

        for eid, url in self.engines.urls.items():
            resp = await w.admin.post("/tidal/engines", json=self.engines.join_body(eid, url))
            if resp.status_code != 200:
                raise RuntimeFailure(f"proxy refused engine {eid}: {resp.text[:200]}")
        for i in range(w.ctl.cells.prefix_len):  # cells the policy starts in training
            await w.actuator.begin_in_training(i)
