"""A hostile command agent (a real script) against the sandbox it runs in: as root it runs as
its own user and cannot read tidal's processes' environments (the run's tokens), the run
directory or the tokens in its own environment; a daemon that clears its environment and
double-forks dies with its execution; output past the cap is dropped and marked."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tidal.agents.kinds import AgentContext, build_agent
from tidal.agents.sandbox import AGENT_USER, cover_for, environment
from tidal.agents.tasks import TaskRow
from tidal.config import AgentConfig
from tidal.errors import ConfigError

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="agents run as their own user only as root")


@pytest.fixture
def run_dir():
    """A run directory every user could enter (so the sandbox, not the path, must close it)."""
    top = Path(tempfile.mkdtemp(prefix="tidal-sandbox-test-", dir="/tmp"))
    top.chmod(0o755)
    run = top / "run"
    (run / "workspaces" / "b0-g0-e0").mkdir(parents=True)
    (top / "bin").mkdir()
    (run / "config.yaml").write_text("secret: in the run directory\n")
    (run / "config.yaml").chmod(0o644)
    yield run
    shutil.rmtree(top, ignore_errors=True)


def _ctx(ws: Path, timeout_s: float = 20.0) -> AgentContext:
    return AgentContext(
        "b0-g0-e0",
        "b0-g0",
        TaskRow(0, prompt="p"),
        ws,
        "http://127.0.0.1:9/x/b0-g0-e0/v1",
        "tx-key",
        "http://127.0.0.1:9",
        "m",
        timeout_s,
        8,
        1,
        1.0,
        0,
    )


def _script(run: Path, name: str, body: str) -> str:
    """A script every user can read, outside the run directory (which the agent cannot see;
    pytest's own tmp_path is root's only)."""
    path = run.parent / "bin" / name
    path.write_text(textwrap.dedent(body))
    path.chmod(0o755)
    return str(path)


HOSTILE = """\
import json, os, sys
tried = {}
def attempt(name, fn):
    try:
        tried[name] = "READ: " + repr(fn())[:80]
    except Exception as exc:
        tried[name] = "refused: " + type(exc).__name__
for name, pid in (("proxy", sys.argv[1]), ("driver", sys.argv[2])):
    attempt(name + "_environ", lambda: open(f"/proc/{pid}/environ", "rb").read())
    attempt(name + "_cmdline", lambda: open(f"/proc/{pid}/cmdline", "rb").read())
attempt("run_dir_listing", lambda: os.listdir(sys.argv[3]))
attempt("workspaces_listing", lambda: os.listdir(os.path.join(sys.argv[3], "workspaces")))
attempt("run_dir_config", lambda: open(os.path.join(sys.argv[3], "config.yaml")).read())
attempt("own_env_token", lambda: os.environ["TIDAL_ADMIN_TOKEN"])
attempt("proc_1_environ_token", lambda: [p for p in os.listdir("/proc") if p.isdigit()
        and b"TIDAL_ADMIN_TOKEN" in open(f"/proc/{p}/environ", "rb").read()] or 1 / 0)
tried["uid"] = os.getuid()
tried["workspace_listing"] = sorted(os.listdir(os.environ["TIDAL_WORKSPACE"]))
json.dump(tried, open("tried.json", "w"))
"""


@needs_root
def test_a_hostile_agent_cannot_read_the_runs_secrets(run_dir, monkeypatch):
    monkeypatch.setenv("TIDAL_ADMIN_TOKEN", "admin-secret-7f3")
    monkeypatch.setenv("TIDAL_ENGINE_TOKEN", "engine-secret-7f3")
    # a process holding the run's token in its environment, as the proxy does
    proxy = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ}
    )
    try:
        script = _script(run_dir, "hostile.py", HOSTILE)
        agent = build_agent(
            AgentConfig(
                kind="command",
                command=["{python}", script, str(proxy.pid), str(os.getpid()), str(run_dir)],
            )
        )
        ws = run_dir / "workspaces" / "b0-g0-e0"
        out = asyncio.run(agent.run(_ctx(ws)))
    finally:
        proxy.kill()
        proxy.wait(10)
    assert out.exit_code == 0, out.stderr_tail
    tried = json.loads((ws / "tried.json").read_text())
    read = {k: v for k, v in tried.items() if str(v).startswith("READ")}
    assert not read, read
    assert tried["uid"] == pwd.getpwnam(AGENT_USER).pw_uid != 0
    assert ".tidal" in tried["workspace_listing"]  # its own workspace, at its own path
    assert ws.stat().st_uid == tried["uid"]  # given to the agent's user


def test_the_runs_tokens_never_reach_an_agents_environment():
    env = environment(
        {
            "TIDAL_ADMIN_TOKEN": "a",
            "TIDAL_ENGINE_TOKEN": "b",
            "PATH": "/bin",
            "TIDAL_WORKSPACE": "/w",
        }
    )
    assert env == {"PATH": "/bin", "TIDAL_WORKSPACE": "/w"}


@needs_root
def test_the_run_directory_is_hidden_unless_a_parent_is_closed_anyway(run_dir, tmp_path):
    uid = pwd.getpwnam(AGENT_USER).pw_uid if _has_agent_user() else 65534
    ws = run_dir / "workspaces" / "x"
    assert cover_for(ws, uid, uid) == run_dir
    # never "/" nor a top-level directory: a workspace root there hides the workspaces only
    assert cover_for(Path("/tmp/ws/x"), uid, uid) == Path("/tmp/ws")
    # pytest's tmp_path lies under a directory only root may enter: that one is hidden
    assert cover_for(tmp_path / "w" / "x", uid, uid) == Path(f"/tmp/pytest-of-{_me()}")


DAEMON = """\
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execve("/bin/sleep", ["sleep", "61.0741"], {})  # no environment: no mark
    os._exit(0)
time.sleep(0.3)
print("left a daemon behind")
"""


def test_a_double_forked_daemon_without_environment_dies_with_its_execution(run_dir):
    script = _script(run_dir, "daemon.py", DAEMON)
    agent = build_agent(AgentConfig(kind="command", command=["{python}", script]))
    out = asyncio.run(agent.run(_ctx(run_dir / "workspaces" / "b0-g0-e0")))
    assert out.exit_code == 0 and out.answer == "left a daemon behind", out.stderr_tail
    deadline = time.monotonic() + 5
    while running("61.0741") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running("61.0741"), "the daemon outlived its execution"


def test_output_past_the_cap_is_dropped_and_marked(run_dir):
    spam = "import sys\nfor _ in range(400): sys.stdout.write('x' * 65536)\nprint('done')\n"
    script = _script(run_dir, "spam.py", spam)
    agent = build_agent(
        AgentConfig(kind="command", command=["{python}", script], output_limit_bytes=100_000)
    )
    ws = run_dir / "workspaces" / "b0-g0-e0"
    t0 = time.monotonic()
    out = asyncio.run(agent.run(_ctx(ws)))
    assert time.monotonic() - t0 < 15
    assert out.exit_code == 0
    log = (ws / ".tidal" / "stdout.log").read_bytes()
    dropped = 400 * 65536 + 5 - 100_000
    assert log[:100_000] == b"x" * 100_000
    assert log[100_000:].decode().strip() == (
        f"[tidal: output truncated after 100000 bytes: {dropped} bytes dropped]"
    )
    assert out.detail == f"stdout truncated at 100000 bytes ({dropped} dropped)"
    assert out.stdout_tail.endswith("bytes dropped]\n") and "truncated" not in out.answer


def test_a_program_that_traps_sigterm_gets_it_at_its_timeout(run_dir):
    trap = "trap 'echo bye > bye.txt; exit 0' TERM; sleep 60 & wait"
    agent = build_agent(AgentConfig(kind="command", command=["sh", "-c", trap]))
    ws = run_dir / "workspaces" / "b0-g0-e0"

    async def cancelled():
        task = asyncio.ensure_future(agent.run(_ctx(ws)))
        await asyncio.sleep(1.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(cancelled())
    assert (ws / "bye.txt").read_text() == "bye\n"


def test_another_user_needs_root():
    if ROOT:
        with pytest.raises(ConfigError) as err:
            build_agent(AgentConfig(kind="command", command=["true"], user="no-such-user-q"))
        assert err.value.field == "task.agent.user" and "no user" in err.value.message
    else:
        with pytest.raises(ConfigError) as err:
            build_agent(AgentConfig(kind="command", command=["true"], user="nobody"))
        assert err.value.field == "task.agent.user" and "needs tidal to run as root" in str(
            err.value
        )


def _has_agent_user() -> bool:
    try:
        pwd.getpwnam(AGENT_USER)
    except KeyError:
        return False
    return True


def _me() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def running(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (
                marker.encode() in (entry / "cmdline").read_bytes()
                and "\nState:\tZ" not in (entry / "status").read_text()
            ):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_without_root_a_user_namespace_still_ends_every_descendant(run_dir):
    # the sandbox a non-root tidal gets (tried here as root: the same unshare line)
    from tidal.agents.sandbox import Sandbox, _namespaces

    if not _namespaces(False):
        pytest.skip("no unprivileged user namespaces on this host")
    script = _script(run_dir, "daemon.py", DAEMON)
    agent = build_agent(AgentConfig(kind="command", command=["{python}", script], user="root"))
    agent.sandbox = Sandbox("namespace")
    out = asyncio.run(agent.run(_ctx(run_dir / "workspaces" / "b0-g0-e0")))
    assert out.exit_code == 0 and out.answer == "left a daemon behind", out.stderr_tail
    deadline = time.monotonic() + 5
    while running("61.0741") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running("61.0741"), "the daemon outlived its execution"


@needs_root
def test_checking_a_config_creates_no_user(monkeypatch):
    from tidal.agents import sandbox

    monkeypatch.setattr(sandbox, "AGENT_USER", "tidal-agent-never-made-q")
    sandbox.sandbox_for.cache_clear()
    try:
        agent = build_agent(AgentConfig(kind="command", command=["true"]))
        assert not agent.sandbox.ready
        with pytest.raises(KeyError):
            pwd.getpwnam("tidal-agent-never-made-q")
    finally:
        sandbox.sandbox_for.cache_clear()


def test_a_relative_workspace_path_runs(run_dir, monkeypatch):
    """A run's default output directory is relative (``runs/<name>``): the agent, started in
    its workspace, still enters it (the sandbox is given the absolute path)."""
    script = _script(run_dir, "pwd.py", "import os; open('pwd.txt', 'w').write(os.getcwd())\n")
    agent = build_agent(AgentConfig(kind="command", command=["{python}", script]))
    monkeypatch.chdir(run_dir.parent)
    ws = Path("run") / "workspaces" / "b0-g0-e0"
    out = asyncio.run(agent.run(_ctx(ws)))
    assert out.exit_code == 0, out.stderr_tail
    assert (ws / "pwd.txt").read_text() == str(ws.resolve())
