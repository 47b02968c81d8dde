"""A cell whose engine is a real SGLang server (``runtime.cell_backend: sglang``), kept for the
whole run: one server process group, its model and its memory pools survive every role change.

In: the actuator's calls on the cell actor (``sleep``, ``wake``, ``load_weights``,
``start_satellite``, ``stop_satellite``) and the driver's (``start``, ``describe``,
``kill_engine``, ``stop``), exactly as for ``VLLMCellHost``. Out: the server's memory freed
while its cell trains (measured, never claimed), restored before it serves, and the published
version loaded in place and read back from the server.

SGLang's HTTP routes, as in ``python/sglang/srt/entrypoints/http_server.py`` (sgl-project/sglang;
request bodies from ``python/sglang/srt/managers/io_struct.py``):
- launch: ``sglang.launch_server`` (run by ``_LAUNCH``: the key from the environment)
  ``--model-path M --host H --port P --enable-memory-saver`` (release/resume need the memory
  saver) ``--weight-version v0``;
- ``POST /pause_generation`` ``{"mode": "abort"}`` and ``POST /continue_generation`` ``{}``
  (answer ``{"message": ..., "status": "ok"}``);
- ``POST /release_memory_occupation`` / ``POST /resume_memory_occupation`` with
  ``{"tags": [...] | null}`` (``weights``, ``kv_cache``, ...; null: all), answer empty (200);
- ``POST /update_weights_from_disk`` ``{"model_path", "weight_version", "abort_all_requests",
  "flush_cache"}``, answer ``{"success", "message", "num_paused_requests"}`` (400 unless
  success); the served label is read back from ``GET /get_weight_version``
  (``{"weight_version": ...}``).

A published version (``FilePublisher``: one safetensors file, the trainer's parameter names) is
loaded as a model directory: the model's config and tokenizer files and the version's file,
linked into ``logs/sglang-<cell>-weights/<version>/``. The memory freed is measured per device:
GPU memory of the server's process group (``nvidia-smi``; else its GPU's) on CUDA, its resident
memory (RSS, /proc) otherwise. A release that frees nothing, a load that fails or serves
another label, or a server that does not start is one ``RuntimeFailure`` line: the actuator
aborts the plan and restores the cell's role.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.runtime import vllm_host
from tidal.runtime.cell import EngineHost, RuntimeFailure, actor_device, adopt_token
from tidal.runtime.server_process import (
    ServerProcess,
    check_extra_args,
    describe_cell,
    server_rss_bytes,
)

if TYPE_CHECKING:
    from tidal.config import RunConfig, RuntimeConfig

# files of a model directory that are weights (a version directory holds the version's instead)
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".safetensors.index.json",
    ".bin.index.json",
)


# the flags of SGLang's server that tidal sets on each cell's server -> what sets them instead
SGLANG_OWNED = {
    "--model-path": "runtime.model",
    "--model": "runtime.model",
    "--served-model-name": "the proxy's model name",
    "--host": "the node's address",
    "--port": "a free port",
    "--device": "runtime.device",
    "--max-running-requests": "runtime.engine_max_batch",
    "--enable-memory-saver": "a cell's role switches",
    "--enable-metrics": "the adapter",
    "--mem-fraction-static": "runtime.sglang.mem_fraction",
    "--dtype": "tidal's float32",
    "--weight-version": "tidal's weight versions",
    "--api-key": "the run's token guard",
}


def sglang_settings(rt: RuntimeConfig) -> dict[str, Any]:
    """What an ``SGLangCellHost`` needs from ``RuntimeConfig`` (validated: ``ConfigError``;
    ``sglang.args`` by ``check``)."""
    return {
        "python": rt.resolved_sglang_python(),
        "mem_fraction": rt.sglang.mem_fraction,
        "dtype": "float32",
        "args": list(rt.sglang.args),
    }


def _smi(*query: str) -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", *query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeFailure(f"GPU memory of the SGLang server unmeasurable: {exc!r}") from None


def group_gpu_bytes(pgid: int, gpu: str | None) -> int:
    """GPU memory held by the processes of group ``pgid`` (``nvidia-smi``, bounded). Where
    ``nvidia-smi`` sees none of them (a container's own pid namespace), the memory used on the
    cell's GPU ``gpu`` (nothing else of the cell holds it while the server releases)."""
    out = _smi("--query-compute-apps=pid,used_memory")
    total = 0
    for line in out.strip().splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            if os.getpgid(int(pid)) == pgid:
                total += int(float(mib) * 2**20)
    if total == 0 and gpu is not None:
        total = int(float(_smi("--query-gpu=memory.used", "-i", gpu).split()[0]) * 2**20)
    return total


def file_label(path: str) -> str:
    """The ``weight_version`` a ``FilePublisher`` stored in a safetensors header ('' if none)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as exc:
        raise RuntimeFailure(f"{path}: not a published safetensors file ({exc})") from None
    return str((header.get("__metadata__") or {}).get("weight_version", ""))


# SGLang takes its key only as ``--api-key``, and a process's arguments are readable by every
# local user (``ps``). So the server starts through this line, which reads the key from its own
# environment (readable by the same user only), drops it there, and appends it to the arguments
# SGLang parses inside the process; the command line the kernel shows never holds it.
_KEY_ENV = "TIDAL_SGLANG_API_KEY"
_LAUNCH = (
    "import os, runpy, sys; "
    f"key = os.environ.pop({_KEY_ENV!r}, ''); "
    "sys.argv = ['sglang.launch_server', *sys.argv[1:], "
    "*(['--api-key', key] if key else [])]; "
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)"
)


class SGLangCellHost(EngineHost):
    """Plain class; ``engines`` wraps it with ``ray.remote``. One SGLang server per cell
    (``self.server``: its process group, health wait, kill and end, as every server host's);
    the satellite trainer is the cell's, as a built-in cell's."""

    backend = "sglang"

    def __init__(
        self,
        name: str,
        model_dir: str,
        max_batch: int,
        log_dir: str,
        settings: dict[str, Any],
        device: str = "cpu",
    ) -> None:
        super().__init__(name, model_dir, max_batch, log_dir, device=device)
        self.settings = settings
        # plain-text answers count as {} (/flush_cache)
        self.server = ServerProcess("SGLang", name, self.log_path, text_answers=True)
        self.memory: list[dict[str, Any]] = []  # one entry per release: memory before/after

    def _http(
        self,
        method: str,
        path: str,
        timeout_s: float = 120.0,
        *,
        json: dict[str, object] | None = None,
        params: dict[str, str | int | float] | None = None,
    ) -> dict[str, Any]:
        return self.server.http(method, path, timeout_s, json=json, params=params)

    def alive(self) -> bool:
        return self.server.alive()

    def kill_engine(self) -> None:
        """Crash the server (SIGKILL to its process group): fault injection for tests."""
        if self.server.kill():
            self.state = "dead"

    def stop(self) -> None:
        self.stop_satellite()
        self.server.end()
        self.state = "stopped"
        shutil.rmtree(self.received_dir(), ignore_errors=True)  # ``load_weights_blob``

    def start(self, timeout_s: float, token: list | None = None) -> str:
        adopt_token(token)
        from tidal.runtime.cell import _gpu_ids

        self.device = actor_device(self.device_setting, _gpu_ids())
        host = self.server.bind_host(self.node.ip)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "SGLANG_DISABLE_USAGE_STATS": "1"}
        env.pop("VIRTUAL_ENV", None)
        env.pop("PYTHONPATH", None)  # nothing of this venv leaks into SGLang's
        if self.settings.get("pythonpath"):
            env["PYTHONPATH"] = self.settings["pythonpath"]
        args = [
            self.settings["python"],
            "-c",
            _LAUNCH,
            "--model-path",
            self.model_dir,
            "--served-model-name",
            "tidal",
            "--host",
            host,
            "--device",
            self.device,
            "--max-running-requests",
            str(self.max_batch),
            "--enable-memory-saver",
            "--enable-metrics",  # /metrics: the adapter's running count (pause "wait")
            "--mem-fraction-static",
            str(self.settings["mem_fraction"]),
            "--dtype",
            self.settings["dtype"],
            "--weight-version",
            self.loaded_version,
            *self.settings.get("args", []),
        ]
        if self.server.token:  # SGLang guards every route with it: the proxy and this host
            env[_KEY_ENV] = self.server.token  # send it; into --api-key, never on its argv
        try:
            self.server.serve(lambda port: [*args, "--port", str(port)], env, host, timeout_s)
            served = self._served()
        except RuntimeFailure as exc:
            self.server.end()
            raise RuntimeFailure(f"SGLang engine {self.name}: {exc}") from None
        if served != self.loaded_version:
            self.server.end()
            raise RuntimeFailure(
                f"SGLang engine {self.name} serves {served!r} at start, not "
                f"{self.loaded_version!r} (--weight-version ignored)"
            )
        self.state = "awake"
        assert self.server.url is not None
        return self.server.url

    def _served(self) -> str:
        """The label the server really serves (``GET /get_weight_version``)."""
        return str(self._http("GET", "/get_weight_version").get("weight_version"))

    def rss_bytes(self) -> int:
        return server_rss_bytes(self.server)

    def memory_bytes(self) -> int:
        """What a release frees: GPU memory on CUDA, resident memory on the CPU."""
        if not self.alive():
            return 0
        if self.device != "cuda":
            return self.rss_bytes()
        from tidal.runtime.cell import _gpu_ids

        ids = _gpu_ids()
        assert self.server.proc is not None
        return group_gpu_bytes(self.server.proc.pid, ids[0] if ids else None)

    def sleep(self) -> str:
        """Pause (aborting what runs: the cell was drained, nothing of ours is there), release
        weights and KV cache; a release that frees nothing resumes the server as it was and is
        one ``RuntimeFailure`` line (the plan aborts)."""
        if self.state == "asleep":
            return self.state
        before, t0 = self.memory_bytes(), time.perf_counter()
        self._http("POST", "/pause_generation", json={"mode": "abort"})
        self._http("POST", "/release_memory_occupation", json={"tags": None})
        after = self.memory_bytes()
        if after >= before:
            self._http("POST", "/resume_memory_occupation", json={"tags": None})
            self._http("POST", "/continue_generation", json={})
            raise RuntimeFailure(
                f"SGLang engine {self.name}: /release_memory_occupation freed "
                f"nothing ({before / 2**20:.0f} MiB before, "
                f"{after / 2**20:.0f} MiB after; --enable-memory-saver?)"
            )
        self.state = "asleep"
        self.memory.append(
            {
                "measure": "gpu" if self.device == "cuda" else "rss",
                "before_mb": round(before / 2**20, 1),
                "after_mb": round(after / 2**20, 1),
                "sleep_s": round(time.perf_counter() - t0, 3),
            }
        )
        return self.state

    def wake(self) -> str:
        """Everything released comes back (``tags: null``: SGLang's scheduler resumes the
        weights, then the KV cache and CUDA graphs); generation continues (the proxy still
        holds the cell out of routing until the current version is loaded)."""
        if self.state != "asleep":
            return self.state
        self._http("POST", "/resume_memory_occupation", json={"tags": None})
        self._http("POST", "/continue_generation", json={})
        if self.memory:
            self.memory[-1]["awake_mb"] = round(self.memory_bytes() / 2**20, 1)
        self.state = "awake"
        return self.state

    def _version_dir(self, path: str, version: str) -> Path:
        """A model directory for ``version``: the model's non-weight files and the published
        file, linked (no copy)."""
        root = self.log_path.parent / f"sglang-{self.name}-weights"
        d = root / version
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for f in Path(self.model_dir).iterdir():
            if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES):
                (d / f.name).symlink_to(f.resolve())
        (d / "model.safetensors").symlink_to(Path(path).resolve())
        return d

    def load_weights(self, path: str, version: str) -> str:
        """Load a published version in place (``/update_weights_from_disk``), then read the
        served label back: it must be ``version``, else one ``RuntimeFailure`` line."""
        stored = file_label(path)
        if stored and stored != version:
            raise RuntimeFailure(f"SGLang engine {self.name}: {path} holds {stored}, not {version}")
        d = self._version_dir(path, version)
        out = self._http(
            "POST",
            "/update_weights_from_disk",
            timeout_s=600.0,
            json={
                "model_path": str(d),
                "weight_version": version,
                "abort_all_requests": False,
                "flush_cache": True,
            },
        )
        if out.get("success") is False:
            raise RuntimeFailure(
                f"SGLang engine {self.name}: loading {version}: {out.get('message')}"
            )
        served = self._served()
        if served != version:
            raise RuntimeFailure(
                f"SGLang engine {self.name} serves {served!r} after loading {version!r}"
            )
        for old in d.parent.iterdir():  # earlier versions' directories
            if old != d:
                shutil.rmtree(old, ignore_errors=True)
        self.loaded_version = served
        return served

    def describe(self) -> dict:
        return describe_cell(self, self.server, self.backend, self.memory)


def check(cfg: RunConfig) -> None:
    """``ConfigError`` (naming the field) unless this run can serve its SGLang cells."""
    from tidal.errors import ConfigError
    from tidal.runtime.engines import cell_backend

    if "sglang" not in {cell_backend(cfg, i) for i in range(len(cfg.cluster.cell_specs()))}:
        return
    rt = cfg.runtime
    if not rt.use_gpus or rt.device == "cpu":
        raise ConfigError(
            "runtime.cell_backend",
            "'sglang' cells need GPUs (SGLang is "
            "CUDA-only): set runtime.use_gpus: true and runtime.device cuda or "
            "auto, or use 'builtin' or 'vllm'",
        )
    vllm_host.refuse_tiny(rt, "runtime.cell_backend", "SGLang")
    check_extra_args(rt.sglang.args, SGLANG_OWNED, "runtime.sglang.args", "SGLang")
    rt.resolved_sglang_python()
