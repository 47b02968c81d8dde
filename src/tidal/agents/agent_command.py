"""The ``command`` agent kind: any program (a black box: another language, a shell script, an
unmodified third-party harness) runs each execution, as its own process group, in the
execution's workspace, with the model behind ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``.

In: ``task.agent.command`` (the program, ``{python}`` for tidal's own interpreter, and its
arguments; ``{prompt}``, ``{task_file}``,
``{workspace}``, ``{execution_id}``, ``{base_url}``, ``{api_key}``, ``{model}`` are filled in, in
``task.agent.env`` values too). The task row (without its reference answer) is written as JSON to
``task.agent.task_file`` in the workspace first. The environment adds ``OPENAI_BASE_URL`` (the
proxy's per-execution URL, so a program that cannot add headers is still identified),
``OPENAI_API_KEY`` (a key bound to the execution), ``OPENAI_MODEL``, ``TIDAL_EXECUTION_ID``,
``TIDAL_WORKSPACE``, ``TIDAL_TASK_FILE``.
The run's tokens (``TIDAL_*TOKEN*``) are never passed on.
Out: an ``Outcome`` with the exit code, the last ``TAIL_CHARS`` of stdout / stderr (the
streams are in ``.tidal/stdout.log`` / ``stderr.log`` of the workspace, each cut at
``task.agent.output_limit_bytes``: the rest is read and dropped, a line at the log's end and the
outcome's ``detail`` say so) and the stdout tail as the answer; a non-zero exit closes the
execution ``failed``.
Kept: the program runs in the sandbox ``task.agent.user`` asks for (``tidal.agents.sandbox``:
its own PID namespace, and as root its own user with the run directory hidden). It is ended
with its execution: cancelled (the execution's timeout, the run's end) its group gets SIGTERM,
then SIGKILL after ``GRACE_S``; its group is killed when the leader exits too, and with it the
namespace: every process the program started, wherever it went. Without namespaces (a host
that has none), any process still carrying the execution's mark (``TIDAL_EXECUTION_KEY`` in its
environment) is killed instead. ``end_all`` kills any group still alive at the run's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import string
import sys
from pathlib import Path

from tidal.agents.kinds import AgentContext, register_agent_kind, unused
from tidal.agents.sandbox import environment, interpreter_paths, sandbox_for
from tidal.config import AgentConfig
from tidal.contracts.close import CloseReason
from tidal.contracts.executions import Outcome, Turn
from tidal.errors import ConfigError

TAIL_CHARS = 4000
GRACE_S = 3.0
FIELDS = ("prompt", "task_file", "workspace", "execution_id", "base_url", "api_key", "model")
_LIVE: set[int] = set()  # process groups of running programs
_MARK = "TIDAL_EXECUTION_KEY"
CHUNK = 1 << 16
_CUT = "\n[tidal: output truncated"


class CommandKind:
    def __init__(self, spec: AgentConfig, field: str = "task.agent") -> None:
        unused(spec, field, "function", "step")
        if not spec.command:
            raise ConfigError(
                f"{field}.command",
                "the 'command' agent kind needs a program "
                "and its arguments, e.g. ['bash', 'agent.sh', '{task_file}']",
            )
        self.program = (
            sys.executable
            if spec.command[0] == "{python}"
            else executable(spec.command[0], f"{field}.command.0")
        )
        self.argv, self.env, self.task_file = list(spec.command[1:]), dict(spec.env), spec.task_file
        for i, arg in enumerate(self.argv, 1):
            _check_template(arg, f"{field}.command.{i}")
        for k, v in self.env.items():
            _check_template(v, f"{field}.env.{k}")
        if spec.args:
            raise ConfigError(
                f"{field}.args.{sorted(spec.args)[0]}", "the 'command' kind takes no args"
            )
        self.user, self.user_field = spec.user, f"{field}.user"
        # checked here (tidal check too); the agents' user is created by the first execution
        self.sandbox = sandbox_for(spec.user, self.user_field, create=False)
        # tidal's interpreter and its imports, for ``{python}`` and the venv's scripts
        self.expose = interpreter_paths()
        self.limit = spec.output_limit_bytes

    async def run(self, ctx: AgentContext) -> Outcome:
        if not self.sandbox.ready:  # the first execution creates the agents' user
            self.sandbox = sandbox_for(self.user, self.user_field)
        ws = ctx.workspace
        # the row without its reference answer: the agent is what is trained
        row = {k: v for k, v in ctx.row.to_json().items() if k != "answer"}
        (ws / self.task_file).write_text(json.dumps(row, default=str))
        values = {
            "prompt": ctx.row.text(),
            "task_file": str(ws / self.task_file),
            "workspace": str(ws),
            "execution_id": ctx.execution_id,
            "base_url": ctx.base_url,
            "api_key": ctx.api_key,
            "model": ctx.model,
        }
        env = {
            **environment(),
            "OPENAI_BASE_URL": ctx.base_url,
            "OPENAI_API_KEY": ctx.api_key,
            "OPENAI_MODEL": ctx.model,
            "TIDAL_EXECUTION_ID": ctx.execution_id,
            "TIDAL_WORKSPACE": str(ws),
            "TIDAL_TASK_FILE": values["task_file"],
            **{k: v.format(**values) for k, v in self.env.items()},
        }
        if not self.sandbox.kills_descendants:  # run-unique: finds what the program started
            env[_MARK] = ctx.api_key
        logs = ws / ".tidal"
        logs.mkdir(exist_ok=True)
        self.sandbox.prepare(ws)  # logs too (a harness writes there): tidal never reads them
        argv = [self.program, *(a.format(**values) for a in self.argv)]
        proc = await asyncio.create_subprocess_exec(
            *self.sandbox.argv(argv, ws, self.expose),
            cwd=ws,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        _LIVE.add(proc.pid)
        copies = [
            asyncio.ensure_future(_copy(proc.stdout, logs / "stdout.log", self.limit)),
            asyncio.ensure_future(_copy(proc.stderr, logs / "stderr.log", self.limit)),
        ]
        try:
            code = await proc.wait()
        finally:
            await _end(proc)
            if not self.sandbox.kills_descendants:
                await _end_strays(ctx.api_key)
            # every writer is gone: the pipes end (bounded: a stray holding one is cut off)
            done, pending = await asyncio.wait(copies, timeout=GRACE_S)
            for task in pending:
                task.cancel()
        tails, cut = ["", ""], []
        for i, (name, task) in enumerate(zip(("stdout", "stderr"), copies, strict=True)):
            if task in done and not task.cancelled() and task.exception() is None:
                tails[i], dropped = task.result()
                if dropped:
                    cut.append(f"{name} truncated at {self.limit} bytes ({dropped} dropped)")
        stdout, stderr = tails
        return Outcome(
            answer=stdout.split(_CUT, 1)[0].strip(),
            exit_code=code,
            stdout_tail=stdout,
            stderr_tail=stderr,
            reason=CloseReason.COMPLETED if code == 0 else CloseReason.FAILED,
            transcript=[Turn(action=f"exit {code}", observation=stdout)],
            detail="; ".join(cut),
        )


async def _copy(stream: asyncio.StreamReader | None, path: Path, limit: int) -> tuple[str, int]:
    """``stream`` into ``path`` up to ``limit`` bytes, the rest read and dropped (the program
    never blocks on a full pipe); a dropped tail is marked at the log's end. Returns the log's
    last ``TAIL_CHARS`` (kept here: the log's path is in the agent's workspace, never read back)
    and the bytes dropped."""
    kept = dropped = 0
    tail = b""
    with open(path, "wb") as fh:
        while stream is not None and (chunk := await stream.read(CHUNK)):
            room = max(0, limit - kept)
            if room:
                fh.write(chunk[:room])
                tail = (tail + chunk[:room])[-TAIL_CHARS:]
                kept += min(room, len(chunk))
            dropped += max(0, len(chunk) - room)
        if dropped:
            mark = f"{_CUT} after {limit} bytes: {dropped} bytes dropped]\n".encode()
            fh.write(mark)
            tail = (tail + mark)[-TAIL_CHARS:]
    return tail.decode("utf-8", "replace"), dropped


def executable(program: str, field: str) -> str:
    """The program's path (``PATH`` searched for a bare name) or a ``ConfigError``."""
    found = (
        shutil.which(program)
        if os.sep not in program
        else (program if os.path.isfile(program) and os.access(program, os.X_OK) else None)
    )
    if found is None:
        why = (
            "not found on PATH"
            if os.sep not in program
            else ("not executable" if os.path.exists(program) else "no such file")
        )
        raise ConfigError(field, f"{program!r}: {why}")
    return str(Path(found).resolve()) if os.sep in program else found


def _check_template(text: str, field: str) -> None:
    try:
        names = [n for _, n, _, _ in string.Formatter().parse(text) if n is not None]
    except ValueError as exc:
        raise ConfigError(field, f"{text!r}: {exc} (write {{{{ and }}}} for braces)") from None
    for n in names:
        if n not in FIELDS:
            raise ConfigError(
                field, f"{text!r}: unknown placeholder {{{n}}} (known: {', '.join(FIELDS)})"
            )


async def _end(proc: asyncio.subprocess.Process) -> None:
    """The program's whole process group ended: SIGTERM, SIGKILL after ``GRACE_S``."""
    try:
        if proc.returncode is None:
            _signal(proc.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), GRACE_S)
        _signal(proc.pid, signal.SIGKILL)  # what the leader left behind, and the leader
        if proc.returncode is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), GRACE_S)
    finally:
        _LIVE.discard(proc.pid)


async def _end_strays(key: str, timeout_s: float = GRACE_S) -> int:
    """SIGKILL to every process still carrying this execution's mark in its environment (a
    child that started its own session, as mini-swe-agent's bash actions do, leaves the
    program's group), until a scan finds none alive or ``timeout_s`` passes; returns how many
    were killed. Scans at least twice: a process in the middle of ``execve`` shows an empty
    environment for an instant. Linux ``/proc``; elsewhere the group kill only."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    killed: set[int] = set()
    mark = f"{_MARK}={key}".encode() + b"\0"
    scans = 0
    while True:
        found = _marked(mark)
        scans += 1
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        if (not found and scans >= 2) or loop.time() >= deadline:
            return len(killed)
        await asyncio.sleep(0.02)


def _marked(mark: bytes) -> list[int]:
    """Live processes (a zombie's environment reads empty) whose environment holds ``mark``."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            found = mark in (entry / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if found and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


def _signal(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def end_all() -> int:
    """Kills every program group still alive (the run's end); returns how many."""
    live = list(_LIVE)
    for pgid in live:
        _signal(pgid, signal.SIGKILL)
    _LIVE.clear()
    return len(live)


register_agent_kind("command", CommandKind)
