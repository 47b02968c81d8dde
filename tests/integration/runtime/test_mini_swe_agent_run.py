"""mini-swe-agent, unmodified, as a black-box ``command`` agent through ``tidal run``: the
shipped configs/mini-swe-agent.yaml shortened (the tiny model, one burst, four executions).
While its executions are mid-flight the standalone engine is drained (its live calls move to
the cells) and then a cell's engine process is SIGKILLed under its live actor (the supervisor
replaces it; the proxy retries the lost calls elsewhere). Checked: no failed request, every
execution closes once with the harness's own exit code 0 (its model client may not retry:
MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT=1, so a model-call error would end it non-zero), and the
harness's own log shows no model-call error or retry."""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path

import pytest
import yaml

from tidal.config import RunConfig, validate_model
from tidal.runtime.driver import Runtime

from .busy import drain_then_kill

if importlib.util.find_spec("minisweagent") is None:  # (importing it prints a banner)
    pytest.skip("mini-swe-agent is not installed (the 'swe' extra)", allow_module_level=True)
CONFIG = Path(__file__).resolve().parents[3] / "configs" / "mini-swe-agent.yaml"


def _short() -> RunConfig:
    data = yaml.safe_load(CONFIG.read_text())
    data["control"].update(bursts=1, step_timeout_s=240)
    data["runtime"] = {
        "model": "tiny",
        "tiny_max_seq_len": 4096,
        "engine_max_batch": 8,
        "token_budget": 8192,
        "execution_timeout_s": 240,
        "run_timeout_s": 600,
    }
    agent = data["task"]["agent"]
    agent["command"] = [a.replace("max_tokens=96", "max_tokens=48") for a in agent["command"]]
    agent["env"]["MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT"] = "1"
    # the network is a dead end for the harness (loopback excepted): a fetch at import (e.g.
    # litellm's model-cost map, were the config not to keep it local) fails and shows in its log
    dead = "http://127.0.0.1:9"
    agent["env"].update(HTTP_PROXY=dead, HTTPS_PROXY=dead, NO_PROXY="127.0.0.1,localhost")
    return validate_model(RunConfig, data)


def test_mini_swe_agent_runs_unmodified_through_moves_and_a_crash(tmp_path):
    runtime = Runtime(_short(), tmp_path / "run")
    seen: dict = {}
    chaos = threading.Thread(target=drain_then_kill, args=(runtime, seen), daemon=True)
    chaos.start()
    summary = runtime.run()
    chaos.join(10)
    print(
        json.dumps(
            {
                k: summary[k]
                for k in ("run_time_s", "rerouted_requests", "cells_replaced", "close_reasons")
            }
        ),
        seen,
    )

    assert seen["drained"]["moved"] >= 1 and seen.get("killed"), seen
    assert summary["cells_replaced"] == [seen["killed"]]
    assert summary["failed_requests"] == 0 and summary["lost_executions"] == 0
    assert summary["dispatched"] == summary["closed"] == summary["trained_executions"] == 4
    assert summary["duplicate_closes"] == 0 and summary["record_errors"] == []
    for ws in sorted((tmp_path / "run" / "workspaces").iterdir()):
        outcome = json.loads((ws / ".tidal" / "outcome.json").read_text())
        logs = (ws / ".tidal" / "stdout.log").read_text() + (
            ws / ".tidal" / "stderr.log"
        ).read_text()
        assert outcome["exit_code"] == 0 and outcome["reason"] == "completed", (ws, logs[-2000:])
        for bad in (
            "Retrying",
            "APIConnectionError",
            "InternalServerError",
            "APIError",
            "Traceback",
            "model cost map",
        ):
            assert bad not in logs, (ws.name, bad)
        trajectory = json.loads((ws / ".tidal" / "trajectory.json").read_text())
        assert trajectory["info"]["exit_status"] in (
            "Submitted",
            "LimitsExceeded",
            "RepeatedFormatError",
        )
        assert trajectory["info"]["model_stats"]["api_calls"] >= 1
