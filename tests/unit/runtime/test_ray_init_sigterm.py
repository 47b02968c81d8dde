"""``ray_start.ray_init``: Ray's init installs a SIGTERM handler (``sys.exit(15)`` wherever it
lands); the run's own handler (SIGTERM as an interrupt that stops every part) must survive it."""

from __future__ import annotations

import signal
import types

from tidal.runtime.ray_start import ray_init


def test_the_runs_sigterm_handler_survives_rays_init():
    installed = []

    def set_sigterm_handler(handler):  # what Ray's init calls (ray/_private/worker.py)
        installed.append(handler)
        signal.signal(signal.SIGTERM, handler)

    utils = types.SimpleNamespace(set_sigterm_handler=set_sigterm_handler)
    inits = []
    ray = types.SimpleNamespace(_private=types.SimpleNamespace(utils=utils))
    ray.init = lambda **kw: (inits.append(kw), utils.set_sigterm_handler(lambda *a: None))

    def ours(signum, frame):
        raise KeyboardInterrupt

    prev = signal.signal(signal.SIGTERM, ours)
    try:
        ray_init(ray, num_cpus=1)
        assert signal.getsignal(signal.SIGTERM) is ours and installed == []
        assert inits == [{"num_cpus": 1}]
        assert utils.set_sigterm_handler is set_sigterm_handler  # given back after the call
    finally:
        signal.signal(signal.SIGTERM, prev)
