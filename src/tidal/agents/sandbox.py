"""Where a command agent runs: its own PID namespace (every process it starts dies with its
execution), and, when tidal runs as root, its own unprivileged user with the run directory
hidden (``/proc/<pid>/environ`` of the proxy, engines and driver, which hold the run's tokens,
and the run's files are closed to it).

In: ``task.agent.user`` (``auto``: ``tidal-agent`` when tidal runs as root, created if absent,
else tidal's own user; a user name; or ``root`` / tidal's own user name: no switch) and, per
execution, its workspace and argv. Out: a ``Sandbox`` whose ``argv`` wraps the program in
``unshare --pid --fork --kill-child --mount-proc`` and ``tidal.agents.sandbox_init`` (the
namespace's first process: hides the run directory, drops to the user, passes signals on), and
``environment``: tidal's environment without its tokens. ``prepare`` gives the workspace to the
agent's user.

Modes (``Sandbox.mode``): ``user`` (root: namespace, own user, run directory hidden),
``namespace`` (non-root with unprivileged user namespaces: a user namespace holds the PID
namespace; same uid, so the agent is NOT isolated from tidal's files or its processes'
environments: see docs/security.md) and ``group`` (no namespaces: the process group only, and
the caller's environment scan for children in their own session).
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tidal.errors import ConfigError

AGENT_USER = "tidal-agent"
INIT = Path(__file__).with_name("sandbox_init.py")
_SECRET = re.compile(r"^TIDAL_\w*TOKEN\w*$")


@dataclass(frozen=True)
class Sandbox:
    mode: str  # "user" | "namespace" | "group"
    user: str | None = None  # the agent's user (mode "user")
    uid: int | None = None
    gid: int | None = None

    def argv(self, program: list[str], workspace: Path, expose: Sequence[Path] = ()) -> list[str]:
        """``program`` wrapped for one execution in ``workspace``; ``expose``: directories it
        needs (read-only) that lie under one its user could not enter."""
        if self.mode == "group":
            return program
        spec = {
            # absolute: the program starts in the workspace, so a relative path (a run's
            # default --out, runs/<name>) would not be found from there
            "workspace": str(Path(workspace).resolve()),
            "uid": self.uid,
            "gid": self.gid,
            "user": self.user,
            "covers": [],
            "expose": [],
        }
        prefix = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
        if self.mode == "user":
            uid, gid = self.uid or 0, self.gid or 0
            covers = {cover_for(workspace, uid, gid)}
            for path in expose:
                closed = _closed_ancestor(Path(path).resolve(), uid, gid)
                if closed is not None:
                    covers.add(closed)
                    spec["expose"].append(str(Path(path).resolve()))
            # a cover inside another is bound back with it: only the outermost are mounted
            spec["covers"] = sorted(
                str(c) for c in covers if not any(c != o and c.is_relative_to(o) for o in covers)
            )
        else:
            prefix[1:1] = ["--user", "--map-current-user"]
        return [*prefix, sys.executable, "-I", "-S", str(INIT), json.dumps(spec), *program]

    def prepare(self, workspace: Path) -> None:
        """The workspace (every file in it) owned by the agent's user."""
        if self.mode != "user":
            return
        for root, dirs, files in os.walk(workspace):
            os.chown(root, self.uid, self.gid)
            for name in dirs + files:
                os.chown(os.path.join(root, name), self.uid, self.gid, follow_symlinks=False)

    @property
    def ready(self) -> bool:
        return self.mode != "user" or self.uid is not None

    @property
    def kills_descendants(self) -> bool:
        return self.mode != "group"


def cover_for(workspace: Path, uid: int, gid: int) -> Path:
    """What the agent must not see: the run directory (the workspace root's parent), or higher,
    the first ancestor the agent's user could not enter anyway (its workspace is bound back
    inside, so its own path still works)."""
    ws = workspace.resolve()
    # never "/" or a top-level directory (/tmp, /home): the run directory, else the workspaces'
    run_dir = next((d for d in (ws.parent.parent, ws.parent) if len(d.parts) >= 3), ws)
    closed = _closed_ancestor(run_dir, uid, gid)
    return closed if closed is not None else run_dir


def _closed_ancestor(path: Path, uid: int, gid: int) -> Path | None:
    """The outermost proper ancestor of ``path`` that ``uid``/``gid`` could not enter."""
    for anc in reversed(path.parents):  # from "/" down
        if not _enterable(anc, uid, gid):
            return anc
    return None


def _enterable(path: Path, uid: int, gid: int) -> bool:
    st = path.stat()
    bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
    return bool(st.st_mode & bit)


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: tidal's environment) without the run's tokens."""
    return {k: v for k, v in (os.environ if base is None else base).items() if not _SECRET.match(k)}


@functools.cache
def sandbox_for(user: str, field: str = "task.agent.user", create: bool = True) -> Sandbox:
    """The sandbox ``task.agent.user`` asks for on this host, or a ``ConfigError``. Without
    ``create`` (``tidal check``) an absent ``tidal-agent`` is not created: the sandbox is
    returned without its uid (``ready`` false), to be asked for again before a program runs."""
    root = os.geteuid() == 0
    own = pwd.getpwuid(os.geteuid()).pw_name
    if user == "auto":
        user = AGENT_USER if root else own
    if user in ("root", own):
        return Sandbox("namespace" if _namespaces(root) else "group")
    if not root:
        raise ConfigError(
            field,
            f"{user!r}: running agents as another user needs tidal to "
            f"run as root (it runs as {own!r}; use 'auto')",
        )
    if not _namespaces(True):
        raise ConfigError(
            field,
            "'unshare --pid --mount-proc' fails on this host: agents "
            "cannot be isolated (set task.agent.user: root to run them as tidal)",
        )
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        if user != AGENT_USER:
            raise ConfigError(field, f"no user {user!r} on this host") from None
        if not create:
            return Sandbox("user", user)
        entry = _create_agent_user(field)
    if entry.pw_uid == 0:
        raise ConfigError(field, f"{user!r} is uid 0: not an unprivileged user")
    return Sandbox("user", user, entry.pw_uid, entry.pw_gid)


def _create_agent_user(field: str) -> pwd.struct_passwd:
    useradd = shutil.which("useradd")
    if useradd is None:
        raise ConfigError(field, f"no user {AGENT_USER!r} and no useradd to create it")
    res = subprocess.run(
        [
            useradd,
            "--system",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            "--user-group",
            AGENT_USER,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if res.returncode not in (0, 9):  # 9: created meanwhile
        line = (res.stderr.strip().splitlines() or ["(no message)"])[0]
        raise ConfigError(field, f"creating user {AGENT_USER!r}: {line}")
    return pwd.getpwnam(AGENT_USER)


@functools.cache
def _namespaces(root: bool) -> bool:
    """Whether a PID namespace can be made here (as root, or in a user namespace)."""
    if shutil.which("unshare") is None:
        return False
    argv = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "true"]
    if not root:
        argv[1:1] = ["--user", "--map-current-user"]
    try:
        return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def interpreter_paths() -> list[Path]:
    """What ``{python}`` (tidal's interpreter) needs to start and import: its installation,
    its environment and ``PYTHONPATH``."""
    paths = {Path(sys.base_prefix), Path(sys.prefix), Path(sys.executable).parent}
    paths |= {Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    return sorted(p for p in paths if p.is_dir())
