from __future__ import annotations

import pytest

from tidal.serving.launch import start_engine, start_proxy

TOKEN = "test-admin-token"


class Cluster:
    """Three built-in engine processes (one standalone, two rollout cells) behind a proxy."""

    def __init__(self, model_dir, log_dir) -> None:
        self.model_dir, self.log_dir = model_dir, log_dir
        self.engines = {"s0": start_engine(model_dir, log_path=log_dir / "s0.log"),
                        "c0": start_engine(model_dir, log_path=log_dir / "c0.log"),
                        "c1": start_engine(model_dir, log_path=log_dir / "c1.log")}
        for e in self.engines.values():
            e.wait_healthy(120)
        self.proxy = start_proxy([self.engines["s0"].url],
                                 [self.engines["c0"].url, self.engines["c1"].url], TOKEN,
                                 require_registration=True,
                                 log_path=log_dir / "proxy.log").wait_healthy(60)
        self.url = self.proxy.url
        self.admin = {"Authorization": f"Bearer {TOKEN}"}
        self.spawned = 0

    def replacement(self):
        self.spawned += 1
        name = f"r{self.spawned}"
        proc = start_engine(self.model_dir, log_path=self.log_dir / f"{name}.log")
        self.engines[name] = proc
        return name, proc

    def stop(self) -> None:
        self.proxy.stop()
        for e in self.engines.values():
            e.stop()


@pytest.fixture(scope="package")
def tiny_model(tmp_path_factory):
    from tidal.models import create_tiny

    return create_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=3, max_seq_len=1024)


@pytest.fixture(scope="package")
def cluster(tiny_model, tmp_path_factory):
    c = Cluster(tiny_model, tmp_path_factory.mktemp("logs"))
    yield c
    c.stop()
