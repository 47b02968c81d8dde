"""A simulator scenario fitted on a real run directory (``tidal calibrate``).

In: a directory written by ``tidal run`` (``config.yaml``, ``metrics.jsonl``, ``steps.jsonl``,
``executions.jsonl``, ``summary.json``) and optionally the ``config.yaml`` of another run to
describe (a prediction: its cluster, control, policy and bursts; the speeds stay those of the
calibration run). Out: a validated ``Scenario`` and ``notes`` (every fitted number with how it
was measured). Pure: reads files, no Ray, no torch, no clock.

What is fitted, and from what (times are seconds of the run's wall clock):

- **Cluster, control, policy** are copied from ``config.yaml``. Every cell and standalone engine
  is one "GPU"; slots are the concurrency caps.
- **Runtime mechanics** (``profiles``): the runtime dispatches a burst's whole quota
  (``dispatch: burst``) group by group, its trainer waits for a full batch (``trainer: batch``),
  weights load in place (``sync: keep``), every dispatched group is trained
  (``staleness_threshold: 0``); ``sim.tick_s`` = ``runtime.tick_s``. ``sim.dispatch_interval_s``
  = the described run's ``runtime.dispatch_interval_s`` plus the lateness measured here: the
  mean gap between consecutive groups' first dispatch in a burst minus the configured interval
  (the dispatcher's sleep ends late on a busy event loop).
- **Workload** (``run_workload``; ``executions.jsonl``, every execution that made model calls,
  whatever closed it): with a trace path (what ``tidal calibrate`` does) the run's own
  executions are replayed, group by group, cycling: the empirical distribution (e.g. the mass
  of outputs at ``max_tokens``) with the harness time around the calls (``setup_s`` before
  the first call; after each call the time to the next call or to the close). The parametric
  class is fitted either way (and used without a trace; it has no setup or final step):
  ``turns`` = calls per execution, ``decode_tokens`` = output tokens per call, ``tool_s`` = the
  time from the end of a call to the start of the next, ``tool_output_tokens`` = prompt growth
  between calls minus the previous output (``P[k] - P[k-1] - O[k-1]``), ``prompt_tokens`` =
  median first prompt; each a capped lognormal (median, sigma = std of the logs, cap = max,
  lo = min); ``group_share`` = between-group share of the variance of the executions' mean log
  output; ``success_rate`` = share of rewards > 0.
- **Engine** (``engine_fit``): processor sharing fitted on throughput: per-engine ``T``,
  per-sequence cap ``C`` and a shared host's ``H`` (CPU runs: all engines on the same cores);
  the method is in ``engine_fit``'s docstring. ``prefill_equiv`` is 0 (the rates include it).
- **Trainer** (``fit_trainer``, ``metrics.jsonl``): a step trains ``W`` simulated tokens (the
  final context, last prompt + last output, of every execution of its groups) in
  ``step_s = a + W / (R * speedup(cells))`` (``cells`` = 1 + satellites that joined). Runs that
  time both parts of a step (``compute_s``: the micro-steps of every cell; ``update_s``:
  aggregation, optimizer step, broadcast) give ``a`` = mean ``update_s`` of non-final steps
  (a final step's extra ``update_s``, writing the version, goes to ``publish_s``) and
  ``R = sum W / speedup / sum compute_s``; with the core's own micro-step time and token share
  (``core_compute_s``, ``core_tokens`` of ``n_tokens``) ``R`` is one cell's speed,
  ``sum W * share / sum core_compute_s``, and the steps with more cells give the efficiency
  per doubling (median of ``(W / R / compute_s / n) ** (1 / log2 n)``, in [0.3, 1]: the
  satellites' joins and weight pulls are in it); older runs: least squares for ``a >= 0``
  and ``R``. Between two steps the trainer spends
  ``gap = t[k] - t[k-1] - wait_s[k] - step_s[k]`` off the step (checkpoint, satellites): ``o`` =
  mean gap of non-final steps; a burst's final step also publishes, ``publish_s`` = mean of
  ``gap - o`` over final steps. ``train_tok_s_per_gpu`` = R, ``optimizer_s`` = a + o,
  ``aggregate_s_per_cell`` = 0, ``scaling_efficiency`` = the simulator's default (on a shared
  CPU host 0.5: more cells on the same cores add no training compute; a run with
  ``runtime.cell_cpus`` gives each cell its own cores, so the default) unless steps ran with
  different numbers of cells (then ``R`` per cell count gives it).
- **Costs** (``steps.jsonl``, successful steps): the mean duration per step kind (the mean,
  not the median: the simulator charges one value per step, and a run's time is their sum;
  on a shared CPU host waking under load takes seconds, idle a tenth): admission
  (stop/resume admission, load-balancer changes), reroute (reserve/cancel/abort/rebalance),
  release, sleep, wake, onload (restore training state), offload, ``load_weights_s``
  (load/sync weights of a waking cell), ``kv_latency_s`` (kv_handoff; ``kv_kb_per_token`` 0).
  The burst-end publication is ``sync_latency_s = publish_s`` (``weight_gb`` 0). Only plans
  started before the last publication count (``decisions.jsonl`` places them: seconds since the
  first ``BurstStarted``): later ones are the runtime settling, which no burst waits for. A
  kind never run keeps the simulator's default (noted).

Burst time, the same on both sides (``vs_real``): a burst ends when its weights are
published; a burst's time runs from the previous end (or the first dispatch) to its end.
Invariant: a directory without the files the fit needs is one ``ConfigError`` line.
"""

from __future__ import annotations

import json
import math
import statistics as st
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from tidal import rundir as run_data
from tidal.config import RunConfig, load_yaml
from tidal.contracts import run_files as schema
from tidal.control.factory import check_known
from tidal.errors import ConfigError
from tidal.rundir import load_run
from tidal.sim.costs import speedup
from tidal.sim.engine_fit import fit_engine
from tidal.sim.run_workload import dispatch_interval_s, fit_workload, trace_lines
from tidal.sim.scenario import Scenario, TrainerConfig

COST_KINDS = {
    "admission_s": (
        "stop_admission",
        "resume_admission",
        "remove_from_load_balancer",
        "add_to_load_balancer",
        "resume_generation",
    ),
    "reroute_s": ("reserve_and_reroute", "cancel_and_retry", "abort_inflight", "rebalance"),
    "release_s": ("release_rollout_memory",),
    "sleep_s": ("sleep_engine",),
    "wake_s": ("wake_engine",),
    "onload_s": ("restore_training_state",),
    "offload_s": ("offload_training_state",),
    "load_weights_s": ("load_weights", "sync_weights"),
    "kv_latency_s": ("kv_handoff",),
}


def read_jsonl(path: Path, model: type[BaseModel]) -> list[dict[str, Any]]:
    """The lines of a run-directory file, each checked against its model
    (``tidal.contracts.run_files``)."""
    return _required(path, run_data.read_jsonl(path, model=model))


T = TypeVar("T")


def _required(path: Path, lines: T | None) -> T:
    if lines is None:
        raise ConfigError(str(path), "missing: calibration needs it (written by `tidal run`)")
    return lines


# ------------------------------------------------------------------------ trainer

# speed-up(n) = n * e**log2(n) = 1 for every n: training cells that share one host's cores
SHARED_HOST_EFFICIENCY = 0.5


def fit_trainer(
    metrics: list[dict[str, Any]],
    execs: list[schema.ExecutionLine],
    updates_per_burst: int,
    shared_host: bool = False,
) -> tuple[dict[str, float], float, dict[str, Any]]:
    """Trainer speed, per-step overhead and the burst-end publication time. On a shared host
    (a CPU run: every cell trains on the same cores) more training cells bring no compute, so
    unless the run itself measured otherwise the efficiency per doubling is 0.5 (speed-up 1)."""
    ctx_by_group: dict[str, float] = {}
    for e in execs:
        if e.calls:
            last = e.calls[-1]
            ctx_by_group[e.group] = (
                ctx_by_group.get(e.group, 0.0) + last.prompt_tokens + last.output_tokens
            )
    eff = SHARED_HOST_EFFICIENCY if shared_host else TrainerConfig().scaling_efficiency
    xs, ys, cells = [], [], []
    for m in metrics:
        if "groups" not in m or any(g not in ctx_by_group for g in m["groups"]):
            raise ConfigError(
                "metrics.jsonl",
                f"step {m.get('step')}: its groups are not all "
                "in executions.jsonl (a run written before calibration existed?)",
            )
        work = sum(ctx_by_group[g] for g in m["groups"])
        n = 1 + len(m.get("satellites") or [])
        xs.append(work)
        cells.append(n)
        ys.append(float(m["step_s"]))
    if len(set(cells)) > 1:  # rates per cell count give the efficiency per doubling
        r1 = _rate(
            [x for x, n in zip(xs, cells, strict=True) if n == 1],
            [y for y, n in zip(ys, cells, strict=True) if n == 1],
        )
        rn = [(n, x / y) for x, y, n in zip(xs, ys, cells, strict=True) if n > 1 and y > 0]
        if r1 and rn:
            e = [(r / r1 / n) ** (1 / math.log2(n)) for n, r in rn]
            eff = round(min(1.0, max(0.3, st.median(e))), 4)
    xe = [x / speedup(n, eff) for x, n in zip(xs, cells, strict=True)]
    final_of = [(k + 1) % updates_per_burst == 0 for k in range(len(metrics))]
    timed = all("compute_s" in m and "update_s" in m for m in metrics)
    publish_extra = 0.0
    if timed:  # the run timed both parts of a step: no line to fit
        compute = [float(m["compute_s"]) for m in metrics]
        update = [float(m["update_s"]) for m in metrics]
        inner = [u for u, f in zip(update, final_of, strict=True) if not f] or update
        a = st.fmean(inner)
        core = [
            (x * float(m["core_tokens"]) / float(m["n_tokens"]), float(m["core_compute_s"]))
            for x, m in zip(xs, metrics, strict=True)
            if m.get("core_compute_s") and m.get("core_tokens") and m.get("n_tokens")
        ]
        if len(core) == len(metrics) and sum(c for _, c in core) > 0:
            # one cell's speed from the core's own micro-steps; the run's compute times with
            # more cells then give the efficiency (joins, weight pulls, uneven micro-steps)
            r1 = sum(w for w, _ in core) / sum(c for _, c in core)
            e = [
                (x / r1 / c / n) ** (1 / math.log2(n))
                for x, c, n in zip(xs, compute, cells, strict=True)
                if n > 1 and c > 0
            ]
            if e:
                eff = round(min(1.0, max(0.3, st.median(e))), 4)
            slope = 1.0 / r1
        else:  # all cells' compute time over the work at the assumed efficiency
            slope = sum(compute) / sum(xe) if sum(xe) > 0 else 1.0
        finals_u = [u for u, f in zip(update, final_of, strict=True) if f]
        if finals_u and len(inner) < len(update):  # a final step also writes the version
            publish_extra = max(0.0, st.fmean(finals_u) - a)
    else:
        a, slope = _line(xe, ys)
    rate = 1.0 / slope
    gaps, finals, prev_t = [], [], 0.0
    for k, m in enumerate(metrics):
        gap = max(0.0, float(m["t"]) - prev_t - float(m["wait_s"]) - float(m["step_s"]))
        prev_t = float(m["t"])
        (finals if final_of[k] else gaps).append(gap)
    o = st.fmean(gaps) if gaps else 0.0
    publish = (max(0.0, st.fmean(finals) - o) if finals else 0.0) + publish_extra
    fit = {
        "train_tok_s_per_gpu": round(rate, 3),
        "optimizer_s": round(a + o, 4),
        "aggregate_s_per_cell": 0.0,
        "scaling_efficiency": eff,
    }
    return (
        fit,
        round(publish, 4),
        {
            "steps": len(ys),
            "step_intercept_s": round(a, 4),
            "between_steps_s": round(o, 4),
            "from": "timed steps" if timed else "step times",
        },
    )


def _rate(xs: list[float], ys: list[float]) -> float | None:
    return sum(xs) / sum(ys) if xs and sum(ys) > 0 else None


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``y = a + b x`` by least squares with ``a`` in [0, min y]; a flat ratio when the points
    do not determine a line."""
    n, mx, my = len(xs), st.fmean(xs), st.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if n >= 3 and sxx > 0:
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        a = my - b * mx
        if b > 0 and 0.0 <= a <= min(ys):
            return a, b
    return 0.0, sum(ys) / sum(xs)


# ------------------------------------------------------------------------ costs


def plans_before(decisions: list[dict[str, Any]], end_s: float) -> set[int]:
    """Ids of the plans started before ``end_s`` (seconds since the first dispatch: the
    controller's first ``BurstStarted`` decision)."""
    t0 = next((float(d["t"]) for d in decisions if d.get("trigger") == "BurstStarted"), None)
    if t0 is None:
        raise ConfigError("decisions.jsonl", "no BurstStarted decision: cannot place plans")
    return {
        int(d["plan_id"])
        for d in decisions
        if d.get("type") == "plan_start" and float(d["t"]) - t0 < end_s
    }


def fit_costs(
    steps: list[dict[str, Any]], publish_s: float, plans: set[int] | None = None
) -> tuple[dict[str, float], list[str]]:
    """Mean duration per cost field over the successful steps of ``plans`` (None: all)."""
    by_kind: dict[str, list[float]] = {}
    for s in steps:
        if s.get("ok", True) and (plans is None or int(s["plan_id"]) in plans):
            by_kind.setdefault(str(s["step"]), []).append(float(s["duration_s"]))
    out: dict[str, float] = {"weight_gb": 0.0, "sync_latency_s": publish_s, "kv_kb_per_token": 0.0}
    unseen = []
    for field, kinds in COST_KINDS.items():
        vals = [v for k in kinds for v in by_kind.get(k, [])]
        if vals:
            out[field] = round(st.fmean(vals), 4)
        else:
            unseen.append(field)
    return out, unseen


# ------------------------------------------------------------------------ the scenario


def scenario_from_run(
    run_dir: str | Path, describe: str | Path | None = None, trace: str | Path | None = None
) -> tuple[Scenario, dict[str, Any]]:
    """The scenario of ``describe`` (a config.yaml; default: the run's own) with every speed
    fitted on ``run_dir``; and the notes (fitted values and fit diagnostics). With ``trace``
    the run's executions are written there and replayed (the empirical workload) instead of
    drawn from the fitted class."""
    root = Path(run_dir)
    run = load_run(root)  # one-line error when it is not a run directory
    if not (root / "config.yaml").is_file():
        raise ConfigError(str(root), "no config.yaml: calibration needs the resolved config")
    own = check_known(load_yaml(root / "config.yaml", RunConfig), root / "config.yaml")
    cfg = check_known(load_yaml(describe, RunConfig), describe) if describe is not None else own
    execs = _required(
        root / "executions.jsonl",
        run_data.read_lines(root / "executions.jsonl", schema.ExecutionLine),
    )
    metrics = run.metrics or []
    if not metrics:
        raise ConfigError(str(root / "metrics.jsonl"), "missing or empty: no optimizer step")
    engine, engine_notes = fit_engine(execs)
    trainer, publish_s, trainer_notes = fit_trainer(
        metrics,
        execs,
        own.control.updates_per_burst,
        shared_host=not own.runtime.use_gpus and own.runtime.cell_cpus is None,
    )
    # Plans after the last publication are the runtime settling: no burst waits for them.
    plans = plans_before(
        read_jsonl(root / "decisions.jsonl", schema.DecisionLine), float(metrics[-1]["t"])
    )
    costs, unseen = fit_costs(read_jsonl(root / "steps.jsonl", schema.StepLine), publish_s, plans)
    workload = fit_workload(execs, cfg.runtime.execution_timeout_s)
    rt, ctl = cfg.runtime, cfg.control
    late = (
        dispatch_interval_s(execs, own.runtime.dispatch_interval_s)
        - own.runtime.dispatch_interval_s
    )
    interval = rt.dispatch_interval_s + late if rt.dispatch_interval_s > 0 else 0.0
    wl: dict[str, Any] = {"classes": [workload]}
    if trace is not None:
        lines = trace_lines(execs)
        Path(trace).write_text("".join(json.dumps(x) + "\n" for x in lines))
        wl["trace"] = str(trace)
    name = cfg.policy.name
    data = {
        "name": f"{cfg.name}-calibrated",
        "seed": cfg.seed,
        "description": f"fitted on {root} by tidal calibrate; describes {describe or root}",
        "cluster": cfg.cluster.model_dump(mode="json"),
        "control": ctl.model_dump(mode="json"),
        "sim": {"tick_s": rt.tick_s, "dispatch_interval_s": round(interval, 4)},
        "workload": wl,
        "engine": engine,
        "trainer": trainer,
        "costs": costs,
        "policies": [_spec(cfg)],
        "policy_modules": [cfg.policy.module] if cfg.policy.module else [],
        "policy_args": {name: dict(cfg.policy.args)} if cfg.policy.args else {},
        "profiles": {
            name: {
                "dispatch": "burst",
                "trainer": "batch",
                "sync": "keep",
                "kv_handoff": ctl.kv_handoff,
                "staleness_threshold": 0.0,
            }
        },
    }
    from tidal.config import validate_model

    sc = validate_model(Scenario, data, "scenario")
    notes = {
        "engine": engine_notes,
        "trainer": trainer_notes,
        "publish_s": publish_s,
        "dispatch_late_s": round(late, 4),
        "costs_not_observed": unseen,
        "executions": len(execs),
    }
    return sc, notes


def _spec(cfg: RunConfig) -> str:
    args = ",".join(f"{k}={v}" for k, v in sorted(cfg.policy.args.items()))
    return f"{cfg.policy.name}:{args}" if args else cfg.policy.name
