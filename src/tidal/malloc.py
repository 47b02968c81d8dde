"""glibc's allocator held to give back what a process frees: tidal's processes call ``tune()``.

Why: a trainer or an engine allocates and frees tensors of a few hundred KB to a few hundred MB
all the time (activations, gradients, a version's tensors read one by one). glibc serves a
block at or above its mmap threshold with its own mapping, returned to the system on free, and
the rest from its heaps, which only shrink from the top. By default the threshold is dynamic:
the first large block freed raises it up to 32 MB, so later tensors of that size come from the
heaps and their free space stays resident, scattered between live blocks. Measured on 2 CPU
cores (``benchmarks/trainer_memory.py --layers 30 --steps 3``): the core's peak RSS 5,082 ->
4,078 MB and a satellite's 2,695 -> 2,080 MB with a fixed 64 KB threshold; a sleeping
built-in engine 681 -> 416 MB. The cost is system time: each large block is a fresh mapping
whose pages the kernel zeroes.

``$TIDAL_MALLOC_MMAP_THRESHOLD`` (bytes, inherited by every child process) sets the threshold;
``off`` leaves glibc's dynamic default. Elsewhere than glibc (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

from tidal.errors import ConfigError

ENV = "TIDAL_MALLOC_MMAP_THRESHOLD"
DEFAULT_THRESHOLD = 64 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_MAX_THRESHOLD = 32 * 1024 * 1024  # glibc refuses a larger mmap threshold (HEAP_MAX / 2)


def threshold_setting() -> int | None:
    """The threshold ``$TIDAL_MALLOC_MMAP_THRESHOLD`` asks for (None: ``off``)."""
    raw = os.environ.get(ENV, "").strip()
    if raw == "":
        return DEFAULT_THRESHOLD
    if raw.lower() == "off":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 < value <= _MAX_THRESHOLD:
        raise ConfigError(ENV, f"{raw!r} is not a byte count in 1..{_MAX_THRESHOLD} or 'off'")
    return value


def tune() -> int | None:
    """Fix glibc's mmap and trim thresholds for this process (see the module docstring);
    returns the threshold set, or None where nothing was set (``off``, or not glibc)."""
    threshold = threshold_setting()
    if threshold is None or platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not (
        libc.mallopt(_M_MMAP_THRESHOLD, threshold) and libc.mallopt(_M_TRIM_THRESHOLD, threshold)
    ):
        return None  # glibc refused (it keeps its defaults): nothing to undo
    return threshold
