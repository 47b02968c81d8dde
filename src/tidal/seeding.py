"""Random streams derived from the run's seed, never from ``os.urandom`` or arrival order.

In: the run's ``seed`` and the names of what draws (an execution id, a model call's index in
its execution, an engine id, a token's position). Out: 63-bit seeds, the same on every machine
and Python process (a keyed BLAKE2b of the names, not ``hash()``, which is salted per process).

Model calls (issue 19, reproducibility): the proxy stamps a call that has no seed of its own
with ``call_seed(run seed, execution id, call index)``; the engine draws the token at position
``k`` of a seeded request from ``token_seed(seed, k)``. A call that moves to another engine
after ``n`` tokens is sent with ``continued_seed(seed, n)``, whose position 0 is the original's
position ``n`` (``token_seed`` sees ``seed + n + k`` in both cases), so a call samples the same
tokens on whichever engines serve it, rerouted or not (given the same logits).

Invariant: each function is pure; equal inputs give equal seeds, and distinct names give
independent streams (a cryptographic hash, no arithmetic structure between names).
"""

from __future__ import annotations

import hashlib

_INT64 = 2**64
_HALF = 2**63


def derive_seed(*parts: object) -> int:
    """A seed in ``[0, 2**63)`` from the ``repr`` of ``parts`` (ints and strings)."""
    text = "\x1f".join(repr(p) for p in parts).encode()
    digest = hashlib.blake2b(text, digest_size=8, person=b"tidal-seed").digest()
    return int.from_bytes(digest, "little") % _HALF


def call_seed(run_seed: int, execution_id: str, call_index: int) -> int:
    """The sampling seed of the ``call_index``-th model call (from 0) of an execution."""
    return derive_seed("call", run_seed, execution_id, call_index)


def engine_seed(run_seed: int, engine_id: str) -> int:
    """An engine's own seed (for requests that reach it unseeded): distinct per engine, so
    engines serving one GRPO group never draw the same samples."""
    return derive_seed("engine", run_seed, engine_id)


def continued_seed(seed: int, tokens_so_far: int) -> int:
    """The seed a call continues with on another engine after ``tokens_so_far`` tokens
    (int64 wrap-around, the range the OpenAI ``seed`` field allows)."""
    return (seed + tokens_so_far + _HALF) % _INT64 - _HALF


def token_seed(seed: int, position: int) -> int:
    """The seed of the draw at ``position`` (tokens generated before it) of a seeded request."""
    return derive_seed("token", continued_seed(seed, position))
