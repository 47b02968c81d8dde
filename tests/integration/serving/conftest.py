from __future__ import annotations

import pytest

from tidal.serving.launch import start_engine, start_proxy

TOKEN = "test-admin-token"


class Cluster:
    """Three built-in engine processes (one standalone, two rollout cells) behind a proxy; the
    engines take calls with the run's token only (the proxy's admin token)."""

    def __init__(self, model_dir, log_dir) -> None:
        self.model_dir, self.log_dir = model_dir, log_dir
        self.engines = {
            n: start_engine(model_dir, log_path=log_dir / f"{n}.log", token=TOKEN)
            for n in ("s0", "c0", "c1")
        }
        for e in self.engines.values():
            e.wait_healthy(120)
        self.proxy = start_proxy(
            [self.engines["s0"].url],
            [self.engines["c0"].url, self.engines["c1"].url],
            TOKEN,
            require_registration=True,
            log_path=log_dir / "proxy.log",
        ).wait_healthy(60)
        self.url = self.proxy.url
        self.token = TOKEN
        self.admin = {"Authorization": f"Bearer {TOKEN}"}
        self.spawned = 0

    def replacement(self):
        self.spawned += 1
        name = f"r{self.spawned}"
        proc = start_engine(self.model_dir, log_path=self.log_dir / f"{name}.log", token=TOKEN)
        self.engines[name] = proc
        return name, proc

    def stop(self) -> None:
        self.proxy.stop()
        for e in self.engines.values():
            e.stop()


@pytest.fixture(scope="package")
def tiny_model(tmp_path_factory):
    from tidal.models import create_tiny

    return create_tiny(tmp_path_factory.mktemp("m") / "tiny", seed=3, max_seq_len=1024)


@pytest.fixture(scope="package")
def cluster(tiny_model, tmp_path_factory):
    c = Cluster(tiny_model, tmp_path_factory.mktemp("logs"))
    yield c
    c.stop()
