"""Worker processes for the user's Python code (a ``python`` agent's async function, a reward
function, a builtin scorer): never in the driver's event loop, each call under a timeout that
kills.

In: ``call(op, payload, timeout_s)`` from the driver's loop: ``op`` is ``agent`` (the
function's spec and the ``AgentContext``: the worker builds an ``openai.AsyncOpenAI`` client
bound to the execution and awaits the function on its own loop), ``reward`` (a reward function
and its keyword arguments) or ``builtin`` (a builtin scorer's name, the row and the answer).
Out: the call's JSON value (an agent's outcome as a dict, a reward's value), or ``WorkerError``
(one line: the user's exception and where it was raised; or "killed": its worker did not answer
in time). Requests go to the worker as pickles (the driver's own data); answers come back as
JSON (a worker runs code the run does not trust: nothing it sends is unpickled).

Kept: at most ``size`` workers (``task.agent.workers``), started on first use (tidal's
interpreter running ``main``, with the driver's import path; the run's tokens out of its
environment), each running many calls on its own loop. A call past its timeout is cancelled in
its worker; a worker that does not answer within ``CANCEL_GRACE_S`` (the function swallowed the
cancellation, or blocks its loop with ``time.sleep``) is killed, and every call it held fails.
A worker whose driver is gone exits by itself. ``close_all`` (the run's end, and at exit) kills
every worker without waiting: no thread and no wait of this module can hold the driver.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time

from tidal.errors import TidalError

CANCEL_GRACE_S = 2.0
START_TIMEOUT_S = 60.0
_HEADER = struct.Struct(">I")
_MAX_ANSWER_BYTES = 64 * 2**20


class WorkerError(TidalError):
    """A call into a worker failed (the user's exception, or its worker killed)."""


class _Worker:
    """One worker process: a plain ``Popen`` (no asyncio child watcher: a worker killed as the
    loop closes leaves nothing behind) with its pipes on the loop (writes never block)."""

    def __init__(
        self,
        proc: subprocess.Popen,
        reader: asyncio.StreamReader,
        transports: list[asyncio.BaseTransport],
        writer: asyncio.WriteTransport,
    ) -> None:
        self.proc, self.stream, self.transports, self.writer = proc, reader, transports, writer
        self.pending: dict[int, asyncio.Future] = {}
        self.dead = False
        self.reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, argv: list[str], env: dict[str, str]) -> _Worker:
        loop = asyncio.get_running_loop()
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True
        )
        _PROCS[proc.pid] = proc
        reader = asyncio.StreamReader(limit=_MAX_ANSWER_BYTES, loop=loop)
        read_t, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=loop), proc.stdout
        )
        write_t, _ = await loop.connect_write_pipe(asyncio.Protocol, proc.stdin)
        return cls(proc, reader, [read_t, write_t], write_t)

    async def _read(self) -> None:
        why = "its worker exited"
        try:
            while True:
                (n,) = _HEADER.unpack(await self.stream.readexactly(_HEADER.size))
                if n > _MAX_ANSWER_BYTES:
                    why = f"its worker sent {n} bytes (more than {_MAX_ANSWER_BYTES})"
                    break
                msg = json.loads(await self.stream.readexactly(n))
                fut = self.pending.pop(msg["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (asyncio.IncompleteReadError, ValueError, KeyError, TypeError):
            pass
        finally:  # cancelled too: the loop's end (asyncio.run) closes its workers while it can
            self.kill(why)

    def send(self, msg: dict) -> None:
        data = pickle.dumps(msg)
        self.writer.write(_HEADER.pack(len(data)) + data)

    def kill(self, why: str) -> None:
        self.dead = True
        _end(self.proc)
        for t in self.transports:
            t.close()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(WorkerError(f"killed: {why}"))
        self.pending.clear()

    @property
    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None


class WorkerPool:
    def __init__(self, size: int) -> None:
        self.size = size
        self.workers: list[_Worker] = []
        self._ids = itertools.count()
        self._starting = asyncio.Lock()

    async def call(self, op: str, payload: dict, timeout_s: float) -> object:
        """The call's value, or ``WorkerError``; ``TimeoutError`` past ``timeout_s`` (its
        worker killed if it did not let go of the call)."""
        worker = await self._worker()
        cid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        worker.pending[cid] = fut
        # the driver's import path as it is now (a test's, a config's additions)
        worker.send({"id": cid, "op": op, "sys_path": list(sys.path), **payload})
        try:
            msg = await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            await self._cancel(worker, cid, fut)
            raise
        if not msg.get("ok"):
            raise WorkerError(str(msg.get("error", "(no message)")))
        return msg.get("value")

    async def _cancel(self, worker: _Worker, cid: int, fut: asyncio.Future) -> None:
        """The call cancelled in its worker; the worker killed if it does not let go."""
        if fut.done() or not worker.alive:
            return
        with contextlib.suppress(OSError, RuntimeError):
            worker.send({"id": cid, "op": "cancel"})
        done, _ = await asyncio.wait([fut], timeout=CANCEL_GRACE_S)
        if not done:
            worker.kill(f"a call was not let go within {CANCEL_GRACE_S:g} s of its timeout")
            if worker in self.workers:
                self.workers.remove(worker)
        if fut.done() and not fut.cancelled():
            fut.exception()  # retrieved: the caller has its timeout already

    def _least_busy(self) -> _Worker | None:
        """The worker with the fewest calls, or None when one more should start."""
        self.workers = [w for w in self.workers if w.alive]
        idle = min(self.workers, key=lambda w: len(w.pending), default=None)
        if idle is not None and (not idle.pending or len(self.workers) >= self.size):
            return idle
        return None

    async def _worker(self) -> _Worker:
        found = self._least_busy()
        if found is not None:
            return found
        async with self._starting:  # one start at a time; a call that waited looks again
            found = self._least_busy()
            if found is not None:
                return found
            from tidal.agents.sandbox import environment

            worker = await _Worker.start(
                [
                    sys.executable,
                    "-c",
                    "from tidal.agents.python_workers import main; main()",
                    str(os.getpid()),
                ],
                environment(),
            )
            self.workers.append(worker)
            return worker

    def close(self) -> None:
        for w in self.workers:
            w.kill("the run ended")
            w.reader.cancel()
        self.workers.clear()


_POOLS: dict[int, WorkerPool] = {}  # id of the event loop -> its pool
_PROCS: dict[int, subprocess.Popen] = {}  # every live worker, by pid
REAP_S = 1.0


def pool(size: int = 2) -> WorkerPool:
    """The running event loop's pool (grown to ``size`` workers)."""
    key = id(asyncio.get_running_loop())
    found = _POOLS.get(key)
    if found is None:
        found = _POOLS[key] = WorkerPool(size)
    found.size = max(found.size, size)
    return found


def _end(proc: subprocess.Popen) -> None:
    """SIGKILL, then reaped (bounded: a process stuck in the kernel is left to init)."""
    _PROCS.pop(proc.pid, None)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(REAP_S)


def close_all() -> int:
    """Every worker killed (the run's end); returns how many. Waits at most ``REAP_S`` per
    worker, after all are signalled."""
    procs = list(_PROCS.values())
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            proc.kill()
    for proc in procs:
        _end(proc)
    _POOLS.clear()
    return len(procs)


atexit.register(close_all)


# ---- the worker process -------------------------------------------------------------------


def _error(exc: BaseException) -> str:
    from tidal.agents.rewards import _line, _where

    return f"{type(exc).__name__}: {_line(exc)}{_where(exc)}"


async def _agent(msg: dict) -> dict:
    import openai

    from tidal.agents.agent_python import GIVEN, outcome_dict
    from tidal.agents.callables import load_callable
    from tidal.serving.shared_http import shared_openai_http

    ctx = msg["ctx"]
    fn = load_callable(msg["fn"], "task.agent.function")
    # bound to the execution (URL, key) over the worker's one HTTP client: not closed
    client = openai.AsyncOpenAI(
        base_url=ctx.base_url,
        api_key=ctx.api_key,
        max_retries=0,
        timeout=ctx.timeout_s,
        http_client=shared_openai_http(),
    )
    given = {
        "client": client,
        "row": ctx.row,
        "workspace": ctx.workspace,
        "model": ctx.model,
        "ctx": ctx,
    }
    res = await fn(**{n: given[n] for n in msg["names"] if n in GIVEN})
    return outcome_dict(res)


async def _reward(msg: dict) -> object:
    import inspect

    from tidal.agents.callables import load_callable

    fn = load_callable(msg["fn"], "task.reward.function")
    if inspect.iscoroutinefunction(fn):
        return await fn(**msg["kwargs"])
    # on the worker's loop, not a thread: one that hangs holds its worker, which is killed
    return fn(**msg["kwargs"])


async def _builtin(msg: dict) -> object:
    from tidal.agents.rewards import _BUILTINS

    return _BUILTINS[msg["name"]](msg["row"], msg["answer"])


_OPS = {"agent": _agent, "reward": _reward, "builtin": _builtin}


async def _serve(out) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**30)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    tasks: dict[int, asyncio.Task] = {}

    def answer(msg: dict) -> None:
        data = json.dumps(msg, default=str).encode()
        out.write(_HEADER.pack(len(data)) + data)

    async def run(msg: dict) -> None:
        try:
            answer({"id": msg["id"], "ok": True, "value": await _OPS[msg["op"]](msg)})
        except asyncio.CancelledError:
            answer({"id": msg["id"], "ok": False, "error": "the call was cancelled"})
        except Exception as exc:  # the user's code may raise anything
            answer({"id": msg["id"], "ok": False, "error": _error(exc)})
        finally:
            tasks.pop(msg["id"], None)

    while True:
        try:
            (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
            msg = pickle.loads(await reader.readexactly(n))
        except asyncio.IncompleteReadError:
            return  # the driver closed the pipe
        if msg["op"] == "cancel":
            task = tasks.get(msg["id"])
            if task is not None:
                task.cancel()
        else:
            sys.path[:0] = [p for p in msg.get("sys_path", []) if p not in sys.path]
            tasks[msg["id"]] = asyncio.ensure_future(run(msg))


def _orphan_watch(parent: int) -> None:
    """Exits the worker when its driver is gone (even while its loop is blocked)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def main() -> None:
    out = os.fdopen(os.dup(1), "wb", buffering=0)  # answers; the user's prints go to stderr
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver ends its workers itself
    threading.Thread(target=_orphan_watch, args=(int(sys.argv[1]),), daemon=True).start()
    asyncio.run(_serve(out))


if __name__ == "__main__":
    main()
