"""The agent harnesses people run, unmodified, as ``command`` agents through ``tidal run``:
Claude Code (npm ``@anthropic-ai/claude-code``, Anthropic Messages, streamed) and Codex CLI (npm
``@openai/codex``, OpenAI Responses, streamed), each started by its wrapper in
``configs/harnesses/`` from the shipped ``configs/claude-code.yaml`` / ``configs/codex.yaml``
(shortened: one burst of four executions, the plumbing model written here, with 16384
positions, and shorter system prompts than the harnesses' own: ``SHORTER``). While their calls
are in flight the standalone engine is drained (its live calls move to the cells) and then a cell
engine with calls in flight is SIGKILLed under its live actor (the supervisor replaces it; the
proxy retries the lost calls elsewhere). Checked: 0 failed requests, 0 lost, every execution
closed once with the harness's own exit code 0 (``.tidal/outcome.json``), the harness's own log
(``.tidal/stdout.log`` / ``stderr.log``) shows no model-call error, and every call the proxy
hands to training has the token ids its engines sampled (the output ids equal the engines'
segments joined), with at least one call served by two engines.

Needs ``make harnesses`` (a prerequisite of ``make test``); skipped without it. The model is the
configs' plumbing model (16384 positions here): tiny, random, answers that end after a few tokens
(``tidal model init-tiny --short-answers``)."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import yaml

from tidal.config import RunConfig, validate_model
from tidal.runtime import bridge
from tidal.runtime.driver import Runtime

from .busy import drain_then_kill

ROOT = Path(__file__).resolve().parents[3]
BIN = ROOT / "harnesses" / "node_modules" / ".bin"
# a model-call error as each harness prints it: Claude Code's "API Error: ...", Codex's
# "ERROR: ..." and its stream-retry notice ("Reconnecting... 1/5")
MODEL_ERROR = re.compile(r"^(API Error|ERROR)|Reconnecting\.\.\.", re.M)

pytestmark = pytest.mark.skipif(
    not (BIN / "claude").exists() or not (BIN / "codex").exists(),
    reason="the harnesses are not installed: make harnesses",
)


@pytest.fixture(scope="module")
def plumbing_model(tmp_path_factory):
    """``tidal model init-tiny --max-seq-len 16384 --vocab-size 2048 --short-answers
    --chat-template hermes-tools --layers 2 --d-model 64 --heads 2`` (the configs' comment)."""
    from tidal.models import create_tiny
    from tidal.testing.chat_models import HERMES_TOOLS_TEMPLATE, set_template, shorten_answers

    model = create_tiny(
        tmp_path_factory.mktemp("m") / "tiny-harness",
        seed=0,
        vocab_size=2048,
        n_layers=2,
        d_model=64,
        n_heads=2,
        d_ff=256,
        max_seq_len=16384,
    )
    set_template(model, HERMES_TOOLS_TEMPLATE)
    shorten_answers(model)
    return model


# shorter prompts than the harnesses' own (~2.4K and ~5K tokens in place of ~48.6K and ~14.6K):
# a 48.6K-token prefill of the plumbing model takes ~33 s of one core, and training on it more
SHORTER = {
    "claude-code.yaml": (
        ["--tools", "Bash", "--system-prompt", "You fix bugs in the repository."],
        {},
    ),
    "codex.yaml": (
        [],
        {
            "CODEX_INSTRUCTIONS": "You are a coding agent. Run shell commands with exec_command "
            "to fix the task, then answer briefly."
        },
    ),
}


def _short(config: str, model: Path) -> RunConfig:
    data = yaml.safe_load((ROOT / "configs" / config).read_text())
    data["control"].update(bursts=1, step_timeout_s=240)
    data["runtime"].update(
        model=str(model),
        token_budget=16384,
        execution_timeout_s=240,
        step_data_timeout_s=300,
        run_timeout_s=600,
    )
    args, env = SHORTER[config]
    agent = data["task"]["agent"]
    agent["command"] += args
    agent["env"] = {**agent.get("env", {}), **env}
    return validate_model(RunConfig, data)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", ["claude-code.yaml", "codex.yaml"])
def test_harness_runs_unmodified_through_a_drain_and_an_engine_kill(
    plumbing_model, tmp_path, monkeypatch, config
):
    delivered: list[dict] = []  # every call the proxy handed to training, as it came
    real = bridge.record_from_proxy

    def keep(eid, gid, calls, *args, **kwargs):
        delivered.extend(calls)
        return real(eid, gid, calls, *args, **kwargs)

    monkeypatch.setattr(bridge, "record_from_proxy", keep)
    t0 = time.monotonic()
    runtime = Runtime(_short(config, plumbing_model), tmp_path / "run")
    seen: dict = {}
    chaos = threading.Thread(target=drain_then_kill, args=(runtime, seen), daemon=True)
    chaos.start()
    summary = runtime.run()
    chaos.join(10)
    keys = ("run_time_s", "rerouted_requests", "cells_replaced", "close_reasons")
    print(config, f"{time.monotonic() - t0:.1f} s", {k: summary.get(k) for k in keys}, seen)

    assert seen.get("drained", {}).get("moved", 0) >= 1 and seen.get("killed"), seen
    assert summary["cells_replaced"] == [seen["killed"]]
    assert summary["failed_requests"] == 0 and summary["lost_executions"] == 0
    assert summary["dispatched"] == summary["closed"] == summary["trained_executions"] == 4
    assert summary["duplicate_closes"] == 0 and summary["record_errors"] == []
    workspaces = sorted((tmp_path / "run" / "workspaces").iterdir())
    assert len(workspaces) == 4
    for ws in workspaces:
        outcome = json.loads((ws / ".tidal" / "outcome.json").read_text())
        logs = (ws / ".tidal" / "stdout.log").read_text() + (
            ws / ".tidal" / "stderr.log"
        ).read_text()
        assert outcome["exit_code"] == 0 and outcome["reason"] == "completed", (ws, logs[-2000:])
        assert not MODEL_ERROR.search(logs), (ws.name, logs[-2000:])
    assert len(delivered) >= 4
    for call in delivered:
        sampled = [t for s in call["segments"] for t in s["token_ids"]]
        assert call["output_token_ids"] == sampled and sampled, call
        assert len(call["prompt_token_ids"]) > 1000  # the harness's own system prompt and tools
    moved = [c for c in delivered if len({s["engine_id"] for s in c["segments"]}) > 1]
    assert moved, [[s["engine_id"] for s in c["segments"]] for c in delivered]
