"""A standalone engine served by a real vLLM OpenAI server (``runtime.standalone_backend:
vllm``); cells keep the built-in engine.

In: the same calls as ``EngineHost`` from the driver and the supervisor (``start``, ``describe``,
``load_weights``, ``kill_engine``, ``stop``). Out: the server's URL; the engine joins the proxy
with backend ``vllm`` (``tidal.serving.vllm_adapter``). The server runs from the vLLM venv's
python (``runtime.vllm.python``, default ``$TIDAL_VLLM_PYTHON``) on a free port of its node's
address (the proxy reaches it from any node of a Ray cluster), in its own process group (vLLM
starts an engine-core child: both end together), with ``VLLM_SERVER_DEV_MODE=1``, tidal's
worker extension (``tidal.training.vllm_sync``), tidal's KV connector (``kv_dir``: one
shared-memory folder per run and node, so a call drained off one of the run's vLLM servers keeps
its KV at another of the run's servers, on this node or carried from another:
``serving.vllm_kv``, ``serving.vllm_kv_routes``) and, with the run's token, tidal's guard in
front of every route (``tidal.serving.server_guard``: vLLM's ``--api-key`` would leave its
control routes open). A published version is loaded into the live server without a restart:
generation paused, every worker reads the ``FilePublisher`` file (the driver's on its node;
elsewhere the bytes Ray's object store brought, written to the node's ``/dev/shm`` by
``load_weights_blob``), the server's label becomes the version (invariant 6: the proxy tags
each later token with it), generation resumed. Its log is ``logs/engine-<name>.log``. A
standalone engine never sleeps.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from tidal.errors import TidalError
from tidal.runtime.cell import EngineHost, RuntimeFailure, adopt_token
from tidal.runtime.server_process import ServerProcess, check_extra_args, describe_server

if TYPE_CHECKING:
    from tidal.config import RunConfig, RuntimeConfig
    from tidal.runtime.ray_types import ObjectRef

SERVED_NAME = "tidal"


# the flags of ``vllm serve`` that tidal sets on each server -> what sets them instead
VLLM_OWNED = {
    "--model": "runtime.model",
    "--served-model-name": "the proxy's model name",
    "--host": "the node's address",
    "--port": "a free port",
    "--max-model-len": "runtime.vllm.max_model_len",
    "--max-num-seqs": "runtime.engine_max_batch",
    "--dtype": "runtime.vllm.dtype",
    "--tensor-parallel-size": "runtime.vllm.tensor_parallel",
    "-tp": "runtime.vllm.tensor_parallel",
    "--enforce-eager": "runtime.vllm.cuda_graphs",
    "--kv-cache-memory-bytes": "runtime.vllm.kv_cache_gb",
    "--worker-extension-cls": "tidal's weight loading",
    "--middleware": "the run's token guard and the KV folder's routes",
    "--api-key": "the run's token guard",
    "--enable-sleep-mode": "a cell's role switches",
    "--kv-transfer-config": "tidal's KV handoff between the run's vLLM servers",
}


def kv_dir(run_dir: Path, node: str | None = None) -> str:
    """The node's shared-memory folder where the run's vLLM servers hand KV over: one per run
    and Ray node (a hash of both), so two runs never see each other's exports and servers on
    other nodes get theirs carried (``serving.vllm_kv_routes``), even where nodes share a
    filesystem (a test cluster of one machine)."""
    import hashlib

    name = f"{run_dir.resolve()}|{node or ''}"
    return f"/dev/shm/tidal-kv-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def vllm_settings(rt: RuntimeConfig) -> dict[str, Any]:
    """What a ``VLLMEngineHost`` needs from ``RuntimeConfig`` (validated: ``ConfigError``;
    ``vllm.args`` by ``check``)."""
    return {
        "python": rt.resolved_vllm_python(),
        "kv_cache_gb": rt.vllm.kv_cache_gb,
        "max_model_len": rt.vllm.max_model_len,
        "device": rt.device if rt.use_gpus else "cpu",
        "tensor_parallel": rt.vllm.tensor_parallel,
        "dtype": rt.vllm.dtype,
        "cuda_graphs": rt.vllm.cuda_graphs,
        "args": list(rt.vllm.args),
    }


def serves_bfloat16(rt: RuntimeConfig) -> bool:
    """Whether this run's vLLM servers hold their weights in bfloat16: ``runtime.vllm.dtype``
    bfloat16, or 'auto' on GPUs (``serve_args``: engines with GPUs run on CUDA)."""
    if rt.vllm.dtype == "auto":
        return rt.use_gpus and rt.device != "cpu"
    return rt.vllm.dtype == "bfloat16"


def cpu_thread_bind(tp: int, cpus: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` CPU workers on ``cpus`` (the engine's allowed
    CPUs): contiguous equal shares, one per worker (``0|1`` for two on two CPUs). vLLM's own
    ``auto`` binds one NUMA node per worker and refuses more workers than nodes, which a
    one-node host always has. Fewer CPUs than workers is one ``RuntimeFailure`` line."""
    cpus = sorted(cpus)
    if tp > len(cpus):
        raise RuntimeFailure(
            f"runtime.vllm.tensor_parallel: {tp} CPU workers, but this "
            f"engine may use {len(cpus)} CPUs ({cpus})"
        )
    share = len(cpus) // tp
    return "|".join(",".join(str(c) for c in cpus[i * share : (i + 1) * share]) for i in range(tp))


def tensor_parallel(settings: dict[str, Any], device: str, gpu_ids: list[str]) -> int:
    """The engine's ``--tensor-parallel-size``: the setting, else every GPU Ray gave the engine
    on CUDA (1 without GPU ids: outside Ray, the visible GPUs), 1 on the CPU. A size the
    engine's GPUs cannot hold is one ``RuntimeFailure`` line."""
    cuda = device.startswith("cuda")
    tp = settings.get("tensor_parallel") or (max(len(gpu_ids), 1) if cuda else 1)
    if cuda and gpu_ids and tp > len(gpu_ids):
        raise RuntimeFailure(
            f"runtime.vllm.tensor_parallel: {tp} GPUs per vLLM engine, but "
            f"Ray gave this engine {len(gpu_ids)} ({gpu_ids}): raise "
            "cluster.cell_gpus / standalone_gpus or lower it"
        )
    return tp


def serve_args(settings: dict[str, Any], device: str, gpu_ids: list[str]) -> list[str]:
    """vLLM's arguments for the engine's hardware. In: the settings (``vllm_settings``; a key
    left out takes its default), the resolved device, the GPUs Ray gave the engine. Out:
    ``--dtype`` (auto: bfloat16 on CUDA, float32 on the CPU), ``--tensor-parallel-size``
    (``tensor_parallel``) and ``--enforce-eager`` unless CUDA graphs are wanted on CUDA."""
    cuda = device.startswith("cuda")
    dtype = settings.get("dtype", "auto")
    if dtype == "auto":
        dtype = "bfloat16" if cuda else "float32"
    args = [
        "--dtype",
        dtype,
        "--tensor-parallel-size",
        str(tensor_parallel(settings, device, gpu_ids)),
    ]
    if not (cuda and settings.get("cuda_graphs", True)):
        args.append("--enforce-eager")
    return args


# In every process of the server but the server itself (``sitecustomize`` runs at each Python
# start): die with the parent. vLLM's engine core and workers outlive a SIGKILLed server
# otherwise (measured on 0.32), and a lost engine is ended by its pid.
_SITECUSTOMIZE = """\
import os
if os.environ.get("TIDAL_VLLM_LAUNCHER_PID") not in (None, str(os.getppid())):
    import ctypes, signal
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        os._exit(1)
"""


def _tidal_path(root: Path) -> str:
    """A directory holding only the ``tidal`` package (a link) and ``sitecustomize.py``, for
    the vLLM venv's ``PYTHONPATH``: its workers import the worker extension from it, and
    nothing else of this venv leaks into vLLM's."""
    import tidal

    root.mkdir(parents=True, exist_ok=True)
    (root / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    link = root / "tidal"
    pkg = Path(tidal.__file__).resolve().parent
    if not (link.is_symlink() and link.resolve() == pkg):
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to(pkg, target_is_directory=True)
    return str(root)


class VLLMEngineHost(EngineHost):
    """Plain class; ``driver`` wraps it with ``ray.remote``. One vLLM server per instance
    (``self.server``)."""

    def __init__(
        self, name: str, model_dir: str, max_batch: int, log_dir: str, settings: dict[str, Any]
    ) -> None:
        super().__init__(name, model_dir, max_batch, log_dir, device=settings.get("device", "cpu"))
        self.settings = settings
        self.server = ServerProcess("vLLM", name, self.log_path)
        self._sync = None

    def start(self, timeout_s: float, token: list | None = None) -> str:
        adopt_token(token)
        from tidal.runtime.cell import actor_device
        from tidal.serving.server_guard import MIDDLEWARE
        from tidal.serving.vllm_kv import kv_args, kv_env

        folder = self.kv_folder()
        self.device = actor_device(self.device_setting, _gpu_ids())
        host = self.server.bind_host(self.node.ip)
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_HOST_IP": host,
            "PYTHONPATH": _tidal_path(self.log_path.parent / "vllm-pythonpath"),
            "TIDAL_VLLM_LAUNCHER_PID": str(os.getpid()),
            **kv_env(folder, self.node.node_id or self.node.ip),
        }
        env.pop("VIRTUAL_ENV", None)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        tp = tensor_parallel(self.settings, self.device, _gpu_ids())
        if self.device == "cpu" and tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_bind(tp, list(os.sched_getaffinity(0)))
        args = [
            self.settings["python"],
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--served-model-name",
            SERVED_NAME,
            "--host",
            host,
            "--max-model-len",
            str(self.settings["max_model_len"]),
            "--max-num-seqs",
            str(self.max_batch),
            *serve_args(self.settings, self.device, _gpu_ids()),
            "--kv-cache-memory-bytes",
            str(int(self.settings["kv_cache_gb"] * 2**30)),
            "--worker-extension-cls",
            "tidal.training.vllm_sync.TidalWorkerExtension",
            *kv_args(folder),  # the KV folder's routes: inside the guard (added after them)
            *self._extra_args(),
            *self.settings.get("args", []),
        ]
        if self.server.token:  # the guard reads it from the environment, never the argv
            args += ["--middleware", MIDDLEWARE]
        try:
            self.server.serve(lambda port: [*args, "--port", str(port)], env, host, timeout_s)
            from tidal.training.vllm_sync import VLLMWeightPublisher

            self._sync = VLLMWeightPublisher(
                self.server.url, None, "file", timeout_s=timeout_s, api_key=self.server.token
            )
            # vLLM calls its initial weights "default"; tidal's first version is v0
            self._sync.set_version(self.loaded_version)
        except TidalError as exc:
            self._end()
            raise RuntimeFailure(f"vLLM engine {self.name}: {exc}") from None
        self.state = "awake"
        assert self.server.url is not None
        return self.server.url

    def _extra_args(self) -> list[str]:
        return []

    def sleep(self) -> str:
        raise RuntimeFailure(f"vLLM engine {self.name} is a standalone engine: it never sleeps")

    def wake(self) -> str:
        return self.state

    def load_weights(self, path: str, version: str) -> str:
        """Load a published version into the live server; later tokens carry ``version``."""
        if self._sync is None or not self.alive():
            raise RuntimeFailure(f"vLLM engine {self.name} is not running")
        try:
            self._sync.load_file(path, version)
            served = self._sync.version()  # read back: the label the server really has
        except (TidalError, httpx.HTTPError) as exc:
            raise RuntimeFailure(f"vLLM engine {self.name}: loading {version}: {exc}") from None
        if served != version:
            raise RuntimeFailure(
                f"vLLM engine {self.name} serves {served!r} after loading {version!r}"
            )
        self.loaded_version = served
        return self.loaded_version

    def start_satellite(self, cell: int, core: dict, timeout_s: float) -> int:
        raise RuntimeFailure(f"{self.name} is a standalone engine: no satellite trainer")

    def alive(self) -> bool:
        return self.server.alive()

    def describe(self) -> dict:
        return describe_server(self, self.server, "vllm")

    def kill_engine(self) -> None:
        """Crash the server (SIGKILL to its process group): fault injection for tests."""
        if self.server.kill():
            self.state = "dead"

    def _end(self, timeout_s: float = 30.0) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None
        self.server.end(timeout_s)

    def stop(self) -> None:
        import shutil

        self._end()
        self.state = "stopped"
        shutil.rmtree(self.received_dir(), ignore_errors=True)  # ``load_weights_blob``
        # the run's KV exports on this node (the run's servers stop together at its end)
        shutil.rmtree(self.kv_folder(), ignore_errors=True)

    def kv_folder(self) -> str:
        """This server's KV folder: the run's on this node (``kv_dir``)."""
        return kv_dir(self.log_path.parent.parent, self.node.node_id)


def _gpu_ids() -> list[str]:
    from tidal.runtime.cell import _gpu_ids as ids

    return ids()


def check(cfg: RunConfig) -> None:
    """``ConfigError`` unless this run can serve its standalone engines with vLLM."""
    from tidal.errors import ConfigError

    rt = cfg.runtime
    if cfg.cluster.standalone_count == 0:
        raise ConfigError(
            "runtime.standalone_backend",
            "'vllm' serves standalone engines, and cluster.standalone_count is 0",
        )
    refuse_tiny(rt, "runtime.standalone_backend", "vLLM")
    check_extra_args(rt.vllm.args, VLLM_OWNED, "runtime.vllm.args", "vLLM")
    rt.resolved_vllm_python()


def refuse_tiny(rt: RuntimeConfig, field: str, server: str) -> None:
    """``ConfigError`` naming ``field`` when ``server`` (vLLM, SGLang) would have to serve the
    'tiny' model, which is in tidal's own format."""
    from tidal.errors import ConfigError

    if rt.model == "tiny":
        raise ConfigError(
            field,
            f"{server} cannot serve the 'tiny' model (tidal's own "
            "format): use a Hugging Face model, e.g. runtime.model: smollm2-135m",
        )


async def load_weights(
    admin: httpx.AsyncClient,
    name: str,
    load: Callable[[], ObjectRef],
    label: str,
    readmit: Callable[[], bool] | None = None,
) -> str:
    """``load()`` (the Ray call that loads ``label`` into engine ``name`` by its transport)
    with the engine out of the proxy's routing meanwhile (its calls move, none starts), so no
    call of ours straddles the load and the label the vLLM adapter reads at the start of each
    call is the version of all its tokens. It is readmitted after a verified load unless
    ``readmit()`` says no (a cell leaving for training); after a failed one it stays out of
    routing."""
    resp = await admin.post(f"/tidal/engines/{name}/drain")
    if resp.status_code != 200:
        raise RuntimeFailure(
            f"drain of {name} before loading {label}: HTTP {resp.status_code} {resp.text[:200]}"
        )
    # a failed load (or a wrong version read back) leaves the engine out of routing: it
    # never serves weights other than the published ones
    served = await load()
    if readmit is None or readmit():  # else a plan holds it out: its drain stands
        resp = await admin.post(f"/tidal/engines/{name}/undrain")
        if resp.status_code != 200:
            raise RuntimeFailure(
                f"undrain of {name} after loading {label}: HTTP "
                f"{resp.status_code} {resp.text[:200]}"
            )
    return served
