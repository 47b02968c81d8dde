"""The first process of a command agent's PID namespace (run by ``tidal.agents.sandbox``, with
``python -I -S``: the standard library only, nothing of tidal imported).

In: one JSON argument (``uid``, ``gid``, ``user``, ``workspace``, ``covers``: directories to hide
under an empty tmpfs, the workspace bound back at its own path inside one, and ``expose``:
directories the program needs, e.g. tidal's interpreter, bound back read-only) and the
program's argv after it. As root in the new mount namespace it hides ``covers``, then drops to
``uid``/``gid`` (no supplementary groups), enters the workspace and starts the program as its
child. Out: the program's exit status (128 + N for a signal N); SIGTERM / SIGINT / SIGHUP are
passed on to the program (the first process of a namespace ignores a signal it has no handler
for). Kept: when this process exits, the kernel kills every process left in the namespace: a
daemon that double-forks and clears its environment dies with its execution.
"""

import contextlib
import ctypes
import json
import os
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384


def _mount(libc, source, target, fstype, flags, data):
    if (
        libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        )
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _makedirs(path):
    """``path`` and its missing parents, each 0711: entered by path, never listed."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for p in reversed(missing):
        os.mkdir(p, 0o711)


def _hide(covers, binds):
    """Each directory of ``covers`` replaced by an empty tmpfs; then each ``(path, read_only)``
    of ``binds`` (opened before anything is hidden) bound back at its own path inside."""
    libc = ctypes.CDLL(None, use_errno=True)
    fds = [(os.open(path, os.O_PATH | os.O_DIRECTORY), path, ro) for path, ro in binds]
    for cover in covers:
        _mount(libc, "tmpfs", cover, "tmpfs", MS_NOSUID | MS_NODEV, "mode=711,size=64k")
    for fd, path, ro in fds:
        _makedirs(path)
        _mount(libc, f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
        if ro:
            _mount(libc, "none", path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC, None)
        os.close(fd)


def main():
    spec = json.loads(sys.argv[1])
    argv = sys.argv[2:]
    ws = spec["workspace"]
    try:
        if spec.get("covers"):
            _hide(spec["covers"], [(ws, False)] + [(p, True) for p in spec["expose"]])
        if spec.get("uid") is not None:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
            os.environ.update(HOME=ws, USER=spec["user"], LOGNAME=spec["user"])
        os.chdir(ws)
    except OSError as exc:
        print(f"tidal sandbox: {exc}", file=sys.stderr, flush=True)
        return 126
    child = os.fork()
    if child == 0:
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            print(f"tidal sandbox: {argv[0]}: {exc.strerror}", file=sys.stderr, flush=True)
        os._exit(127)

    def forward(sig, _frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
