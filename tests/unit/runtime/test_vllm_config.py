"""What ``runtime.standalone_backend: vllm`` refuses before anything starts (one ``ConfigError``
naming the field), and what the bridge counts per engine (the vLLM run reads these from
``summary.json``). The run itself is in tests/integration/runtime/test_vllm_run.py (vLLM tier).
"""

from __future__ import annotations

import asyncio
import os
import stat

import httpx
import pytest

from tidal.config import RunConfig, load_yaml, validate_model
from tidal.contracts import CallRecord
from tidal.errors import ConfigError
from tidal.runtime.bridge import LedgerBridge
from tidal.runtime.tasks import Parts
from tidal.runtime.wiring import check_config as _check


def _cfg(**runtime) -> RunConfig:
    base = load_yaml("configs/vllm.yaml").model_dump(mode="json")
    for key, value in runtime.items():  # a backend's section (vllm, sglang) is merged
        if isinstance(value, dict) and isinstance(base["runtime"].get(key), dict):
            base["runtime"][key] = {**base["runtime"][key], **value}
        else:
            base["runtime"][key] = value
    return validate_model(RunConfig, base)


def test_vllm_yaml_needs_a_vllm_python(monkeypatch):
    monkeypatch.delenv("TIDAL_VLLM_PYTHON", raising=False)
    with pytest.raises(ConfigError) as info:
        _check(_cfg())
    assert info.value.field == "runtime.vllm.python"
    assert "make vllm-venv" in info.value.message and "TIDAL_VLLM_PYTHON" in info.value.message


def test_a_vllm_python_that_is_not_there_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("TIDAL_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(ConfigError) as info:
        _check(_cfg())
    assert info.value.field == "runtime.vllm.python" and "nope" in info.value.message


def test_the_field_wins_over_the_environment(monkeypatch, tmp_path):
    exe = tmp_path / "python"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("TIDAL_VLLM_PYTHON", "/nonexistent/python")
    cfg = _cfg(vllm={"python": str(exe)})
    _check(cfg)
    assert cfg.runtime.resolved_vllm_python() == str(exe)


@pytest.mark.parametrize(
    "runtime, cluster, field, words",
    [
        ({"model": "tiny"}, {}, "runtime.standalone_backend", "tiny"),
        ({}, {"standalone_count": 0}, "runtime.standalone_backend", "standalone_count"),
    ],
)
def test_what_vllm_cannot_serve_is_refused(monkeypatch, runtime, cluster, field, words):
    monkeypatch.setenv("TIDAL_VLLM_PYTHON", os.path.realpath("/bin/sh"))
    base = load_yaml("configs/vllm.yaml").model_dump(mode="json")
    base["runtime"].update(runtime)
    base["cluster"].update(cluster)
    with pytest.raises(ConfigError) as info:
        _check(validate_model(RunConfig, base))
    assert info.value.field == field and words in info.value.message


@pytest.mark.parametrize("value", ["sglang", "auto"])
def test_unknown_backends_are_config_errors(value):
    with pytest.raises(ConfigError) as info:
        _cfg(standalone_backend=value)
    assert info.value.field == "runtime.standalone_backend"


def test_kv_cache_is_positive():
    assert _cfg(vllm={"kv_cache_gb": 0.125}).runtime.vllm.kv_cache_gb == 0.125
    with pytest.raises(ConfigError) as info:
        _cfg(vllm={"kv_cache_gb": 0})
    assert info.value.field == "runtime.vllm.kv_cache_gb"


def test_the_bridge_counts_tokens_by_engine_and_version_and_moves_between_engines():
    calls = [
        {
            "prompt_token_ids": [1],
            "segments": [
                {
                    "engine_id": "c0",
                    "request_id": "r0",
                    "token_ids": [5, 6],
                    "logprobs": [-1.0, -1.0],
                    "versions": ["v0", "v0"],
                    "ended_by": "abort",
                },
                {
                    "engine_id": "s0",
                    "request_id": "r1",
                    "token_ids": [7],
                    "logprobs": [-1.0],
                    "versions": ["v2"],
                    "ended_by": "length",
                },
            ],
        },
        {
            "prompt_token_ids": [1],
            "segments": [
                {
                    "engine_id": "s0",
                    "request_id": "r2",
                    "token_ids": [8],
                    "logprobs": [-1.0],
                    "versions": ["v2"],
                    "ended_by": "stop",
                }
            ],
        },
    ]
    b = LedgerBridge(None, None, httpx.AsyncClient(), None, 4, Parts())
    b._count([CallRecord.model_validate(c) for c in calls])
    assert b.tokens_by_engine_version == {"c0": {"v0": 2}, "s0": {"v2": 2}}
    assert b.engine_handoffs == {"c0->s0": 1}
    asyncio.run(b.admin.aclose())
