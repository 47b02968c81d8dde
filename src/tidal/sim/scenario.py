"""Simulator scenarios: the YAML schema, lookup by name, per-policy run configs, scaling.

In: a scenario name (a file in ``configs/scenarios/``, shipped as package data too) or a path.
Out: a validated ``Scenario`` (pydantic, ``extra="forbid"``); for each policy spec a
``RunConfig`` for the real control plane plus the ``Mechanics`` it runs with: the scenario's
``profiles`` entry for the policy, else the set ``mechanics`` names, else what the policy
declares (``tidal.control.mechanics``; never guessed from its name). ``policy_modules`` names
the user's modules that register policies (loaded when the scenario is validated).

Every number here is a modelling assumption, named with its unit; REFERENCE.md §3 gives the
calibration guidance the shipped scenarios follow.

Over 500 lines since the tree took ``ruff format``'s one-argument-per-line style (463 before):
one model per scenario section, each with its units and validation, read as one schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from tidal.config import (
    ClusterConfig,
    ControlConfig,
    FieldError,
    PolicyConfig,
    RunConfig,
    Strict,
    read_yaml_mapping,
    validate_file_data,
    validate_model,
)
from tidal.control.factory import check_control, check_policy
from tidal.control.mechanics import MECHANICS_SETS, Mechanics
from tidal.control.policy import policy_mechanics
from tidal.errors import ConfigError
from tidal.plugins import load_policies
from tidal.specs import parse_policy_spec, resolved


class Dist(Strict):
    """A capped lognormal: ``median * exp(sigma * z)``, clipped to [lo, cap]. Give either its
    ``median`` or its ``mean`` (the mean after clipping, e.g. a run's published mean response
    length): the median is then solved for from the mean, ``sigma``, ``cap`` and ``lo``."""

    median: float = Field(..., ge=0.0)
    sigma: float = Field(0.0, ge=0.0)
    cap: float | None = Field(None, gt=0.0)
    lo: float = Field(0.0, ge=0.0)
    mean: float | None = Field(
        None,
        gt=0.0,
        description="the clipped mean the median is solved from (instead of giving the median)",
    )

    @model_validator(mode="before")
    @classmethod
    def _median_from_mean(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("mean") is None:
            return data
        mean, sigma = data["mean"], data.get("sigma", 0.0)
        cap, lo = data.get("cap"), data.get("lo", 0.0)
        for key, v in (("mean", mean), ("sigma", sigma), ("lo", lo)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{key} must be a number")
        if mean < lo or (cap is not None and mean > cap):
            raise ValueError(f"mean {mean} must lie within [lo, cap]")
        median = median_for_mean(float(mean), float(sigma), cap, float(lo))
        given = data.get("median")
        if given is not None and abs(given - median) > 1e-6 * max(1.0, median):
            raise ValueError(
                f"give median or mean, not both (median {given} does not give mean {mean})"
            )
        return {**data, "median": median}


def clipped_lognormal_mean(
    median: float, sigma: float, cap: float | None, lo: float = 0.0
) -> float:
    """``E[clip(median * exp(sigma * Z), lo, cap)]`` for a standard normal ``Z``."""
    import math

    def phi(x: float) -> float:
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    if median <= 0:
        return lo
    if sigma == 0:
        return min(max(median, lo), cap if cap is not None else math.inf)
    up = math.inf if cap is None else math.log(cap / median) / sigma
    down = -math.inf if lo <= 0 else math.log(lo / median) / sigma
    # E[X; down < z < up] = median * e^(s^2/2) * (Phi(up - s) - Phi(down - s))
    body = median * math.exp(sigma * sigma / 2) * (phi(up - sigma) - phi(down - sigma))
    return body + (0.0 if cap is None else cap * (1 - phi(up))) + lo * phi(down)


def median_for_mean(mean: float, sigma: float, cap: float | None, lo: float = 0.0) -> float:
    """The median whose clipped lognormal has this mean (bisection in log space)."""
    import math

    lo_m, hi_m = math.log(max(1e-9, mean)) - 20 * sigma - 1, math.log(max(1e-9, mean)) + 1
    for _ in range(200):
        mid = (lo_m + hi_m) / 2
        if clipped_lognormal_mean(math.exp(mid), sigma, cap, lo) < mean:
            lo_m = mid
        else:
            hi_m = mid
    return round(math.exp((lo_m + hi_m) / 2), 3)


class Drift(Strict):
    """A linear trend over the run, in optimizer steps' worth of groups drawn (draw order, so
    every policy sees the same workload): the class's medians are multiplied by
    ``max(floor, 1 + growth * groups_drawn / batch_groups)``."""

    decode_growth_per_step: float = Field(
        0.0, description="relative growth of the decode median per optimizer step"
    )
    turns_growth_per_step: float = Field(
        0.0, description="relative growth of the turns median per optimizer step"
    )
    floor: float = Field(0.1, gt=0.0, description="smallest multiplier")


class ExecutionClass(Strict):
    """One kind of execution (math answer, search agent, coding agent...)."""

    name: str = "default"
    weight: float = Field(1.0, gt=0.0, description="share of groups of this class")
    turns: Dist = Field(default_factory=lambda: Dist(median=1.0))
    decode_tokens: Dist = Field(
        default_factory=lambda: Dist(median=9000.0, sigma=0.75, cap=64000.0)
    )
    tool_s: Dist = Field(default_factory=lambda: Dist(median=0.0))
    tool_output_tokens: Dist = Field(default_factory=lambda: Dist(median=0.0))
    prompt_tokens: int = Field(300, ge=0)
    group_share: float = Field(
        0.3, ge=0.0, le=1.0, description="share of log-variance common to a GRPO group"
    )
    timeout_s: float | None = Field(None, gt=0.0)
    success_rate: float = Field(0.5, ge=0.0, le=1.0)
    drift: Drift | None = Field(None, description="lengths that change over the run")


class WorkloadConfig(Strict):
    classes: list[ExecutionClass] = Field(default_factory=lambda: [ExecutionClass()])
    trace: str | None = Field(None, description="JSONL trace to replay instead of classes")


class EngineConfig(Strict):
    decode_tok_s_per_gpu: float = Field(
        800.0, gt=0.0, description="aggregate decode throughput per GPU"
    )
    seq_cap_tok_s: float = Field(100.0, gt=0.0, description="per-sequence speed cap")
    prefill_equiv: float = Field(
        0.02, ge=0.0, description="decode-token equivalents per prefilled token"
    )
    kv_gpu_s_per_ctx_token: float = Field(
        0.0,
        ge=0.0,
        description="GPU-seconds a decoded token costs per "
        "token of its context (reading the KV "
        "cache; set by the cost model)",
    )
    host_tok_s: float | None = Field(
        None,
        gt=0.0,
        description="every engine shares one host's decode throughput (CPU runs; None: no sharing)",
    )


class TrainerConfig(Strict):
    train_tok_s_per_gpu: float = Field(
        1600.0, gt=0.0, description="training tokens/s per GPU on one cell"
    )
    scaling_efficiency: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="share of linear speed-up kept per doubling of training cells",
    )
    optimizer_s: float = Field(2.0, ge=0.0, description="one optimizer update")
    aggregate_s_per_cell: float = Field(
        0.5, ge=0.0, description="gradient aggregation per extra cell"
    )
    mini_batch_groups: int | None = Field(
        None,
        ge=1,
        description="groups per optimizer "
        "update (verl's ppo_mini_batch_size): a step of "
        "batch_groups runs ceil(batch / mini) updates "
        "(None: one update per step)",
    )
    host_gb_s: float = Field(
        16.0,
        gt=0.0,
        description="host link of a training GPU (GB/s; "
        "set by the cost model): an offloading trainer's transfers",
    )
    weight_passes: int = Field(
        4,
        ge=1,
        description="passes over the weights per trained "
        "token (forward, recompute, backward, old log-probs; set by "
        "the cost model)",
    )
    attn_tokens_per_pair: float = Field(
        0.0,
        ge=0.0,
        description="training work of one causal "
        "attention (token, earlier token) pair in token "
        "equivalents (set by the cost model): a sequence of L "
        "tokens is L + this * L**2 / 2 tokens of work",
    )
    fixed_step_s: float = Field(
        0.0,
        ge=0.0,
        description="fixed cost of every trainer step "
        "(reward, advantage, launches, step and weight-update "
        "overheads), paid on the training GPUs",
    )


def train_work_tokens(tokens: float, trainer: TrainerConfig) -> float:
    """Training work of one sequence of ``tokens`` tokens in token equivalents: its tokens
    plus its causal attention pairs (``tokens**2 / 2``) at ``attn_tokens_per_pair``."""
    return tokens + trainer.attn_tokens_per_pair * tokens * tokens / 2


class Efficiencies(Strict):
    """The only fitted numbers of the cost model (``tidal calibrate --published``)."""

    decode: float = Field(
        ...,
        gt=0.0,
        le=1.0,
        description="share of the HBM-bandwidth / compute roofline a decode step gets",
    )
    mfu: float = Field(
        ..., gt=0.0, le=1.0, description="model FLOPs utilization of training and prefill"
    )
    link: float = Field(
        0.25,
        gt=0.0,
        le=1.0,
        description="share of link bandwidth weight syncs, offload and KV moves get",
    )


class CostModelConfig(Strict):
    """Speeds and costs from first principles (``tidal.sim.perf``) instead of given numbers:
    ``engine.decode_tok_s_per_gpu``, ``seq_cap_tok_s``, ``prefill_equiv``,
    ``trainer.train_tok_s_per_gpu``, ``optimizer_s`` and the sync / offload / KV costs are
    derived (whatever the scenario states for them is replaced)."""

    gpu: str | dict[str, Any] = Field(
        ...,
        description="a GPU of tidal/sim/data/hardware.yaml, "
        "or an accelerator defined inline with the same fields "
        "(bf16_tflops, hbm_tb_s, hbm_gb, nvlink_gb_s, host_gb_s, "
        "network_gb_s, allreduce_latency_s)",
    )
    model: str = Field(..., description="a shipped model name or an HF config.json path")
    engine_tp: int = Field(
        8,
        ge=1,
        description="GPUs per engine replica (tensor parallel); "
        "a cell or engine of g GPUs runs g / tp",
    )
    mem_fraction: float = Field(
        0.85, gt=0.0, le=1.0, description="HBM share of a standalone engine (weights + KV)"
    )
    hybrid_mem_fraction: float = Field(
        0.6, gt=0.0, le=1.0, description="HBM share of a hybrid cell's engine"
    )
    step_overhead_s: float = Field(
        0.003, ge=0.0, description="per decode step: scheduling, launches"
    )
    optimizer_overhead_s: float = Field(
        2.0, ge=0.0, description="fixed part of a step's update (gather, launch)"
    )
    recompute: bool = Field(True, description="activation checkpointing: one more forward")
    old_log_prob: bool = Field(True, description="a forward pass for the old log-probs")
    ref_log_prob: bool = Field(False, description="a forward pass of the reference model")
    nominal_context_tokens: int = Field(
        4000, ge=0, description="context at which prefill is priced in decode-token equivalents"
    )
    efficiency: Efficiencies

    @model_validator(mode="after")
    def _known(self) -> CostModelConfig:
        from tidal.sim.profiles import load_gpu, load_model

        try:
            load_gpu(self.gpu)
            load_model(self.model)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self


class CostConfig(Strict):
    weight_gb: float = Field(70.0, ge=0.0, description="bytes of one weight copy (GB)")
    sync_latency_s: float = Field(1.0, ge=0.0)
    sync_gb_s: float = Field(12.5, gt=0.0, description="weight-sync bandwidth (GB/s)")
    load_weights_s: float | None = Field(
        None,
        ge=0.0,
        description="a waking cell's weight load (None: sync_s, the burst-end publication)",
    )
    sleep_s: float = Field(3.0, ge=0.0)
    wake_s: float = Field(3.0, ge=0.0)
    offload_s: float = Field(5.0, ge=0.0)
    onload_s: float = Field(5.0, ge=0.0)
    admission_s: float = Field(0.1, ge=0.0)
    reroute_s: float = Field(0.5, ge=0.0)
    release_s: float = Field(1.0, ge=0.0)
    kv_kb_per_token: float = Field(80.0, ge=0.0)
    kv_gb_s: float = Field(25.0, gt=0.0)
    kv_latency_s: float = Field(0.2, ge=0.0)

    @property
    def sync_s(self) -> float:
        return self.sync_latency_s + self.weight_gb / self.sync_gb_s


class SimConfig(Strict):
    staleness_threshold: float = Field(0.5, ge=0.0, description="verl dispatch budget slack")
    max_policy_lag: int | None = Field(
        None, ge=1, description="executions older than this many versions restart at a sync"
    )
    tick_s: float = Field(10.0, gt=0.0)
    dispatch_interval_s: float = Field(
        0.0,
        ge=0.0,
        description="burst dispatch: groups this far apart (0: the whole quota at once)",
    )
    step_failure_rate: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="probability that a plan step fails (fault injection; seeded)",
    )
    max_virtual_s: float = Field(30 * 86400.0, gt=0.0)
    max_inflight_groups: int | None = Field(
        None,
        ge=1,
        description="admission by a total "
        "pool: a group is dispatched only while fewer "
        "than this many are in flight or waiting to be "
        "trained (None: the per-version budget alone)",
    )
    micro_batch_tokens: int = Field(
        65536,
        ge=1,
        description="tokens per GPU per micro-batch "
        "pass (verl's ppo_max_token_len_per_gpu); prices the "
        "per-pass parameter transfer of an offloading trainer",
    )


class Scenario(Strict):
    name: str
    description: str = ""
    seed: int = 0
    cluster: ClusterConfig
    control: ControlConfig
    sim: SimConfig = Field(default_factory=SimConfig)
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    costs: CostConfig = Field(default_factory=CostConfig)
    policies: list[str] = Field(
        default_factory=lambda: ["static", "verl-default", "waterlevel", "tidal"]
    )
    policy_args: dict[str, dict[str, Any]] = Field(default_factory=dict)
    profiles: dict[str, Mechanics] = Field(default_factory=dict)
    mechanics: str | None = Field(
        None, description="run every policy with this system's mechanics (None: each its own)"
    )
    policy_modules: list[str] = Field(
        default_factory=list,
        description="the user's modules "
        "that register policies (.py paths, relative to the "
        "scenario file, or dotted module names)",
    )
    costmodel: CostModelConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        try:
            check_control(self.control)
        except ConfigError as exc:  # named under the scenario's own place, as its fields are
            raise FieldError(exc.field, exc.message) from None
        if self.control.bursts is None:
            raise ValueError("control.bursts must be set: a simulation needs an end")
        cm, cl = self.costmodel, self.cluster
        if cm is not None:
            sizes = [c.gpus for c in cl.cell_specs()]
            sizes += [cl.standalone_gpus] if cl.standalone_count else []
            if any(g % cm.engine_tp for g in sizes):
                raise ValueError(
                    f"costmodel.engine_tp: {cm.engine_tp} GPUs per replica must "
                    f"divide every cell and engine (GPUs: {sorted(set(sizes))})"
                )
        pool = self.sim.max_inflight_groups
        if pool is not None and pool < self.control.batch_groups:
            raise ValueError(
                f"sim.max_inflight_groups: {pool} groups in flight can never fill "
                f"a step of {self.control.batch_groups} (control.batch_groups)"
            )
        if self.mechanics is not None and self.mechanics not in MECHANICS_SETS:
            raise ValueError(
                f"mechanics: unknown {self.mechanics!r} (known: {', '.join(MECHANICS_SETS)})"
            )
        return self

    @field_validator("policy_modules")
    @classmethod
    def _load_modules(cls, v: list[str]) -> list[str]:
        v = [resolved(m) for m in v]
        try:
            load_policies(v, "policy_modules")
        except ConfigError as exc:
            raise ValueError(exc.message) from None
        return v

    @property
    def total_steps(self) -> int:
        assert self.control.bursts is not None
        return self.control.bursts * self.control.updates_per_burst

    def profile_for(self, policy: str) -> Mechanics:
        """The mechanics ``policy`` runs with here: the scenario's ``profiles`` entry, else
        the ``mechanics`` set, else the policy's own declaration (an unknown policy is an
        ``UnknownPolicyError``)."""
        if policy in self.profiles:
            return self.profiles[policy]
        if self.mechanics is not None:
            return MECHANICS_SETS[self.mechanics]
        return policy_mechanics(policy)

    def for_profile(self, profile: Mechanics) -> Scenario:
        """The scenario as a policy with ``profile`` runs it: the trainer's passes follow
        the profile's ``old_log_prob`` when it sets one."""
        cm = self.costmodel
        if cm is None or profile.old_log_prob is None or profile.old_log_prob == cm.old_log_prob:
            return self
        return self.model_copy(
            update={"costmodel": cm.model_copy(update={"old_log_prob": profile.old_log_prob})}
        )

    def staleness_for(self, profile: Mechanics) -> float:
        """The staleness budget a policy with ``profile`` runs with here: the profile's, else
        the scenario's ``control.staleness_threshold``, else its ``sim.staleness_threshold``
        (``run_config`` puts it into the run config's ``control.staleness_threshold``, the
        one key the simulator and ``tidal run`` read)."""
        if profile.staleness_threshold is not None:
            return profile.staleness_threshold
        if self.control.staleness_threshold is not None:
            return self.control.staleness_threshold
        return self.sim.staleness_threshold

    def run_config(self, spec: str) -> tuple[RunConfig, Mechanics]:
        """The control-plane config for one ``NAME[:ARGS]`` policy spec on this scenario.

        Arguments given in the spec replace the scenario's defaults for that policy.
        """
        name, args = parse_policy_spec(spec)
        merged = {**self.policy_args.get(name, {}), **args}
        profile = self.profile_for(name)
        policy = validate_model(PolicyConfig, {"name": name, "args": merged}, "policy")
        control = self.control.model_copy(
            update={
                "kv_handoff": profile.kv_handoff,
                "staleness_threshold": self.staleness_for(profile),
            }
        )
        if control.admission == "off":
            control = control.model_copy(update={"admission": profile.admission})
        elif profile.admission != control.admission:  # the row's label names what runs
            profile = profile.model_copy(update={"admission": control.admission})
        cfg = check_policy(
            validate_model(
                RunConfig,
                {
                    "name": f"{self.name}/{spec}",
                    "seed": self.seed,
                    "cluster": self.cluster.model_dump(mode="json"),
                    "control": control.model_dump(mode="json"),
                    "policy": policy.model_dump(mode="json"),
                },
            )
        )
        return cfg, profile

    def scaled(
        self, factor: float = 1.0, bursts: int | None = None, cells: int | None = None
    ) -> Scenario:
        """A copy with cluster and batch scaled by ``factor`` (cells, standalone engines and
        batch groups) and optionally another number of bursts."""
        cl = self.cluster
        n_cells = cells if cells is not None else max(1, round(len(cl.cell_specs()) * factor))
        specs = cl.cell_specs()
        new_cells = [specs[min(i * len(specs) // n_cells, len(specs) - 1)] for i in range(n_cells)]
        cluster = cl.model_copy(
            update={
                "cells": new_cells,
                "cell_count": n_cells,
                "standalone_count": max(0, round(cl.standalone_count * factor)),
                "start_training": None,
            }
        )
        ctrl = self.control
        control = ctrl.model_copy(
            update={
                "batch_groups": max(1, round(ctrl.batch_groups * factor)),
                "quota_groups": (
                    None if ctrl.quota_groups is None else max(1, round(ctrl.quota_groups * factor))
                ),
                "bursts": bursts if bursts is not None else ctrl.bursts,
            }
        )
        data = self.model_dump(mode="json")
        data["cluster"] = cluster.model_dump(mode="json")
        data["control"] = control.model_dump(mode="json")
        return validate_model(Scenario, data, "scenario")


# ------------------------------------------------------------------------ lookup


def scenario_dirs() -> list[Path]:
    """Where scenario names are looked up: the package data, then ``configs/scenarios`` of a
    source checkout (the working directory's, then the one beside the package)."""
    here = Path(__file__).resolve()
    dirs = [
        here.parent.parent / "configs" / "scenarios",
        Path.cwd() / "configs" / "scenarios",
        here.parents[3] / "configs" / "scenarios" if len(here.parents) > 3 else None,
    ]
    out: list[Path] = []
    for d in dirs:
        if d is not None and d.is_dir() and d not in out:
            out.append(d)
    return out


def available() -> list[str]:
    names: set[str] = set()
    for d in scenario_dirs():
        names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def resolve(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise ConfigError("scenario", f"{p}: no such scenario file")
        return p
    for d in scenario_dirs():
        cand = d / f"{name_or_path}.yaml"
        if cand.is_file():
            return cand
    raise ConfigError(
        "scenario", f"unknown scenario {name_or_path!r} (known: {', '.join(available()) or 'none'})"
    )


def load(name_or_path: str) -> Scenario:
    path = resolve(name_or_path)
    data = read_yaml_mapping(path)
    wl = data.get("workload") or {}
    if isinstance(wl, dict) and wl.get("trace") and not Path(wl["trace"]).is_absolute():
        wl["trace"] = str((path.parent / wl["trace"]).resolve())
    mods = data.get("policy_modules")
    if isinstance(mods, list):
        data["policy_modules"] = [
            str((path.parent / m).resolve()) if isinstance(m, str) and m.endswith(".py") else m
            for m in mods
        ]
    return validate_file_data(Scenario, data, path)
