"""The proxy stamps each call of a named execution that brings no seed with the seed derived
from (run seed, execution id, call index); a harness's own seed is kept; without a run seed,
or without an execution, calls go out as they came."""

from __future__ import annotations

from tidal.seeding import call_seed
from tidal.serving.protocol import SamplingParams
from tidal.serving.proxy import Proxy, ProxyConfig


def test_calls_get_seeds_from_run_seed_execution_and_index():
    proxy = Proxy(ProxyConfig(seed=5))
    plain = SamplingParams(max_tokens=4)
    got = [proxy._seeded("e1", plain).seed, proxy._seeded("e2", plain).seed,
           proxy._seeded("e1", plain).seed,
           proxy._seeded("e1", SamplingParams(seed=99)).seed,  # the harness's own, kept
           proxy._seeded("e1", plain).seed]  # ... and counted: this is e1's 4th call
    assert got == [call_seed(5, "e1", 0), call_seed(5, "e2", 0), call_seed(5, "e1", 1), 99,
                   call_seed(5, "e1", 3)]
    assert proxy._seeded(None, plain).seed is None
    assert Proxy(ProxyConfig())._seeded("e1", plain).seed is None


def test_call_counts_are_bounded():
    proxy = Proxy(ProxyConfig(seed=0))
    proxy.records.max_executions = 3
    for i in range(10):
        proxy._seeded(f"e{i}", SamplingParams())
    assert list(proxy._call_counts) == ["e7", "e8", "e9"]
