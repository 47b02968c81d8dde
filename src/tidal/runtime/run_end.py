"""The end of a run: its figures once the last version is published, and its parts stopped.

In: the ``driver.Runtime`` (its config, run directory, engines, proxy, placement, checkpoint)
and the wired parts (``wiring.Wired``). Out: ``finish``: every record delivered,
``executions.jsonl`` and the timeline written, the summary's fields (``outputs.summary`` and the
run's own: nodes, policy mechanics, engines that did not describe themselves); ``stop_parts``:
everything the run started, stopped. Moved whole out of ``driver`` (the last step of its data
flow).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from tidal.control.policy import policy_mechanics
from tidal.runtime import spill
from tidal.runtime.engines import EngineId
from tidal.runtime.outputs import summary
from tidal.runtime.ray_start import alive_nodes
from tidal.runtime.tasks import remote

if TYPE_CHECKING:
    from tidal.runtime.driver import Runtime
    from tidal.runtime.wiring import Wired

log = logging.getLogger(__name__)


async def finish(run: Runtime, w: Wired, bursts_s: float) -> dict[str, Any]:
    """After the last publication: every record delivered, ``executions.jsonl``, the
    controller settled, the timeline and the summary. Executions still open (carried past
    the last version by the staleness budget) close ``cancelled`` first."""
    w.dispatcher.end_open()
    results = await w.dispatcher.results()
    await w.bridge.flush(60.0)
    w.bridge.write_executions(run.out / "executions.jsonl", results, w.outputs.t0, w.outputs.mode)
    await w.settle(run.cfg.control.step_timeout_s)
    w.outputs.write_timeline(w.ctl.timeline.close(run.clock.now()))
    stats = (await w.admin.get("/tidal/stats")).json()
    if stats["engine_step_failures"]:  # retried by the proxy, but never silent
        log.warning(
            "%d engine model steps failed (their calls were retried); see logs/engine-*.log",
            stats["engine_step_failures"],
        )
    engines = await asyncio.gather(
        *[
            remote(a.describe.remote(), f"{eid} describe", 30.0)
            for eid, a in run.engines.actors.items()
        ],
        return_exceptions=True,
    )
    undescribed = {
        eid: e
        for eid, e in zip(run.engines.actors, engines, strict=True)
        if not isinstance(e, dict)
    }
    for eid, exc in undescribed.items():  # the summary lacks them: say so, never silently
        log.warning(
            "engine %s did not describe itself at the end (%s: %s); the summary "
            "lists it under engines_undescribed",
            eid,
            type(exc).__name__,
            exc,
        )
    st = run.ck.state if run.ck else None
    lost = sorted(run.nodes_at_start - alive_nodes(run.ray))
    if lost:
        log.warning("%d Ray nodes lost during the run: %s", len(lost), ", ".join(lost))
    mechanics = policy_mechanics(run.cfg.policy.name).model_dump(mode="json")
    return {
        "t0_utc": w.outputs.t0_utc(),
        "nodes": len(run.nodes_at_start),
        "policy_mechanics": mechanics,
        "nodes_lost": len(lost),
        "engines_undescribed": undescribed_names(undescribed),
        "deterministic": run.rt.deterministic,
        "control_plane": w.plane.report(stats, bursts_s, w.meter.figures()),
        "carry_over": w.dispatcher.carry_report(),
        **(w.dispatcher.gate.hold.report() if w.dispatcher.gate else {}),
        **summary(
            ctl=w.ctl,
            bursts=run.cfg.control.bursts or 0,
            metrics=w.outputs.metrics,
            version=w.publisher.weights.version,
            bursts_s=bursts_s,
            group_size=run.cfg.control.group_size,
            results=results,
            stats=stats,
            engines=[e for e in engines if isinstance(e, dict)],
            start_pids={str(k): v for k, v in run.engines.start_pids.items()},
            bridge=w.bridge,
            actuator=w.actuator,
            replaced=w.supervisor.replaced,
            resumed=(
                {
                    "at_step": st.step,
                    "restored_records": len(run.ck.records),
                    "resumes": st.resumes + 1,
                }
                if st
                else None
            ),
            closed_before=dict(st.close_reasons) if st else {},
            publication=w.publisher.report(),
        ),
    }


def stop_parts(run: Runtime, ray: Any) -> None:
    """Every part ``run`` started, stopped in this order: engines and their satellites on this
    host, the proxy, the placement, what a lost actor left on other nodes, spilled weights,
    Ray, the core pool and the CPU-quota groups (their throttled seconds kept)."""
    if run.engines is not None:
        sats = [
            pid
            for c, pid in (run.wired.actuator.satellite_pids.items() if run.wired else [])
            if run.engines.on_this_host(EngineId.cell(c))
        ]  # others' pids: not ours
        run.engines.stop(list(sats))
    if run.proxy is not None:
        run.proxy.stop()
    if run.placement is not None:
        run.placement.remove()
    if run.rt.ray_address and run.engines is not None:  # a lost actor's orphans
        from tidal.runtime.nodes import sweep

        try:
            ended = sweep(ray, str(run.out))
        except Exception:
            log.exception("ending this run's processes on the other nodes")
        else:
            if any(ended.values()):
                log.info("ended leftover processes on nodes: %s", ended)
    if run.engines is not None:  # after the engines' end: what they spilled while asleep
        spill.remove(run.out)
    if run.ray_started:
        ray.shutdown()
    if run.ray_temp is not None:  # Ray's logs into logs/ray, its session folder gone
        from tidal.runtime import ray_temp

        ray_temp.finish(run.ray_temp, run.out)
    if run.core_pool is not None:
        run.core_pool.shutdown(wait=False, cancel_futures=True)
    if run.cpu_groups is not None:
        run.cpu_stats = run.cpu_groups.stats()
        left = run.cpu_groups.remove()
        if left:
            log.warning("cgroups still busy, left in place: %s", ", ".join(left))


def undescribed_names(undescribed: dict) -> list[str]:
    """The summary's ``engines_undescribed``: engine ids as their names (``c0``, ``s1``), sorted
    by id. The summary contract takes strings; an ``EngineId`` there made the run's end fail."""
    return [str(eid) for eid in sorted(undescribed)]
