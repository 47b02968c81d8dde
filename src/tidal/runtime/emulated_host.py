"""The Ray actor of an emulated engine (backend ``emulated``): a cell's or a standalone engine's.

In: what every engine host gets (its name, the model directory, the batch, the log directory)
and the backend's settings (``emulated_settings``: ``runtime.emulate``'s scenario, time scale
``k`` and stream tick). Out: the URL of an emulated engine (``serving.emulated``, served by a
``tidal emulate`` process, ``serving.emulated_farm``) named as the runtime names the engine
(``s<j>``, ``c<i>``: the scenario's engine of that id), and the built-in host's control calls
(sleep, wake, load a version: HTTP to that engine, which takes the scenario's times over
``k``). A satellite of an emulated cell is emulated too (``training.emulated``): no process,
its joining and leaving are recorded. A test double at scale: no model runs.
"""

from __future__ import annotations

from pathlib import Path

from tidal.errors import ConfigError, TidalError
from tidal.runtime.cell import EngineHost, RuntimeFailure, adopt_token


def emulated_settings(rt) -> dict:
    """The host's settings from ``runtime.emulate`` (a ``ConfigError`` naming it if absent)."""
    if rt.emulate is None:
        raise ConfigError(
            "runtime.emulate", "the 'emulated' backend needs a scenario (tidal run --emulate)"
        )
    return rt.emulate.model_dump()


def check(cfg) -> None:
    """An emulated run names its scenario; its engines are the scenario's."""
    emulated_settings(cfg.runtime)


class EmulatedHost(EngineHost):
    """``EngineHost`` whose engine is an emulated one in a ``tidal emulate`` process."""

    def __init__(
        self,
        name: str,
        model_dir: str,
        max_batch: int,
        log_dir: str,
        settings: dict,
        device: str = "cpu",
    ) -> None:
        super().__init__(name, model_dir, max_batch, log_dir, "cpu")
        self.settings = dict(settings)
        self.satellite_joined = False

    def start(self, timeout_s: float, token: list | None = None) -> str:
        import os

        from tidal.serving.emulated_farm import start_farm

        adopt_token(token)
        s = self.settings
        try:
            farm = start_farm(
                s["scenario"],
                s["k"],
                [self.name],
                token=os.environ.get("TIDAL_ENGINE_TOKEN") or None,
                log_path=self.log_path,
                timeout_s=timeout_s,
                stream_tick_s=s.get("stream_tick_s", 1.0),
                host=self.node.ip,
            )
        except TidalError as exc:
            raise RuntimeFailure(f"engine {self.name}: {exc}") from None
        self.proc = _AsServer(farm, self.name)
        self.state = "awake"
        return self.proc.url

    # -- the emulated satellite: joins and leaves, no process ------------------------------
    def start_satellite(self, cell: int, core: dict, timeout_s: float) -> int:
        self.satellite_joined = True
        self.satellite_starts += 1
        return 0

    def ensure_satellite(self, cell: int, core: dict, timeout_s: float) -> tuple[int, bool]:
        started = not self.satellite_joined
        if started:
            self.start_satellite(cell, core, timeout_s)
        return 0, started

    def satellite_alive(self) -> bool:
        return self.satellite_joined

    def stop_satellite(self, timeout_s: float = 10.0) -> bool:
        was, self.satellite_joined = self.satellite_joined, False
        return was

    def received_dir(self) -> Path:
        return Path(self.log_path.parent) / f"received-{self.name}"


class _AsServer:
    """A farm of one engine, shaped as ``serving.launch.ServerProcess`` for ``EngineHost``."""

    def __init__(self, farm, name: str) -> None:
        import os

        self.farm, self.proc = farm, farm.proc
        self.url = farm.urls[name]
        token = os.environ.get("TIDAL_ENGINE_TOKEN")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        self.farm.stop()
