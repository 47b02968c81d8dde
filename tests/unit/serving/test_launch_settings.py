"""Each setting of ``tidal proxy`` and ``tidal engine`` is defined once
(``tidal.contracts.launch``): the command line ``serving.launch`` builds from a settings value
parses back, through the real click command, to the same value; so do the options a person
types (generated from the same fields); a bad value is a usage error naming its option."""

from __future__ import annotations

import click
import pytest

from tidal.commands import engine, proxy
from tidal.commands._settings import settings_from, to_args
from tidal.contracts.launch import EngineSettings, ProxySettings
from tidal.serving.launch import engine_args, proxy_args

PROXY = ProxySettings(
    port=9123,
    host="0.0.0.0",
    engines=["http://a:1", "http://b:2"],
    cells=["http://c:3"],
    backend="vllm",
    backend_modules=["my.backends"],
    cap=7,
    max_open_executions=20_480,
    kv_handoff=False,
    wait_s=3.5,
    require_registration=True,
    request_timeout_s=12.5,
    read_timeout_s=4.0,
    max_prompt_tokens=65536,
    seed=-3,
    admission="0.05",
    admission_order="shortest_remaining",
    engine_curve=[(1, 200.0), (32, 3200.5)],
    tool_call_parser="hermes",
    affinity=False,
)
ENGINE = EngineSettings(
    model_dir="/models/tiny",
    port=9124,
    host="0.0.0.0",
    name="tiny",
    max_batch=5,
    max_waiting=9,
    threads=2,
    weight_version="v3",
    seed=11,
    step_in_thread=True,
    device="cuda:1",
    spill_dir="/tmp/spill",
    read_timeout_s=2.0,
    tool_call_parser="hermes",
    prefix_cache_mb=64.0,
    deterministic=True,
)
CASES = [
    (proxy.command, ProxySettings, PROXY, proxy_args),
    (engine.command, EngineSettings, ENGINE, engine_args),
]


def _parsed(command: click.Command, model: type, args: list[str]):
    ctx = command.make_context(command.name, list(args))
    params = dict(ctx.params)
    params.pop("admin_token", None), params.pop("engine_token", None), params.pop("token", None)
    return settings_from(model, params)


@pytest.mark.parametrize(("command", "model", "value", "launch_args"), CASES)
def test_the_launch_command_line_parses_back_to_its_settings(command, model, value, launch_args):
    args = launch_args(value)
    assert args[0] == command.name
    assert _parsed(command, model, args[1:]) == value
    every = set(model.model_fields)
    assert {k for k, v in value if v != model.model_fields[k].default} == every - {
        "tool_call_parser"
    }  # every field but the one-choice parser differs from its default


@pytest.mark.parametrize(("command", "model", "value", "launch_args"), CASES)
def test_the_typed_options_parse_back_to_the_settings(command, model, value, launch_args):
    assert _parsed(command, model, to_args(value)) == value
    required = {k: getattr(value, k) for k, f in model.model_fields.items() if f.is_required()}
    assert _parsed(command, model, to_args(model(**required))) == model(**required)


def test_a_bad_option_is_one_usage_error_naming_it():
    with pytest.raises(click.BadParameter) as exc:
        _parsed(proxy.command, ProxySettings, ["--cap", "0"])
    assert exc.value.param_hint == "--cap" and "greater than or equal to 1" in exc.value.message
    with pytest.raises(click.BadParameter) as exc:
        _parsed(proxy.command, ProxySettings, ["--engine-curve", "1-200"])
    assert exc.value.param_hint == "--engine-curve"
    with pytest.raises(click.BadParameter) as exc:
        _parsed(engine.command, EngineSettings, [])
    assert exc.value.param_hint == "--model"
