"""The agent harnesses people run, unmodified, through ``tidal proxy`` over a built-in engine
process: Claude Code (npm ``@anthropic-ai/claude-code``, Anthropic Messages, streamed) and Codex
CLI (npm ``@openai/codex``, OpenAI Responses, streamed), each started by its wrapper in
``configs/harnesses/`` exactly as the ``command`` agent kind starts it (the execution's own base
URL and ``tx-`` key in ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, its own workspace). Each exits
0, its calls are recorded under its execution with the ids the engines sampled, and a call in
flight when its engine is drained (Claude Code) or SIGKILLed (Codex) moves to the other engine:
the harness exits 0 with no model-call error in its own output.

Needs ``make harnesses`` (a prerequisite of ``make test``); skipped without it. The model is the
plumbing model of ``configs/claude-code.yaml``: tiny, random, 16384 positions, answers that end
after a few tokens (``tidal model init-tiny --short-answers``)."""

from __future__ import annotations

import os
import re
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

pytestmark = pytest.mark.skipif(
    not (BIN / "claude").exists() or not (BIN / "codex").exists(),
    reason="the harnesses are not installed: make harnesses",
)


@pytest.fixture(scope="module")
def plumbing_model(tmp_path_factory):
    import torch

    from tidal.models import create_tiny
    from tidal.testing.chat_models import HERMES_TOOLS_TEMPLATE, set_template, shorten_answers

    torch.set_num_threads(1)
    model = create_tiny(
        tmp_path_factory.mktemp("m") / "tiny",
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


@pytest.fixture(scope="module")
def pair(plumbing_model, tmp_path_factory):
    """Two engines (a standalone s0 and a rollout cell c0) behind one proxy."""
    logs = tmp_path_factory.mktemp("logs")
    engines = [
        start_engine(
            plumbing_model,
            name="tiny",
            max_batch=4,
            log_path=logs / f"e{i}.log",
            token=TOKEN,
            step_in_thread=True,
        )
        for i in range(2)
    ]
    proxy = None
    try:
        for e in engines:
            e.wait_healthy(120)
        proxy = start_proxy(
            [engines[0].url], [engines[1].url], TOKEN, cap=4, log_path=logs / "p.log"
        ).wait_healthy(60)
        yield engines, proxy.url
    finally:
        if proxy is not None:
            proxy.stop()
        for e in engines:
            e.stop()


@pytest.fixture(scope="module")
def served(pair):
    return pair[1]


def _start(
    script: str, args: list[str], url: str, eid: str, ws: Path, extra: dict | None = None
) -> subprocess.Popen:
    """The harness's wrapper as the command agent kind starts it."""
    ws.mkdir(parents=True)
    (ws / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    env = {
        **os.environ,
        "OPENAI_BASE_URL": execution_url(url, eid),
        "OPENAI_API_KEY": execution_key(TOKEN, eid),
        "OPENAI_MODEL": "tiny",
        "TIDAL_EXECUTION_ID": eid,
        "TIDAL_WORKSPACE": str(ws),
        **(extra or {}),
    }
    return subprocess.Popen(
        [str(ROOT / "configs" / "harnesses" / script), PROMPT, *args],
        cwd=ws,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run(*args, **kwargs) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = _start(*args, **kwargs)
    out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), time.monotonic() - t0


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
    proc, took = _run("claude-code.sh", CLAUDE_ARGS, served, eid, tmp_path / "ws", CLAUDE_ENV)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert not re.search(r"^API Error", proc.stdout + proc.stderr, re.M)
    _check_records(_calls(served, eid))
    print(f"claude-code {eid}: {took:.1f} s, {len(_calls(served, eid))} calls")


CLAUDE_ARGS = ["--tools", "Bash", "--max-turns", "4", "--system-prompt", "You fix bugs."]
CLAUDE_ENV = {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"}


def test_codex_unmodified(served, tmp_path):
    proc, took = _run("codex.sh", [], served, "cx-a", tmp_path / "ws")
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert not re.search(r"^ERROR", proc.stdout + proc.stderr, re.M)
    calls = _calls(served, "cx-a")
    _check_records(calls)
    print(f"codex: {took:.1f} s, {len(calls)} calls")


def _moved_mid_call(pair, tmp_path, script, args, extra, eid, disturb) -> list[dict]:
    """Starts the harness, waits until one of its calls is on an engine, disturbs that engine
    (``disturb(engines, index)``), and returns the harness's calls once it exits 0."""
    engines, url = pair
    proc = _start(script, args, url, eid, tmp_path / "ws", extra)
    try:
        deadline, victim = time.monotonic() + 120, None
        while victim is None and proc.poll() is None and time.monotonic() < deadline:
            members = httpx.get(f"{url}/tidal/engines", headers=ADMIN).json()["engines"]
            victim = next(
                (
                    i
                    for i, e in enumerate(engines)
                    for m in members
                    if m["url"] == e.url and m["inflight"] >= 1
                ),
                None,
            )
            time.sleep(0.005)
        assert victim is not None, "no call of the harness was seen in flight"
        disturb(engines, victim)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, (out[-2000:], err[-2000:])
    assert not re.search(r"^(API Error|ERROR)", out + err, re.M), (out, err)
    calls = _calls(url, eid)
    _check_records(calls)
    moved = [c for c in calls if len({s["engine_id"] for s in c["segments"]}) > 1]
    assert moved, [[s["engine_id"] for s in c["segments"]] for c in calls]
    return calls


def test_claude_code_call_survives_a_drain(pair, tmp_path):
    url = pair[1]

    def drain(engines, victim):
        name = "s0" if victim == 0 else "c0"
        r = httpx.post(f"{url}/tidal/engines/{name}/drain", headers=ADMIN, timeout=120)
        assert r.status_code == 200, r.text
        httpx.post(f"{url}/tidal/engines/{name}/undrain", headers=ADMIN)

    _moved_mid_call(pair, tmp_path, "claude-code.sh", CLAUDE_ARGS, CLAUDE_ENV, "cc-drain", drain)


def test_codex_call_survives_an_engine_kill(pair, tmp_path):
    """Last in this module: it leaves one engine."""
    _moved_mid_call(
        pair,
        tmp_path,
        "codex.sh",
        [],
        None,
        "cx-kill",
        lambda engines, victim: engines[victim].kill(),
    )
    stats = httpx.get(f"{pair[1]}/tidal/stats", headers=ADMIN).json()
    assert stats["engine_failures"] == 1 and stats["failed_calls"] == 0
