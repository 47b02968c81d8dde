"""The agent harnesses people run, unmodified, through ``tidal proxy`` over a built-in engine
process: Claude Code (npm ``@anthropic-ai/claude-code``, Anthropic Messages, streamed) and Codex
CLI (npm ``@openai/codex``, OpenAI Responses, streamed), each started by its wrapper in
``configs/harnesses/`` exactly as the ``command`` agent kind starts it (the execution's own base
URL and ``tx-`` key in ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, its own workspace). Each exits
0, its calls are recorded under its execution, with the ids the engine sampled, and a second
execution's key is not mixed with the first's.

Needs ``make harnesses`` (a prerequisite of ``make test``); skipped without it. The model is the
plumbing model of ``configs/claude-code.yaml``: tiny, random, 16384 positions, answers that end
after a few tokens (``tidal model init-tiny --short-answers``)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tidal.serving.execution_keys import execution_key, execution_url
from tidal.serving.launch import start_engine, start_proxy

ROOT = Path(__file__).resolve().parents[3]
BIN = ROOT / "harnesses" / "node_modules" / ".bin"
TOKEN = "harness-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = "calc.py: add(2, 3) returns -1, it must return 5. Fix it."

pytestmark = pytest.mark.skipif(not (BIN / "claude").exists() or not (BIN / "codex").exists(),
                                reason="the harnesses are not installed: make harnesses")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import torch

    from tidal.models import create_tiny
    from tidal.testing.chat_models import HERMES_TOOLS_TEMPLATE, set_template, shorten_answers

    torch.set_num_threads(1)
    model = create_tiny(tmp_path_factory.mktemp("m") / "tiny", seed=0, vocab_size=2048,
                        n_layers=2, d_model=64, n_heads=2, d_ff=256, max_seq_len=16384)
    set_template(model, HERMES_TOOLS_TEMPLATE)
    shorten_answers(model)
    logs = tmp_path_factory.mktemp("logs")
    engine = start_engine(model, name="tiny", max_batch=4, log_path=logs / "e.log",
                          token=TOKEN, step_in_thread=True).wait_healthy(120)
    proxy = start_proxy([engine.url], [], TOKEN, cap=4, log_path=logs / "p.log")
    try:
        proxy.wait_healthy(60)
        yield proxy.url
    finally:
        proxy.stop()
        engine.stop()


def _run(script: str, args: list[str], url: str, eid: str, ws: Path, extra: dict | None = None
         ) -> tuple[subprocess.CompletedProcess, float]:
    ws.mkdir(parents=True)
    (ws / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    env = {**os.environ, "OPENAI_BASE_URL": execution_url(url, eid),
           "OPENAI_API_KEY": execution_key(TOKEN, eid), "OPENAI_MODEL": "tiny",
           "TIDAL_EXECUTION_ID": eid, "TIDAL_WORKSPACE": str(ws), **(extra or {})}
    t0 = time.monotonic()
    proc = subprocess.run([str(ROOT / "configs" / "harnesses" / script), PROMPT, *args],
                          cwd=ws, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=300)
    return proc, time.monotonic() - t0


def _calls(url: str, eid: str) -> list[dict]:
    r = httpx.get(f"{url}/tidal/executions/{eid}/records", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()["calls"]


def _check_records(calls: list[dict]) -> None:
    assert calls
    for c in calls:
        sampled = [t for s in c["segments"] for t in s["token_ids"]]
        assert c["output_token_ids"] == sampled and sampled, c
        assert len(c["prompt_token_ids"]) > 1000  # the harness's own system prompt and tools


@pytest.mark.parametrize("eid", ["cc-a", "cc-b"])
def test_claude_code_unmodified(served, tmp_path, eid):
    proc, took = _run("claude-code.sh", ["--tools", "Bash", "--max-turns", "4",
                                         "--system-prompt", "You fix bugs."],
                      served, eid, tmp_path / "ws", {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "API Error" not in proc.stdout + proc.stderr
    _check_records(_calls(served, eid))
    print(f"claude-code {eid}: {took:.1f} s, {len(_calls(served, eid))} calls")


def test_codex_unmodified(served, tmp_path):
    proc, took = _run("codex.sh", [], served, "cx-a", tmp_path / "ws")
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "ERROR" not in proc.stdout + proc.stderr
    calls = _calls(served, "cx-a")
    _check_records(calls)
    print(f"codex: {took:.1f} s, {len(calls)} calls")
