"""``tidal.malloc.tune``: freed blocks go back to the system (glibc), measured in a real process;
a bad ``$TIDAL_MALLOC_MMAP_THRESHOLD`` is one line naming it; every tidal process entry calls it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from tidal import malloc
from tidal.errors import ConfigError

# Fragment glibc's heap: one large block freed first (the dynamic threshold rises above it),
# then 300 blocks of 1 MB each followed by a small live object, then the large ones freed.
# Where they came from the heap, the holes stay resident; where they were mapped, they go.
_FRAGMENT = r"""
import os, sys
if sys.argv[1] == "tune":
    from tidal import malloc
    assert malloc.tune() == 64 * 1024
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
b = bytearray(4 << 20); del b
base = rss_mb()
big, small = [], []
for i in range(300):
    big.append(bytearray(1 << 20))
    small.append(bytearray(64))
del big
print(round(rss_mb() - base))
"""


def _resident_after_free(mode: str) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop(malloc.ENV, None)
    out = subprocess.run(
        [sys.executable, "-c", _FRAGMENT, mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
def test_freed_blocks_go_back_to_the_system_once_tuned():
    assert _resident_after_free("default") > 100  # glibc keeps holes: 173 of 300 MB here
    assert _resident_after_free("tune") < 20


@pytest.mark.parametrize(
    "raw, want", [("", 64 * 1024), ("off", None), ("OFF", None), ("1048576", 1 << 20)]
)
def test_the_setting_reads_the_environment(monkeypatch, raw, want):
    monkeypatch.setenv(malloc.ENV, raw)
    assert malloc.threshold_setting() == want


@pytest.mark.parametrize("raw", ["lots", "0", "-5", str(64 << 20)])
def test_a_bad_setting_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(malloc.ENV, raw)
    with pytest.raises(ConfigError) as info:
        malloc.tune()
    assert info.value.field == malloc.ENV and repr(raw) in info.value.message


def test_off_sets_nothing(monkeypatch):
    monkeypatch.setenv(malloc.ENV, "off")
    assert malloc.tune() is None


def test_a_bad_setting_is_one_line_from_the_cli():
    env = {**os.environ, malloc.ENV: "lots"}
    out = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "--version"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0
    assert malloc.ENV in out.stderr and "Traceback" not in out.stderr
