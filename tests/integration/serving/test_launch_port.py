"""A port tidal picks for its own server is reserved from the moment it is chosen.

The vLLM tier once failed because the built-in engine's port, picked with ``free_port`` and
closed again, was taken by vLLM (starting alongside, binding many internal ports) before the
engine bound it: the engine exited with uvicorn's startup failure. Now the parent binds the
socket, listening, and the child serves on that very socket, so nothing can take the port in
between.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import httpx
import pytest

from tidal.serving.launch import LISTEN_FD_ENV, start_proxy


def _bind(port: int) -> OSError | None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            return e
    return None


def test_the_port_is_held_from_choice_to_listen(tmp_path):
    proxy = start_proxy([], [], "tok", log_path=tmp_path / "proxy.log")
    try:
        # The child is still importing, yet the port is taken: the listening socket went to
        # it, and nobody else can bind there.
        err = _bind(proxy.port)
        assert err is not None and err.errno == errno.EADDRINUSE
        proxy.wait_healthy(60)
        assert httpx.get(f"{proxy.url}/live", timeout=5).status_code == 200
        assert LISTEN_FD_ENV not in os.environ  # the parent's environment is untouched
    finally:
        proxy.stop()
    assert _bind(proxy.port) is None  # released with the process


@pytest.mark.parametrize(
    "fd_text, message",
    [
        ("nope", "is not an open socket"),
        ("987", "is not an open socket"),
    ],
)
def test_a_bad_listen_fd_is_one_clear_line(tmp_path, fd_text, message):
    env = {**os.environ, LISTEN_FD_ENV: fd_text, "TIDAL_ADMIN_TOKEN": "tok"}
    out = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "proxy", "--port", "18999"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert f"{LISTEN_FD_ENV}={fd_text!r} {message}" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_listen_fd_on_another_port_is_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env = {**os.environ, LISTEN_FD_ENV: str(s.fileno()), "TIDAL_ADMIN_TOKEN": "tok"}
        out = subprocess.run(
            [sys.executable, "-m", "tidal.cli", "proxy", "--port", "18999"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            pass_fds=(s.fileno(),),
        )
    assert out.returncode != 0
    assert "not --port 18999" in out.stderr and "Traceback" not in out.stderr
