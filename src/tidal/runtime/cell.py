"""The cell actor: a Ray actor that owns one built-in engine process and, from its cell's first
training stint on, one satellite trainer process that lives for the run (parked by the core's
coordinator while the cell serves); it changes their state.

In: calls from the actuator (``sleep``, ``wake``, ``load_weights``, ``ensure_satellite``,
``stop_satellite``) and the driver (``start``, ``stop``, ``kill_engine``). Out: the engine's URL
and its state. A satellite (cells 1..K-1, ``tidal.training.satellite``) connects to the core's
coordinator, joins its steps in cell order, pulls the step's weights and claims micro-steps;
stopping it between steps is safe (the coordinator reopens a lost satellite's micro-steps).
Standalone engines use the same actor; they are simply never asked to sleep. The engine keeps its
process, port and model across role changes: sleeping frees its weights and KV cache, waking
restores them (REFERENCE.md §1: backend processes stay alive across the change). Foreign errors
(HTTP) become ``RuntimeFailure`` with one readable line.

Device: the engine and the satellite of a cell run on the same device, decided here from
``runtime.device`` and the GPUs Ray gave this actor (``auto``: cuda when it holds any). Both
processes inherit the actor's ``CUDA_VISIBLE_DEVICES``, so ``cuda`` is the cell's first GPU; the
engine sleeps before the satellite trains and the satellite parks (its model moved to CPU memory)
before the engine wakes, so they never hold the GPU's memory at once.

CPU quota (``runtime.cell_cpus``): the actor joins its cell's cgroup first thing, so its engine and
satellite processes are born there and together never use more than the cell's cores.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tidal.contracts.trainer import ModelSpec, SatelliteConfig
from tidal.errors import TidalError

log = logging.getLogger(__name__)


RECEIVED_ROOT = Path("/dev/shm")


def remove_orphan_received_dirs(root: Path = RECEIVED_ROOT) -> int:
    """Remove the received-version directories (``tidal-<engine>-<pid>``, full model weights
    in shared memory, i.e. RAM) whose host process is gone: a host's ``stop`` removes its own,
    but an actor killed by Ray or by a lost node never runs it (CI's vLLM tier left 6.6 GB of
    them and Ray's memory monitor then killed a test's workers). Returns how many."""
    removed = 0
    for d in root.glob("tidal-*-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if not (d.is_dir() and pid.isdigit()) or Path(f"/proc/{pid}").exists():
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    if removed:
        log.info("removed %d received-version directories of ended engine hosts", removed)
    return removed


class RuntimeFailure(TidalError):
    """A runtime part (engine process, actor, proxy) did not do what it was asked."""


def adopt_token(box: list | None) -> None:
    """The run's engine token into this actor's environment, where the engine processes it
    starts read it (``$TIDAL_ENGINE_TOKEN``; a process's environment is readable by its own
    user only). ``box``: ``[ObjectRef]`` of the token in Ray's object store, never Ray's
    ``runtime_env``, which shows on every process's command line and in a world-readable
    log."""
    if box:
        import ray

        os.environ["TIDAL_ENGINE_TOKEN"] = ray.get(box[0], timeout=60)


class EngineHost:
    """Plain class; ``driver`` wraps it with ``ray.remote``. One engine process per instance."""

    def __init__(
        self,
        name: str,
        model_dir: str,
        max_batch: int,
        log_dir: str,
        device: str = "cpu",
        cgroup: str | None = None,
        served: str | None = None,
        seed: int = 0,
        deterministic: bool = False,
    ) -> None:
        from tidal.runtime.nodes import here

        # on a cluster the engine and satellite are reached from other nodes: they listen on
        # this node's address and gloo uses the interface that holds it (loopback locally)
        self.node = here()
        self.gloo_iface = self.node.gloo_iface()
        os.environ["GLOO_SOCKET_IFNAME"] = self.gloo_iface
        if cgroup is not None:  # runtime.cell_cpus: this actor, its engine and its satellite
            from tidal.runtime.cpuquota import join_process

            join_process(cgroup)  # processes started from here on are born in the group
        self.cgroup = cgroup
        self.name, self.model_dir, self.max_batch = name, model_dir, max_batch
        # served: the model's name (engines are named for what they serve); seed: the
        # engine's own stream for unseeded requests (tidal.seeding.engine_seed), which the
        # proxy stamps with a per-call seed when the run has one
        self.served, self.seed = served, seed
        self.deterministic = deterministic  # runtime.deterministic: each request alone
        self.device_setting = device
        self.device = "cpu"
        self.log_path = Path(log_dir) / f"engine-{name}.log"
        self.proc = None
        self.state = "stopped"
        self.loaded_version = "v0"
        self.loaded_path: str | None = None  # the file of the loaded version (None: model_dir)
        self._load_parts: dict[str, float] = {}  # the engine's parts of its last load
        self.satellite: subprocess.Popen | None = None
        self.satellite_starts = 0

    def start(self, timeout_s: float, token: list | None = None) -> str:
        from tidal.runtime.spill import spill_dir
        from tidal.serving.launch import start_engine

        adopt_token(token)
        # Model steps in a thread: a long prefill never stalls the engine's control routes.
        self.device = actor_device(self.device_setting, _gpu_ids())
        self.proc = start_engine(
            self.model_dir,
            name=self.served,
            max_batch=self.max_batch,
            log_path=self.log_path,
            step_in_thread=True,
            seed=self.seed,
            device=self.device,
            host=self.node.ip,
            spill_dir=spill_dir(self.log_path.parent.parent),
            deterministic=self.deterministic,
        )
        try:
            self.proc.wait_healthy(timeout_s)
        except TidalError as exc:
            raise RuntimeFailure(f"engine {self.name}: {exc}") from None
        self.state = "awake"
        return self.proc.url

    def _post(self, path: str, timeout_s: float = 60.0, **kw) -> dict:
        if self.proc is None:
            raise RuntimeFailure(f"engine {self.name} is not started")
        if self._http is None:  # one client for every control call: making one measured
            self._http = httpx.Client(timeout=60.0)  # 30-80 ms on a busy machine
        try:
            resp = self._http.post(
                f"{self.proc.url}{path}", timeout=timeout_s, headers=self.proc.headers, **kw
            )
        except httpx.HTTPError as exc:
            raise RuntimeFailure(f"engine {self.name} {path}: {exc!r}") from None
        if resp.status_code != 200:
            raise RuntimeFailure(
                f"engine {self.name} {path}: HTTP {resp.status_code} {resp.text[:200]}"
            )
        return resp.json()

    def sleep(self) -> str:
        """Release rollout memory: KV caches and weights. Level 2: nothing is written (level 1
        would first spill the weights to disk: 0.5 GB for SmolLM2, seconds on a busy disk);
        waking reloads them from where they came from."""
        self._post("/sleep", params={"level": 2})
        self.state = "asleep"
        return self.state

    def wake(self) -> str:
        """Weights back (from the file of the version it slept with, or the model directory).
        Every wake is followed by the current version's load before the engine serves again,
        so where that file was deleted meanwhile (the publisher keeps the newest two) the
        engine wakes on the model directory's weights, labelled v0."""
        if self.loaded_path is not None and not Path(self.loaded_path).exists():
            self.load_weights(self.model_dir, "v0")  # materialises a sleeping engine
            self.loaded_path = None
        else:
            self._post("/wake_up")
        self.state = "awake"
        return self.state

    def load_weights(self, path: str, version: str) -> str:
        """Load a published version in place (no restart); later tokens carry ``version``."""
        out = self._post("/update_weights", json={"path": path, "weight_version": version})
        self.loaded_version = out["weight_version"]
        self.loaded_path = path
        self.state = "awake"
        self._pause_s = out.get("pause_s")
        self._load_parts = {k: out[k] for k in ("prepare_s", "step_wait_s") if k in out}
        return self.loaded_version

    _pause_s: float | None = None
    _http: httpx.Client | None = None
    _recv_group: tuple[str, object] | None = None  # (key, group) of the broadcast carrier

    def weight_hashes(self) -> dict:
        """The engine's served version and the sha256 of each weight (``/tidal/weights/
        hashes``): what a carrier delivered, checked bit for bit."""
        if self.proc is None:
            raise RuntimeFailure(f"engine {self.name} is not started")
        resp = httpx.get(
            f"{self.proc.url}/tidal/weights/hashes", timeout=60, headers=self.proc.headers
        )
        resp.raise_for_status()
        return resp.json()

    def load_version(self, path: str, version: str) -> dict:
        """``load_weights`` (a shared-memory segment or a file), timed: the label served after
        it, and the pause the engine saw (how long the built-in engine held its steps; a
        server's whole load, paused and out of routing)."""
        import time

        t0 = time.perf_counter()
        self._pause_s, self._load_parts = None, {}
        label = self.load_weights(path, version)
        took = time.perf_counter() - t0
        return {
            "label": label,
            "seconds": took,
            "pause_s": self._pause_s if self._pause_s is not None else took,
            **self._load_parts,  # the engine's own: prepare_s, step_wait_s
        }

    def load_ipc(self, handles: list[dict], version: str) -> dict:
        """The ``ipc`` carrier's end: the core's device tensors as CUDA IPC handles, mapped by
        the engine (on the same GPU) and copied into its weights (``POST /tidal/weights/ipc``);
        timed as ``load_version``."""
        import time

        t0 = time.perf_counter()
        out = self._post("/tidal/weights/ipc", json={"handles": handles, "weight_version": version})
        self.loaded_version, self.loaded_path = out["weight_version"], None
        self.state = "awake"
        took = time.perf_counter() - t0
        return {"label": self.loaded_version, "seconds": took, "pause_s": out.get("pause_s", took)}

    def receive_segment(
        self, host: str, port: int, key: str, version: str, timeout_s: float
    ) -> dict:
        """The broadcast carrier's receiving end: join the driver's side group for this
        engine (rank 1; kept for later versions under the same ``key``), receive a segment
        into this node's shared memory (a version received whole, else nothing), load it from
        there (``load_version``). The newest two received versions are kept (the engine's
        source)."""
        from tidal.training.carriers import join_group, recv_segment

        d = self.received_dir()
        if not d.exists():
            remove_orphan_received_dirs()
        kept = self._recv_group
        group = kept[1] if kept is not None and kept[0] == key else None
        try:
            if group is None:  # the driver's group for this engine: joined once, then kept
                self._recv_group = None
                group = join_group(host, port, 1, 2, key, "gloo", timeout_s)
            _, path = recv_segment(group, d, timeout_s)
        except BaseException:
            self._recv_group = None  # the driver forms a new one for the next version
            raise
        self._recv_group = (key, group)
        out = self.load_version(path, version)
        for old in sorted(d.glob("*.safetensors"), key=os.path.getmtime)[:-2]:
            old.unlink(missing_ok=True)
        return out

    def received_dir(self) -> Path:
        """This node's shared-memory directory of the versions that came across nodes."""
        return RECEIVED_ROOT / f"tidal-{self.name}-{os.getpid()}"

    def load_weights_blob(self, blob: bytes, version: str) -> str:
        """Load a version that crossed nodes (``blob``: the safetensors file, pulled onto this
        node by Ray's object store): written to this node's shared memory, then loaded in
        place as from a path. The newest two received files are kept (the engine's source)."""
        d = self.received_dir()
        if not d.exists():  # this host's first: what dead hosts of this node left goes first
            remove_orphan_received_dirs()
        d.mkdir(exist_ok=True)
        path = d / f"{version}.safetensors"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
        out = self.load_weights(str(path), version)
        for old in sorted(d.glob("*.safetensors"), key=os.path.getmtime)[:-2]:
            old.unlink(missing_ok=True)
        return out

    def start_satellite(self, cell: int, core: dict, timeout_s: float) -> int:
        """Start this cell's satellite trainer against the core at ``core`` (its
        ``CoreTrainer.address()``); returns the process id."""
        self.stop_satellite()
        cfg = SatelliteConfig(
            cell=cell,
            host=str(core["host"]),
            rpc_port=int(core["rpc_port"]),
            store_port=int(core["store_port"]),
            authkey=str(core["authkey"]),
            backend=core["backend"],
            model=ModelSpec(model_dir=self.model_dir),
            timeout_s=timeout_s,
            device=self.device,
            shard=core.get("shard"),
        )
        log_fh = open(self.log_path.with_name(f"satellite-{self.name}.log"), "ab")  # noqa: SIM115
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": self.gloo_iface,
            "TIDAL_LOG": os.environ.get("TIDAL_LOG", "INFO"),
        }
        self.satellite = subprocess.Popen(
            [sys.executable, "-m", "tidal.training.satellite", cfg.model_dump_json()],
            stdout=log_fh,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log_fh.close()
        self.satellite_starts += 1
        return self.satellite.pid

    def ensure_satellite(self, cell: int, core: dict, timeout_s: float) -> tuple[int, bool]:
        """This cell's satellite for the run: the running process (parked between training
        stints: it keeps its model and groups), or a new one if none runs; returns (pid,
        started)."""
        if self.satellite_alive():
            assert self.satellite is not None
            return self.satellite.pid, False
        return self.start_satellite(cell, core, timeout_s), True

    def satellite_alive(self) -> bool:
        return self.satellite is not None and self.satellite.poll() is None

    def stop_satellite(self, timeout_s: float = 10.0) -> bool:
        """End the satellite process (between steps); True if one was running."""
        if self.satellite is None:
            return False
        running = self.satellite.poll() is None
        if running:
            self.satellite.terminate()
            try:
                self.satellite.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.satellite.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.satellite.wait(timeout_s)
        self.satellite = None
        return running

    def describe(self) -> dict:
        alive = self.proc is not None and self.proc.proc.poll() is None
        return {
            "name": self.name,
            "state": self.state,
            "version": self.loaded_version,
            "alive": alive,
            "url": self.proc.url if self.proc else None,
            "pid": self.proc.proc.pid if self.proc else None,
            "satellite_pid": self.satellite.pid if self.satellite_alive() else None,
            "satellite_starts": self.satellite_starts,
            "gpu_ids": _gpu_ids(),
            "device": self.device,
            "cgroup": self.cgroup,
            "node_id": self.node.node_id,
            "node_ip": self.node.ip,
            "host": socket.gethostname(),
            "device_peak_mb": self._device_peak_mb() if alive else None,
        }

    def _device_peak_mb(self) -> float | None:
        """The engine's GPU peak from its ``/stats`` (None on the CPU, or where it does not
        answer within seconds: the end-of-run summary does not wait on a stuck engine)."""
        if self.device == "cpu" or self.proc is None:
            return None
        try:
            resp = httpx.get(f"{self.proc.url}/stats", timeout=5.0, headers=self.proc.headers)
            return resp.json().get("device_peak_mb") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def kill_engine(self) -> None:
        """Crash the engine process (SIGKILL): fault injection for tests."""
        if self.proc is not None:
            self.proc.kill()
            self.state = "dead"

    def stop(self) -> None:
        self.stop_satellite()
        if self.proc is not None:
            self.proc.stop()
            self.state = "stopped"
        if self._http is not None:
            self._http.close()
            self._http = None
        shutil.rmtree(self.received_dir(), ignore_errors=True)


def actor_device(setting: str, gpu_ids: list[str], cuda_present: bool | None = None) -> str:
    """The device of a cell's engine and satellite: ``auto`` is cuda when Ray gave the actor
    GPUs and the host has an NVIDIA driver (GPUs merely declared to Ray, as in tests, stay on
    the CPU); ``cuda`` without any fails in the engine with its own one-line error."""
    if setting == "auto":
        if cuda_present is None:
            cuda_present = _nvidia_driver_present()
        return "cuda" if gpu_ids and cuda_present else "cpu"
    return setting


def _nvidia_driver_present() -> bool:
    """Cheap (no torch import in the actor): the kernel driver or its device nodes exist."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))


def trainer_device(setting: str, cell0_gpu_ids: list[str], visible: str | None) -> str:
    """The core trainer's device in the driver (``setting`` already resolved: cpu or cuda):
    cell 0's first GPU, as an index among the GPUs the driver sees (``visible``: its
    ``CUDA_VISIBLE_DEVICES``, None when unset, then Ray's ids are the physical indices)."""
    if setting != "cuda" or not cell0_gpu_ids:
        return setting
    first = cell0_gpu_ids[0]
    if visible is None:
        return f"cuda:{int(first)}" if first.isdigit() else "cuda"
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    return f"cuda:{ids.index(first)}" if first in ids else "cuda"


def _gpu_ids() -> list[str]:
    """The GPUs Ray assigned to this actor (its engine and satellite inherit
    ``CUDA_VISIBLE_DEVICES``); empty on CPU."""
    import ray

    return [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []
