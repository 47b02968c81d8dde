"""An SGLang cell (``SGLangCellHost``) through its role switch over real HTTP. SGLang is CUDA-only
and cannot run here, so the server is ``sglang_shaped_server.py``: a real process on loopback,
started by the host's own command line (``python -m sglang.launch_server ...``, resolved to that
file by a two-line ``sglang`` package on the server's PYTHONPATH), answering SGLang's routes with
SGLang's shapes and holding real memory that a release frees (measured by the host as the
server's resident memory: on a GPU it is ``nvidia-smi``, tests/gpu/test_engines_gpu.py).

Checked: start (launch line, health, ``--weight-version`` read back), sleep (pause with abort,
release, memory measured to fall), wake (all released memory resumed, generation continued),
load of a ``FilePublisher`` version (a model directory handed to ``/update_weights_from_disk``,
the label read back), stop; and the wrong answers, each one ``RuntimeFailure`` line: a release
that frees nothing (the server resumed as it was), a load whose read-back label differs, a file
holding another version, a server that exits at start. Also what the config accepts and refuses.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tidal.errors import ConfigError
from tidal.runtime.cell import RuntimeFailure
from tidal.runtime.sglang_cell import SGLangCellHost, check, file_label
from tidal.training.flat import ParamLayout
from tidal.training.transport import FilePublisher

SERVER = Path(__file__).with_name("sglang_shaped_server.py").resolve()


@pytest.fixture
def sglang_site(tmp_path) -> str:
    """A PYTHONPATH on which ``python -m sglang.launch_server`` runs the shaped server."""
    pkg = tmp_path / "site" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        f"import runpy\nrunpy.run_path({str(SERVER)!r}, run_name='__main__')\n"
    )
    return str(pkg.parent)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (d / "tokenizer.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")  # the base weights: not linked into versions
    return d


def _host(tmp_path, model_dir, site, fault="", monkeypatch=None) -> SGLangCellHost:
    monkeypatch.setenv("TIDAL_SGLANG_SHAPED_FAULT", fault)
    monkeypatch.setenv("TIDAL_ENGINE_TOKEN", "tok-1")
    return SGLangCellHost(
        "c1",
        str(model_dir),
        4,
        str(tmp_path),
        {
            "python": sys.executable,
            "mem_fraction": 0.3,
            "dtype": "float32",
            "pythonpath": site,
            "args": ["--context-length", "256"],
        },
        device="cpu",
    )


@contextlib.contextmanager
def _started(tmp_path, model_dir, site, monkeypatch, fault=""):
    """A host whose server is up (``url``), stopped on the way out whatever happened."""
    host = _host(tmp_path, model_dir, site, fault, monkeypatch)
    try:
        yield host, host.start(60)
    finally:
        host.stop()


def _publish(tmp_path, version: int) -> str:
    torch.manual_seed(version)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    layout = ParamLayout.of(net)
    pub = FilePublisher(tmp_path / "published", layout)
    pub.publish(version, layout.params_to_flat(net))
    return pub.path(version)


def _info(host) -> dict:
    return host._http("GET", "/get_server_info")


@pytest.mark.timeout(120)
def test_an_sglang_cell_sleeps_wakes_and_loads_over_sglangs_routes(
    tmp_path, model_dir, sglang_site, monkeypatch
):
    with _started(tmp_path, model_dir, sglang_site, monkeypatch) as (host, url):
        assert httpx.get(f"{url}/get_weight_version").status_code == 401  # the token guards
        # ... which no other local user can read off the server's command line (issue 29)
        argv = Path(f"/proc/{host.server.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"tok-1" not in b" ".join(argv)
        i = argv.index(b"--context-length")  # runtime.sglang.args, after tidal's own
        assert argv[i + 1] == b"256" and argv.index(b"--weight-version") < i
        d = host.describe()
        assert d["backend"] == "sglang" and d["version"] == "v0" and d["alive"]
        assert _info(host)["enable_memory_saver"]
        assert host.sleep() == "asleep"
        info = _info(host)
        assert info["paused"] and info["pause_modes"] == ["abort"]
        assert sorted(info["released"]) == ["kv_cache", "weights"]
        mem = host.describe()["memory"][0]
        assert mem["measure"] == "rss" and mem["before_mb"] - mem["after_mb"] > 100  # 128 MiB
        assert host.sleep() == "asleep"  # idempotent: one release
        assert host.wake() == "awake"
        info = _info(host)
        assert not info["paused"] and info["released"] == []
        assert host.describe()["memory"][0]["awake_mb"] > mem["after_mb"] + 100
        path = _publish(tmp_path, 1)
        assert host.load_weights(path, "v1") == "v1"
        info = _info(host)
        version_dir = Path(info["model_path"])
        assert info["weight_version"] == "v1" and info["loaded_tensors"] == 4
        assert sorted(p.name for p in version_dir.iterdir()) == [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
        ]
        assert (version_dir / "model.safetensors").resolve() == Path(path).resolve()
        assert host.load_weights(_publish(tmp_path, 2), "v2") == "v2"
        assert not version_dir.exists()  # the earlier version's directory is gone
        assert host.describe()["version"] == "v2"
    assert not host.alive() and host.describe()["state"] == "stopped"


@pytest.mark.timeout(120)
def test_a_release_that_frees_nothing_is_one_line_and_the_server_serves_on(
    tmp_path, model_dir, sglang_site, monkeypatch
):
    with _started(tmp_path, model_dir, sglang_site, monkeypatch, "no_release") as (host, _):
        with pytest.raises(RuntimeFailure, match="freed nothing"):
            host.sleep()
        info = _info(host)
        assert host.state == "awake" and not info["paused"] and info["released"] == []


@pytest.mark.timeout(120)
def test_a_load_whose_served_version_differs_is_one_line(
    tmp_path, model_dir, sglang_site, monkeypatch
):
    with _started(tmp_path, model_dir, sglang_site, monkeypatch, "drops_version") as (host, _):
        with pytest.raises(RuntimeFailure, match="serves 'v0' after loading 'v1'"):
            host.load_weights(_publish(tmp_path, 1), "v1")
        assert host.describe()["version"] == "v0"
        with pytest.raises(RuntimeFailure, match="holds v1, not v3"):
            host.load_weights(_publish(tmp_path, 1), "v3")


@pytest.mark.timeout(120)
def test_a_load_while_released_and_a_server_that_cannot_start_are_one_line(
    tmp_path, model_dir, sglang_site, monkeypatch
):
    with _started(tmp_path, model_dir, sglang_site, monkeypatch) as (host, _):
        host.sleep()
        with pytest.raises(RuntimeFailure, match=r"HTTP 400 .*resume memory occupation first"):
            host.load_weights(_publish(tmp_path, 1), "v1")
    (model_dir / "config.json").unlink()
    bad = _host(tmp_path, model_dir, sglang_site, monkeypatch=monkeypatch)
    with pytest.raises(RuntimeFailure) as info:
        bad.start(60)
    assert "exited with 1 during start-up" in str(info.value)
    assert "\n" not in str(info.value) and not bad.alive()


def test_file_label_reads_the_published_version(tmp_path):
    assert file_label(_publish(tmp_path, 5)) == "v5"
    (tmp_path / "junk").write_bytes(b"no")
    with pytest.raises(RuntimeFailure, match="not a published safetensors file"):
        file_label(str(tmp_path / "junk"))


def _cfg(**runtime):
    from types import SimpleNamespace

    from tidal.config import RuntimeConfig

    cell = SimpleNamespace(backend=None)
    rt = RuntimeConfig(**{"model": "smollm2-135m", "cell_backend": "sglang", **runtime})
    return SimpleNamespace(runtime=rt, cluster=SimpleNamespace(cell_specs=lambda: [cell]))


@pytest.mark.parametrize(
    "runtime, field, words",
    [
        ({}, "runtime.cell_backend", "CUDA-only"),
        ({"use_gpus": True, "device": "cpu"}, "runtime.cell_backend", "use_gpus"),
        ({"use_gpus": True, "model": "tiny"}, "runtime.cell_backend", "tiny"),
        ({"use_gpus": True}, "runtime.sglang.python", "pip install sglang"),
        (
            {"use_gpus": True, "sglang": {"python": "/nonexistent/python"}},
            "runtime.sglang.python",
            "not an executable",
        ),
        (
            {
                "use_gpus": True,
                "sglang": {"args": "--schedule-policy lpm --mem-fraction-static=0.9"},
            },
            "runtime.sglang.args",
            "--mem-fraction-static=0.9: tidal sets --mem-fraction-static of "
            "each SGLang server itself (runtime.sglang.mem_fraction)",
        ),
    ],
)
def test_what_sglang_cells_need_is_checked(monkeypatch, runtime, field, words):
    monkeypatch.delenv("TIDAL_SGLANG_PYTHON", raising=False)
    with pytest.raises(ConfigError) as info:
        check(_cfg(**runtime))
    assert info.value.field == field and words in info.value.message


def test_sglang_cells_on_gpus_with_sglangs_python_pass(monkeypatch):
    monkeypatch.setenv("TIDAL_SGLANG_PYTHON", os.path.realpath(sys.executable))
    check(_cfg(use_gpus=True, device="cuda"))
    check(_cfg(cell_backend="builtin"))  # no SGLang cell: nothing needed


def test_an_sglang_cell_on_another_node_gets_versions_by_the_object_store_out_of_routing():
    """``Engines``' own methods: an SGLang cell on another node gets a version through Ray's
    object store (written to its node, loaded from that path; the driver's file is not there
    on a cluster of machines), one on the driver's node the driver's file; the publisher
    drains either meanwhile (``is_server``)."""
    from functools import partial
    from types import SimpleNamespace

    from tidal.runtime.engines import EngineId, Engines

    c1 = EngineId.cell(1)
    e = SimpleNamespace(nodes={c1: "node-b"}, driver_node="node-a", backend=lambda eid: "sglang")
    e.is_server = partial(Engines.is_server, e)
    assert e.is_server(c1)
    assert Engines.transport(e, c1) == "object"
    e.nodes[c1] = "node-a"
    assert Engines.transport(e, c1) == "file"
