"""What ``tidal run`` checks before it starts anything, and ``tidal check`` runs too.

In: a validated ``RunConfig`` and what this machine has (its cores and GPUs, ``Machine``; on a
Ray cluster, once connected, the cluster's nodes). Out: nothing, or one ``ConfigError`` naming
the field: the policy and the admission rule (``control.factory.checked_policy``: a config
built in code is checked as one read from a file is; the policy built here, once, unless the
caller built it), the run's own rules (``wiring.check_config``:
bursts, quota, backends and their venvs), the model (a directory that exists and holds a
model; its context holds ``runtime.max_tokens``), the machine (``runtime.use_gpus`` without a
GPU, engine bundles beyond the local Ray's CPUs or GPUs, ``runtime.fsdp_ranks`` beyond the
cores) and, for a cluster run, ``check_cluster`` after Ray connects and before any placement.
No Ray import here: the cluster is read from the values Ray's ``nodes()`` returns. Invariant: a
config these checks pass does not fail later for a reason they could have seen.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.config import RunConfig
from tidal.errors import ConfigError

if TYPE_CHECKING:
    from tidal.agents.workload import Workload
    from tidal.control.policy import Policy

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length")


@dataclass(frozen=True)
class Machine:
    """What this host offers a one-machine run."""

    cores: int
    gpus: int

    @classmethod
    def here(cls) -> Machine:
        try:
            import torch

            gpus = torch.cuda.device_count()
        except ImportError:  # a simulator-only install
            gpus = 0
        return cls(len(os.sched_getaffinity(0)), gpus)


@dataclass(frozen=True)
class Checked:
    """What the checks built, each once per run: the ``task:`` section's workload (None: the
    built-in task) and the policy the controller runs."""

    workload: Workload | None
    policy: Policy


def check_run(
    cfg: RunConfig, machine: Machine | None = None, policy: Policy | None = None
) -> Checked:
    """Every check ``tidal run`` makes before it starts Ray (``ConfigError`` on the first).
    ``policy``: the run's, when the caller built it (``checked_policy``); else built here. Out:
    the workload built by the check (``wiring.check_config``) and the policy."""
    from tidal.control.factory import checked_policy
    from tidal.runtime.wiring import check_config

    if policy is None:  # the policy's module, name, arguments and the admission rule
        policy = checked_policy(cfg)
    workload = check_config(cfg)
    check_backends(cfg)
    context = check_model(cfg)
    if context is not None and cfg.runtime.max_tokens >= context:
        raise ConfigError(
            "runtime.max_tokens",
            f"{cfg.runtime.max_tokens} tokens per call "
            f"leave no room for a prompt in the model's context of {context} "
            "tokens",
        )
    check_trainer(cfg)
    if cfg.runtime.ray_address is None:
        check_machine(cfg, machine or Machine.here())
    return Checked(workload, policy)


def model_context(model_dir: Path) -> int | None:
    """The context length a model directory's ``config.json`` declares (None: it names none)."""
    try:
        data = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            "runtime.model", f"{model_dir}/config.json: unreadable ({type(exc).__name__})"
        ) from None
    for key in CONTEXT_KEYS:
        if isinstance(data.get(key), int):
            return data[key]
    return None


def check_model(cfg: RunConfig) -> int | None:
    """The model the run would serve exists and is a model; returns its context length in
    tokens (the vLLM bound applied), or None when it cannot be known without converting."""
    from tidal.models.fetch import KNOWN, cached_path

    rt = cfg.runtime
    if rt.model == "tiny":
        context: int | None = rt.tiny_max_seq_len
    elif rt.model in KNOWN:  # converted on first use; its context once it is
        cached = cached_path(rt.model)
        context = model_context(cached) if (cached / "config.json").is_file() else None
    else:
        path = Path(rt.model)
        if not path.is_dir():
            raise ConfigError(
                "runtime.model",
                f"{rt.model}: no such directory (give 'tiny', "
                f"a bundled model ({', '.join(KNOWN)}) or a model directory)",
            )
        if not (path / "config.json").is_file():
            raise ConfigError(
                "runtime.model", f"{rt.model}: not a model directory (no config.json)"
            )
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise ConfigError(
                "runtime.model", f"{rt.model}: no weights (*.safetensors) in the model directory"
            )
        context = model_context(path)
    from tidal.backends import serving_backends

    if any(b.name == "vllm" for b in serving_backends(cfg)):  # --max-model-len
        context = min(context or rt.vllm.max_model_len, rt.vllm.max_model_len)
    return context


def check_backends(cfg: RunConfig) -> None:
    """The venv named for a vLLM or SGLang backend has that package installed (looked up,
    not imported: a fraction of a second)."""
    import subprocess

    from tidal.backends import serving_backends

    rt = cfg.runtime
    for backend in serving_backends(cfg):
        if backend.package is None or backend.python_field is None:
            continue
        field = f"runtime.{backend.python_field.replace('_', '.', 1)}"  # runtime.vllm.python
        module = backend.package
        exe = getattr(rt, f"resolved_{backend.python_field}")()
        probe = [
            exe,
            "-c",
            "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)",
            module,
        ]
        try:
            found = subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ConfigError(field, f"{exe}: cannot run ({type(exc).__name__})") from None
        if not found:
            raise ConfigError(
                field,
                f"{exe} has no {module} installed (a '{backend.name}' engine "
                "backend needs the python of a venv with it)",
            )


def check_trainer(cfg: RunConfig) -> None:
    """More than one rank per cell needs FSDP2 (``runtime.fsdp`` not 'off')."""
    rt = cfg.runtime
    if rt.fsdp_ranks > 1 and rt.fsdp == "off":
        raise ConfigError(
            "runtime.fsdp_ranks",
            "more than one rank per cell needs FSDP2 "
            "(runtime.fsdp 'auto' or 'on' on a CPU trainer)",
        )


def _engines_need(cfg: RunConfig) -> tuple[int, float, float]:
    """Engine bundles, their CPUs and their GPUs in all (``placement.bundles``)."""
    cl, rt = cfg.cluster, cfg.runtime
    gpus = [cl.standalone_gpus] * cl.standalone_count + [s.gpus for s in cl.cell_specs()]
    return len(gpus), len(gpus) * rt.cpus_per_engine, float(sum(gpus)) if rt.use_gpus else 0.0


def check_machine(cfg: RunConfig, machine: Machine) -> None:
    """A one-machine run fits this machine and the local Ray it starts."""
    rt = cfg.runtime
    n, cpus, gpus = _engines_need(cfg)
    if rt.cpus_per_engine > rt.ray_num_cpus or cpus > rt.ray_num_cpus:
        raise ConfigError(
            "runtime.cpus_per_engine",
            f"{n} engines x {rt.cpus_per_engine:g} "
            f"CPUs = {cpus:g} CPUs, more than the local Ray's "
            f"{rt.ray_num_cpus} (runtime.ray_num_cpus)",
        )
    # GPUs declared to the local Ray (runtime.ray_num_gpus) are the user's word: Ray places
    # by them (the tests declare some on a CPU machine); else those torch sees
    have_gpus = machine.gpus if rt.ray_num_gpus is None else rt.ray_num_gpus
    if rt.use_gpus and have_gpus == 0:
        raise ConfigError(
            "runtime.use_gpus",
            "this machine has no GPU that torch sees (or "
            "runtime.ray_num_gpus is 0); set runtime.use_gpus: false",
        )
    if gpus > have_gpus:
        raise ConfigError(
            "runtime.use_gpus",
            f"the engines reserve {gpus:g} GPUs (cluster.*_gpus), the local Ray has {have_gpus}",
        )
    if rt.fsdp != "off" and rt.fsdp_ranks > machine.cores:
        raise ConfigError(
            "runtime.fsdp_ranks",
            f"{rt.fsdp_ranks} ranks (processes) per "
            f"training cell on a machine with {machine.cores} cores: at most "
            f"{machine.cores}",
        )


def check_cluster(cfg: RunConfig, nodes: list[dict[str, Any]]) -> None:
    """A cluster run (``--address``) fits the cluster's alive nodes (Ray's ``nodes()``): the
    engine bundles in all, and ``fsdp_ranks`` on the largest node."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    rt = cfg.runtime
    n, cpus, gpus = _engines_need(cfg)
    have_cpus = sum(r.get("CPU", 0.0) for r in alive)
    have_gpus = sum(r.get("GPU", 0.0) for r in alive)
    if cpus > have_cpus or rt.cpus_per_engine > max(
        (r.get("CPU", 0.0) for r in alive), default=0.0
    ):
        raise ConfigError(
            "runtime.cpus_per_engine",
            f"{n} engines x {rt.cpus_per_engine:g} "
            f"CPUs; the cluster's {len(alive)} nodes have {have_cpus:g} CPUs",
        )
    if gpus > have_gpus:
        raise ConfigError(
            "runtime.use_gpus",
            f"the engines reserve {gpus:g} GPUs (cluster.*_gpus); the cluster has {have_gpus:g}",
        )
    most = max((int(r.get("CPU", 0.0)) for r in alive), default=0)
    if rt.fsdp != "off" and rt.fsdp_ranks > most:
        raise ConfigError(
            "runtime.fsdp_ranks",
            f"{rt.fsdp_ranks} ranks (processes) per "
            f"training cell; the cluster's largest node has {most} CPUs",
        )
