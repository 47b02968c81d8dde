"""The engine-backend registry (``tidal.backends``): one entry per backend, every reference in
it loads, and the proxy and the runtime take what differs between backends from it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tidal.backends import (
    EngineBackend,
    backend_names,
    configured_backends,
    engine_backend,
    load,
    published_dtype,
    register_backend,
)
from tidal.config import RunConfig, validate_model
from tidal.errors import ConfigError
from tidal.runtime.cell import EngineHost
from tidal.serving.adapters import make_adapter
from tidal.serving.protocol import BadRequest
from tidal.user_modules import loaded_from_file


def test_tidals_backends_are_registered_and_every_reference_loads():
    assert backend_names() == ("builtin", "vllm", "sglang", "emulated")
    for name in backend_names():
        b = engine_backend(name)
        for ref in (b.adapter, b.cell_host, b.standalone_host, b.settings, b.check):
            if ref is not None:
                assert callable(load(ref)), ref
    assert [n for n in backend_names() if engine_backend(n).server] == ["vllm", "sglang"]
    assert engine_backend("sglang").standalone_host is None  # SGLang serves cells only


def test_the_proxy_builds_each_backends_adapter_and_refuses_an_unknown_one():
    assert [type(make_adapter(n, "http://127.0.0.1:1")).__name__ for n in backend_names()] == [
        "BuiltinAdapter",
        "VLLMAdapter",
        "SGLangAdapter",
        "BuiltinAdapter",  # the emulated engine serves the built-in engine's routes
    ]
    known = r"\(builtin, vllm, sglang, emulated\)"
    with pytest.raises(BadRequest, match=rf"unknown engine backend 'x' {known}"):
        make_adapter("x", "http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="unknown engine backend 'x'"):
        engine_backend("x")


def test_a_name_is_registered_once():
    register_backend(engine_backend("vllm"))  # the same entry again: no change
    with pytest.raises(ConfigError, match="registered already"):
        register_backend(
            EngineBackend(
                name="vllm", label="other", adapter="m:A", cell_host=None, standalone_host=None
            )
        )


def test_a_run_configures_its_cells_and_standalone_backends_in_registry_order():
    cfg = validate_model(
        RunConfig,
        {
            "cluster": {"cell_count": 2, "cells": [{"backend": "sglang"}, {}]},
            "runtime": {"cell_backend": "vllm"},
        },
    )
    assert [b.name for b in configured_backends(cfg)] == ["builtin", "vllm", "sglang"]
    assert [b.name for b in configured_backends(RunConfig())] == ["builtin"]


# -- a user's backend -----------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "backends" / "audited_builtin.py"


@pytest.fixture
def isolated(isolated_policies, isolated_backends):
    """What a test's modules and entry points register is gone after it."""
    return None


def test_a_users_backend_file_registers_from_the_run_config(isolated, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = validate_model(
        RunConfig,
        {  # one module as a plain string, as '--set' gives it
            "runtime": {
                "backend_modules": "examples/backends/audited_builtin.py",
                "cell_backend": "audited-builtin",
            }
        },
    )
    assert cfg.runtime.backend_modules == [str(EXAMPLE)]  # absolute: a resume loads it again
    assert [b.name for b in configured_backends(cfg)] == ["builtin", "audited-builtin"]
    entry = engine_backend("audited-builtin")
    host = load(entry.cell_host)
    assert issubclass(host, EngineHost) and host.__name__ == "AuditedHost"
    assert loaded_from_file(host.__module__)  # Ray's workers get it by value
    assert type(make_adapter("audited-builtin", "http://127.0.0.1:1")).__name__ == "BuiltinAdapter"
    # loading the same file again (another config, a resume) registers nothing twice
    validate_model(RunConfig, cfg.model_dump(mode="json"))


def test_unknown_or_unfit_backend_names_are_refused_naming_the_field():
    for data, field, words in [
        (
            {"runtime": {"cell_backend": "trt"}},
            "runtime.cell_backend",
            "unknown engine backend 'trt' (registered: builtin, vllm, sglang, emulated; a "
            "backend of your own registers from runtime.backend_modules)",
        ),
        (
            {"cluster": {"cells": [{"gpus": 1, "backend": "trt"}]}},
            "cluster.cells.0.backend",
            "unknown engine backend 'trt'",
        ),
        (
            {"runtime": {"standalone_backend": "sglang"}},
            "runtime.standalone_backend",
            "engine backend 'sglang' serves cells only",
        ),
        ({"runtime": {"cell_backend": "a b"}}, "runtime.cell_backend", "should match pattern"),
    ]:
        with pytest.raises(ConfigError) as info:
            validate_model(RunConfig, data)
        assert info.value.field == field and words in info.value.message, info.value


BAD_ENTRIES = {
    "name": 'EngineBackend(name="a b", label="x", adapter="m:A", cell_host="m:H", '
    "standalone_host=None)",
    "hosts": 'EngineBackend(name="nohost", label="x", adapter="m:A", cell_host=None, '
    "standalone_host=None)",
    "ref": 'EngineBackend(name="badref", label="x", adapter="tidal.serving.adapters", '
    'cell_host="m:H", standalone_host=None)',
    "taken": 'EngineBackend(name="vllm", label="mine", adapter="m:A", cell_host="m:H", '
    "standalone_host=None)",
    "venv": 'EngineBackend(name="myvenv", label="x", adapter="m:A", cell_host="m:H", '
    'standalone_host=None, package="mine", python_field="mine_python")',
}


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("name", "engine backend name 'a b': letters, digits, '_', '.', '-' only"),
        ("hosts", "names neither a cell_host nor a standalone_host"),
        ("ref", "adapter 'tidal.serving.adapters' is not 'module:attribute'"),
        ("taken", "engine backend 'vllm' is registered already"),
        ("venv", "python_field 'mine_python' is not a venv setting of runtime"),
    ],
)
def test_a_bad_backend_module_is_one_line_and_registers_nothing(isolated, tmp_path, kind, words):
    module = tmp_path / f"bad_{kind}.py"
    module.write_text(  # a good entry first: a module refused part-way leaves none
        "from tidal.backends import EngineBackend, register_backend\n"
        'register_backend(EngineBackend(name="first-ok", label="x", adapter="m:A", '
        'cell_host="m:H", standalone_host=None))\n'
        f"register_backend({BAD_ENTRIES[kind]})\n"
    )
    for _ in range(2):  # refused again the same way: nothing of it stayed registered
        with pytest.raises(ConfigError) as info:
            validate_model(RunConfig, {"runtime": {"backend_modules": [str(module)]}})
        assert info.value.field == "runtime.backend_modules"
        assert words in info.value.message and "\n" not in str(info.value)
        assert backend_names() == ("builtin", "vllm", "sglang", "emulated")


@pytest.mark.parametrize(
    ("modules", "field", "words"),
    [
        (["no/such/file.py"], "runtime.backend_modules", "no such file"),
        (
            ["tidal_plugin_absent"],
            "runtime.backend_modules",
            "tidal_plugin_absent does not import: ModuleNotFoundError",
        ),
        ([str(EXAMPLE), "tidal_plugin_absent"], "runtime.backend_modules.1", "does not import"),
    ],
)
def test_a_missing_backend_module_names_its_field(isolated, modules, field, words):
    with pytest.raises(ConfigError) as info:
        validate_model(RunConfig, {"runtime": {"backend_modules": modules}})
    assert info.value.field == field and words in info.value.message


def _installed(root: Path, module_text: str) -> None:
    """An installed distribution whose 'tidal.backends' entry point is ``module_text``."""
    dist = root / "tidal_plugin_engine-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tidal-plugin-engine\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text("[tidal.backends]\nmine = tidal_plugin_engine\n")
    (root / "tidal_plugin_engine.py").write_text(module_text)


def test_an_installed_entry_point_registers_its_backend(isolated, tmp_path, monkeypatch):
    _installed(tmp_path, EXAMPLE.read_text().replace('"audited-builtin"', '"ep-engine"'))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = validate_model(RunConfig, {"runtime": {"cell_backend": "ep-engine"}})
    assert cfg.runtime.backend_modules == [] and "tidal_plugin_engine" in sys.modules
    assert engine_backend("ep-engine").cell_host == "tidal_plugin_engine:AuditedHost"


def test_the_proxy_command_refuses_an_unknown_backend_in_one_line(isolated_backends):
    from click.testing import CliRunner

    from tidal.commands.proxy import command

    result = CliRunner().invoke(command, ["--backend", "audited-builtin"])
    assert result.exit_code == 2
    assert (
        "unknown engine backend 'audited-builtin' (registered: builtin, vllm, sglang, emulated)"
        in result.output
    )
    result = CliRunner().invoke(command, ["--backend-module", "no/such/file.py"])
    assert result.exit_code == 2 and "--backend-module" in result.output


def test_a_broken_entry_point_is_named_where_its_backend_is_asked_for(
    isolated, tmp_path, monkeypatch
):
    _installed(tmp_path, "raise RuntimeError('needs CUDA')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert validate_model(RunConfig, {}).runtime.cell_backend == "builtin"  # not in the way
    with pytest.raises(ConfigError) as info:
        validate_model(RunConfig, {"runtime": {"cell_backend": "ep-engine"}})
    assert info.value.field == "runtime.cell_backend"
    assert info.value.message.endswith(
        "entry point mine not loaded: tidal_plugin_engine: RuntimeError: needs CUDA)"
    )


def test_tidal_backends_lists_the_registered_and_a_users_module(isolated, capsys):
    from tidal.cli import main

    assert main(["backends"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[:3] for ln in lines] == [
        ["builtin", "cells+standalone", "process"],
        ["vllm", "cells+standalone", "server"],
        ["sglang", "cells", "server"],
        ["emulated", "cells+standalone", "process"],
    ]
    assert main(["backends", "--module", str(EXAMPLE)]) == 0
    last = capsys.readouterr().out.splitlines()[-1].split()
    assert last == [
        "audited-builtin",
        "cells+standalone",
        "process",
        "tidal.serving.adapters:BuiltinAdapter",
    ]
    assert main(["backends", "--module", "no/such/file.py"]) == 2
    assert "--module" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("data", "want"),
    [
        ({}, "float32"),  # the built-in engine reads float32 only
        ({"runtime": {"cell_backend": "vllm", "standalone_backend": "vllm"}}, "float32"),  # CPU
        (
            {"runtime": {"cell_backend": "vllm", "standalone_backend": "vllm", "use_gpus": True}},
            "bfloat16",
        ),  # vLLM's 'auto' on GPUs
        (
            {
                "cluster": {"standalone_count": 0},
                "runtime": {"cell_backend": "vllm", "use_gpus": True, "device": "cuda"},
            },
            "bfloat16",
        ),  # no standalone engine: its (built-in) backend reads nothing
        (
            {
                "runtime": {
                    "cell_backend": "vllm",
                    "standalone_backend": "vllm",
                    "use_gpus": True,
                    "vllm": {"dtype": "float32"},
                }
            },
            "float32",
        ),
        (
            {
                "cluster": {"standalone_count": 0, "cells": [{"backend": "builtin"}, {}]},
                "runtime": {"cell_backend": "vllm", "use_gpus": True},
            },
            "float32",
        ),  # one built-in cell
        (
            {
                "cluster": {"standalone_count": 0},
                "runtime": {"cell_backend": "sglang", "use_gpus": True},
            },
            "float32",
        ),  # float32 cells
    ],
)
def test_a_version_is_published_in_bfloat16_only_where_every_engine_serves_in_it(data, want):
    assert published_dtype(validate_model(RunConfig, data)) == want
