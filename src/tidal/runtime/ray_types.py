"""The shapes of Ray's objects as tidal's runtime uses them, without importing Ray (it is
imported lazily where a run starts): an actor handle whose methods are called with
``.remote(...)``, and the object reference such a call returns (awaited, or ``ray.get``)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

#: a Ray ``ObjectRef``: opaque to tidal, awaited (``tasks.remote``) or passed on to a call
ObjectRef = Awaitable[object]


class RemoteMethod(Protocol):
    def remote(self, *args: object, **kwargs: object) -> ObjectRef: ...


class ActorHandle(Protocol):
    """A Ray actor handle: ``handle.method.remote(...)`` returns an ``ObjectRef``."""

    def __getattr__(self, name: str) -> RemoteMethod: ...
