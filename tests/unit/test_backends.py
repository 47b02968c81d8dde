"""The engine-backend registry (``tidal.backends``): one entry per backend, every reference in
it loads, and the proxy and the runtime take what differs between backends from it."""

from __future__ import annotations

import pytest

from tidal.backends import (
    EngineBackend,
    backend_names,
    configured_backends,
    engine_backend,
    load,
    register_backend,
)
from tidal.config import RunConfig, validate_model
from tidal.errors import ConfigError
from tidal.serving.adapters import make_adapter
from tidal.serving.protocol import BadRequest


def test_the_three_backends_are_registered_and_every_reference_loads():
    assert backend_names() == ("builtin", "vllm", "sglang")
    for name in backend_names():
        b = engine_backend(name)
        for ref in (b.adapter, b.cell_host, b.standalone_host, b.settings, b.check):
            if ref is not None:
                assert callable(load(ref)), ref
    assert [n for n in backend_names() if engine_backend(n).server] == ["vllm", "sglang"]
    assert engine_backend("sglang").standalone_host is None  # SGLang serves cells only


def test_the_proxy_builds_each_backends_adapter_and_refuses_an_unknown_one():
    assert [type(make_adapter(n, "http://127.0.0.1:1")).__name__ for n in backend_names()] \
        == ["BuiltinAdapter", "VLLMAdapter", "SGLangAdapter"]
    with pytest.raises(BadRequest, match=r"unknown engine backend 'x' \(builtin, vllm, sglang\)"):
        make_adapter("x", "http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="unknown engine backend 'x'"):
        engine_backend("x")


def test_a_name_is_registered_once():
    register_backend(engine_backend("vllm"))  # the same entry again: no change
    with pytest.raises(ConfigError, match="registered already"):
        register_backend(EngineBackend(name="vllm", label="other", adapter="m:A",
                                       cell_host=None, standalone_host=None))


def test_a_run_configures_its_cells_and_standalone_backends_in_registry_order():
    cfg = validate_model(RunConfig, {
        "cluster": {"cell_count": 2, "cells": [{"backend": "sglang"}, {}]},
        "runtime": {"cell_backend": "vllm"}})
    assert [b.name for b in configured_backends(cfg)] == ["builtin", "vllm", "sglang"]
    assert [b.name for b in configured_backends(RunConfig())] == ["builtin"]
