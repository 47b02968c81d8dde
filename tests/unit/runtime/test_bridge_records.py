"""The proxy's per-call records become training records with a weight version per token
(invariant 6), retried calls included; runtime config errors name their field."""

from __future__ import annotations

import pytest

from tidal.config import RunConfig, load_yaml, validate_model
from tidal.errors import ConfigError
from tidal.runtime.wiring import check_config as _check
from tidal.training.records import record_from_proxy, record_to_sequences


def _seg(engine, tokens, versions):
    return {
        "engine_id": engine,
        "request_id": f"{engine}-r",
        "token_ids": tokens,
        "logprobs": [-0.5] * len(tokens),
        "versions": versions,
    }


def test_a_call_retried_across_engines_and_versions_keeps_every_token_version():
    call = {
        "prompt_token_ids": [1, 2, 3],
        "output_token_ids": [7, 8, 9, 10],
        "segments": [_seg("c0", [7, 8], ["v2", "v2"]), _seg("s0", [9, 10], ["v2", "v3"])],
    }
    rec = record_from_proxy("e1", "g1", [call], reward=1.0, reason="completed")
    (mc,) = rec.calls
    assert mc.output_token_ids == [7, 8, 9, 10]
    assert [s.weight_versions for s in mc.segments] == [
        [[0, 2, "v2"]],
        [[0, 1, "v2"], [1, 2, "v3"]],
    ]
    assert mc.versions() == [2, 2, 2, 3] and rec.min_version() == 2
    (seq,) = record_to_sequences(rec)
    assert seq.n_trainable() == 4


def test_a_timed_out_execution_without_calls_is_still_a_record():
    rec = record_from_proxy("e2", "g1", [], reward=0.0, reason="timeout")
    assert rec.reason == "timeout" and rec.calls == []


def test_tiny_config_loads_and_the_runtime_accepts_it():
    cfg = load_yaml("configs/tiny.yaml")
    _check(cfg)
    assert cfg.runtime.model == "tiny" and cfg.control.bursts == 2


@pytest.mark.parametrize(
    "data, field",
    [
        ({"control": {"bursts": None}}, "control.bursts"),
        (
            {
                "control": {
                    "bursts": 1,
                    "batch_groups": 2,
                    "updates_per_burst": 1,
                    "quota_groups": 3,
                }
            },
            "control.quota_groups",
        ),
        (
            {
                "control": {"bursts": 1},
                "cluster": {"cell_count": 1, "cell_kind": "hybrid"},
                "policy": {"name": "verl-default", "args": {"rebalance": True}},
            },
            "policy.args.rebalance",
        ),
    ],
)
def test_what_the_runtime_cannot_run_is_refused_by_field(data, field):
    with pytest.raises(ConfigError) as info:
        _check(validate_model(RunConfig, data))
    assert info.value.field == field


def test_unknown_runtime_field_is_named():
    with pytest.raises(ConfigError) as info:
        validate_model(RunConfig, {"runtime": {"engines": 3}})
    assert info.value.field == "runtime.engines"


def test_the_satellite_bounds_reach_the_core_trainer_and_a_bad_one_is_named():
    from tidal.runtime.wiring import trainer_config

    cfg = validate_model(
        RunConfig,
        {
            "control": {"bursts": 1},
            "runtime": {"satellite_timeout_s": 300, "satellite_gather_timeout_s": 240},
        },
    )
    tc = trainer_config(cfg, "cpu", None, "127.0.0.1")
    assert tc.coordinator.join_timeout_s == 300 and tc.coordinator.gather_timeout_s == 240
    assert tc.step_data_timeout_s == cfg.runtime.step_data_timeout_s
    with pytest.raises(ConfigError) as info:
        validate_model(RunConfig, {"runtime": {"satellite_gather_timeout_s": 0}})
    assert info.value.field == "runtime.satellite_gather_timeout_s"
