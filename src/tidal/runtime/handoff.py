"""Handoff: each engine gets a weight version by the fastest carrier its placement allows.

In: the version the core just wrote (``VersionWriter``: a shared-memory segment, or the file
when no segment could be written), an engine id and its actor. Out: a ``Delivery`` per engine
(carrier, bytes, seconds, the pause its engine saw, the carriers that failed first), and the
run directory's file of each version (the checkpoint's and the fallback's, copied from the
segment after the engines loaded, off their pause).

Carriers, in order of preference per placement (``Handoff.carriers``):
- the core trainer's own CUDA device (cell 0's built-in engine on a GPU): ``ipc`` first while
  the core's parameters on the device hold the version (not offloaded, no later step: CUDA IPC
  handles of them, the engine copies device to device, cast to its dtype), then as below;
- same node as the driver: ``shm`` (the segment's path in /dev/shm: the built-in engine reads it
  straight into its weights, vLLM workers and SGLang load it as a safetensors path), then
  ``file``;
- another node: ``broadcast`` (the segment's bytes over a gloo/NCCL side group in buckets, into
  a segment on the engine's node, loaded from there), then ``object`` (Ray's object store).
``runtime.weight_carrier`` puts one carrier first for every engine (tests, a cluster whose
nodes share no network for gloo); the others stay as fallbacks.
A carrier that fails (a segment gone or torn, a receiver lost mid-version) is logged and the
next one is tried; every engine verifies a whole version before it serves it (the built-in
engine checks names, shapes and values before any copy; a vLLM or SGLang load is read back), so
no engine serves a half-loaded version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tidal.training.carriers import SegmentRing
from tidal.training.transport import FilePublisher, TransportError

if TYPE_CHECKING:
    from tidal.runtime.engines import EngineId, Engines
    from tidal.runtime.ray_types import ActorHandle

log = logging.getLogger(__name__)

CARRIERS = ("auto", "shm", "broadcast", "file", "object")
# the core's parameters on its CUDA device while they hold the version asked for, else None
IpcSource = Callable[[int], Mapping[str, torch.Tensor] | None]


class SegmentUnavailable(TransportError):
    """No segment could be written (shared memory missing or full): the file carries it."""


class VersionWriter:
    """The core's one publisher: each version into a shared-memory segment (fast, every engine
    of this node reads it), else into the run's file; ``ensure_file`` writes the file from the
    segment when a checkpoint or a fallback needs it. ``restream`` re-reads the parameters
    (set by the wiring to the core's ``stream_params``) for a file written after a failed
    segment."""

    def __init__(self, files: FilePublisher, segments: SegmentRing | None) -> None:
        self.files, self.segments = files, segments
        self.restream: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None = None
        self.version = 0
        self.segment: str | None = None  # the newest version's segment (None: file only)
        self.write_s = 0.0  # how long the newest version took to write
        self.started = 0.0  # when its write began (``time.perf_counter``)
        self._file_lock = threading.Lock()  # a publication's and a wake's fallback

    def path(self, version: int) -> str:
        return self.files.path(version)

    def publish(self, version: int, flat: torch.Tensor) -> None:
        self.publish_stream(version, iter(self.files.layout.views(flat).items()))

    def publish_stream(self, version: int, params: Iterator[tuple[str, torch.Tensor]]) -> None:
        t0 = self.started = time.perf_counter()
        self.version, self.segment = version, None
        if self.segments is not None:
            try:
                self.segments.publish_stream(version, params)
                self.segment = self.segments.path(version)
            except TransportError as exc:
                if "shared memory" not in str(exc) or self.restream is None:
                    raise  # a bad version (NaN, wrong layout): no carrier takes it
                log.warning("v%d: no shared-memory segment (%s); writing the file", version, exc)
                params = self.restream()
        if self.segment is None:
            self.files.publish_stream(version, params)
        self.write_s = time.perf_counter() - t0

    def ensure_file(self, version: int) -> str:
        """The file of ``version`` in the run directory (the newest ``files.keep`` kept). Not
        there yet: copied from its segment when that is whole, else written from the trainer
        (``restream``; only for the newest version, while no step changes the parameters:
        the publication awaits it)."""
        with self._file_lock:
            final = self.files.path(version)
            if os.path.exists(final):
                return final
            seg = self.segments.path(version) if self.segments is not None else None
            if seg is not None and self._whole(seg, version):
                tmp = final + ".tmp"
                try:
                    shutil.copyfile(seg, tmp)
                    os.replace(tmp, final)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(tmp)
                self.files.published.append((version, final))
            elif self.restream is not None and version == self.version:
                log.warning(
                    "v%d: its segment is gone or torn; the file is written from the trainer",
                    version,
                )
                self.files.publish_stream(version, self.restream())
            else:
                raise TransportError(f"v{version}: no file, and no whole segment to write it from")
            while len(self.files.published) > self.files.keep:
                _, old = self.files.published.pop(0)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(old)
            return final

    def _whole(self, seg: str, version: int) -> bool:
        from tidal.training.carriers import read_header

        try:
            whole = os.path.getsize(seg) == self.segments.nbytes
            return whole and read_header(seg)[0] == f"v{version}"
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        if self.segments is not None:
            self.segments.close()


def version_writer(files: FilePublisher, out: Path) -> VersionWriter:
    """The run's writer: segments in this machine's /dev/shm when it has one (else the file
    alone); segments that runs killed before left behind are removed first."""
    import hashlib

    from tidal.training.carriers import SHM_ROOT, remove_orphans, segment_root

    segments = None
    if SHM_ROOT.is_dir():
        remove_orphans()
        tag = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:8]
        try:
            segments = SegmentRing(segment_root(tag), files.layout, keep=2, dtype=files.dtype)
            segments.prepare()  # the ring's pages now, not at the first publications
        except (OSError, TransportError) as exc:
            log.warning("no shared memory for weight versions (%s); the file carries them", exc)
            if segments is not None:
                segments.close()
                segments = None
    return VersionWriter(files, segments)


@dataclass(frozen=True)
class Delivery:
    """One engine's load of one version."""

    engine: str
    carrier: str
    label: str
    bytes: int
    seconds: float
    pause_s: float
    failed: tuple[str, ...] = ()  # "carrier: reason" of the carriers tried before
    # the engine's own parts of ``seconds`` where it reports them (the built-in engine):
    # prepare_s (opened and checked) and step_wait_s (waiting for its step in flight)
    parts: tuple[tuple[str, float], ...] = ()

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "carrier": self.carrier,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 4),
            "pause_s": round(self.pause_s, 4),
            **{k: round(v, 4) for k, v in self.parts},
        }
        if self.failed:
            out["fell_back_from"] = list(self.failed)
        return out


@dataclass
class Handoff:
    """Chooses and runs each engine's carrier (see the module docstring)."""

    engines: Engines
    writer: VersionWriter
    force: str = "auto"
    call_timeout_s: float = 180.0
    group_timeout_s: float = 60.0
    host: str = "127.0.0.1"  # the driver node's address (a broadcast group's store)
    deliveries: list[Delivery] = field(default_factory=list)
    # whether an engine serves on the core trainer's CUDA device (``core_placement``), and the
    # core's device parameters of a version (``core_ipc_source``): the ``ipc`` carrier's
    same_device: Callable[[EngineId], bool] = field(default=lambda eid: False)
    ipc_source: IpcSource | None = None
    # engine id -> (its actor, the side group, its key): the broadcast group kept per engine
    _links: dict[Any, tuple[Any, Any, str]] = field(default_factory=dict)

    def carriers(self, eid: EngineId, version: int | None = None) -> list[str]:
        local = self.engines.transport(eid) == "file"
        order = ["shm", "file"] if local else ["broadcast", "object"]
        if self.writer.segment is None:  # no segment of this version: what reads the file
            order = [c for c in order if c not in ("shm", "broadcast")]
        v = self.writer.version if version is None else version
        if (
            local
            and self.ipc_source is not None
            and self.same_device(eid)
            and self.ipc_source(v) is not None
        ):
            order = ["ipc", *order]
        if self.force != "auto":
            if self.force in ("shm", "broadcast") and self.writer.segment is None:
                return order
            order = [self.force, *[c for c in order if c != self.force]]
        return order

    async def deliver(
        self,
        eid: EngineId,
        actor: ActorHandle,
        version: int,
        label: str,
        load: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None,
    ) -> Delivery:
        """``label`` into engine ``eid`` by its first carrier that works; ``load(call)`` wraps
        each attempt (a vLLM engine goes out of routing meanwhile). Raises the last carrier's
        error when none worked."""
        from tidal.runtime.tasks import remote

        failed: list[str] = []
        order = self.carriers(eid, version)
        for carrier in order:
            t0 = time.perf_counter()
            try:
                make, nbytes = await self._call(carrier, eid, actor, version, label)
                out = await remote(
                    make() if load is None else load(make),
                    f"{eid} load {label} ({carrier})",
                    self.call_timeout_s,
                )
            except Exception as exc:  # the next carrier, unless this was the last
                reason = f"{carrier}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                failed.append(reason)
                if carrier == order[-1]:
                    raise
                log.warning(
                    "%s: %s did not load by %s; trying %s",
                    eid,
                    label,
                    reason,
                    order[order.index(carrier) + 1],
                )
                continue
            took = time.perf_counter() - t0
            served, pause_s = (
                (out["label"], out["pause_s"]) if isinstance(out, dict) else (out, took)
            )
            parts = (
                tuple((k, float(out[k])) for k in ("prepare_s", "step_wait_s") if k in out)
                if isinstance(out, dict)
                else ()
            )
            d = Delivery(str(eid), carrier, served, nbytes, took, pause_s, tuple(failed), parts)
            self.deliveries.append(d)
            return d
        raise TransportError(f"{eid}: no carrier for {label}")

    async def _call(
        self, carrier: str, eid: EngineId, actor: ActorHandle, version: int, label: str
    ) -> tuple[Callable[[], Awaitable[Any]], int]:
        """The Ray call that loads ``label`` by ``carrier`` and its bytes."""
        w = self.writer
        if carrier == "ipc":
            return self._ipc(actor, version, label)
        if carrier == "shm":
            seg = _existing(w.segment, carrier)
            return (lambda: actor.load_version.remote(seg, label)), os.path.getsize(seg)
        if carrier == "broadcast":
            return self._broadcast(eid, actor, _existing(w.segment, carrier), version, label)
        path = await asyncio.to_thread(w.ensure_file, version)
        if carrier == "file":
            return (lambda: actor.load_version.remote(path, label)), os.path.getsize(path)
        if carrier == "object":
            blob = await asyncio.to_thread(self.engines.blob, path)
            return (lambda: actor.load_weights_blob.remote(blob, label)), os.path.getsize(path)
        raise TransportError(f"unknown weight carrier {carrier!r}")

    def _ipc(
        self, actor: ActorHandle, version: int, label: str
    ) -> tuple[Callable[[], Awaitable[Any]], int]:
        """CUDA IPC handles of the core's device parameters of ``version`` (they stay as they
        are until the engine replied: the core takes no step while its version is published,
        and an offload keeps an exported block alive until the engine let go)."""
        from tidal.training.cuda_ipc import ipc_export

        named = self.ipc_source(version) if self.ipc_source is not None else None
        if named is None:
            raise TransportError(f"ipc: the core's device parameters no longer hold v{version}")
        handles = ipc_export(named)
        nbytes = sum(t.numel() * t.element_size() for t in named.values())
        return (lambda: actor.load_ipc.remote(handles, label)), nbytes

    def _broadcast(
        self, eid: EngineId, actor: ActorHandle, seg: str, version: int, label: str
    ) -> tuple[Callable[[], Awaitable[Any]], int]:
        """A two-member side group per engine (this driver rank 0 at its own store, the
        engine's host rank 1), formed at the engine's first broadcast and kept for the next
        ones (forming one across nodes can take a second); the host receives each segment into
        its node's shared memory and loads it from there. A failed broadcast drops the group
        (the next one forms a new group); a replaced engine (another actor) gets a new one."""
        from tidal.training.carriers import group_on, send_segment
        from tidal.training.groups import store_on

        timeout_s = self.group_timeout_s

        async def run() -> Any:
            link = self._links.get(eid)
            if link is not None and link[0] is actor:
                _, group, key = link
                store = group.store
            else:
                self._links.pop(eid, None)
                group, key = None, f"tidal-w/{eid}/{secrets.token_hex(8)}/"  # never reused
                store = await asyncio.to_thread(store_on, self.host, 0, 2, True, timeout_s)

            def send() -> Any:
                g = group or group_on(store, 0, 2, key, "gloo", timeout_s)
                send_segment(g, seg, version, timeout_s=timeout_s)
                return g

            recv = actor.receive_segment.remote(self.host, store.port, key, label, timeout_s)
            sent = asyncio.ensure_future(in_daemon_thread(send, f"tidal-bcast-{eid}"))
            try:
                out = await recv
                formed = await sent
            except BaseException:
                self._links.pop(eid, None)
                sent.cancel()
                raise
            self._links[eid] = (actor, formed, key)
            return out

        return run, os.path.getsize(seg)


async def in_daemon_thread(fn: Callable[[], Any], name: str) -> Any:
    """``fn()`` in a daemon thread of its own, awaited. For a blocking call that may outlive
    its caller: a gloo group whose other member died can block in its constructor for
    minutes, and in the default executor (``asyncio.to_thread``) that thread would hold the
    process at exit; cancelling the await leaves the thread to end on its own timeout."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if done.done():
            return
        if ok:
            done.set_result(value)
        else:
            done.set_exception(value)

    def target() -> None:
        try:
            out = (True, fn())
        except BaseException as exc:  # handed to the awaiting task, never lost
            out = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *out)

    threading.Thread(target=target, name=name, daemon=True).start()
    return await done


def _existing(path: str | None, carrier: str) -> str:
    if path is None or not Path(path).exists():
        raise TransportError(f"{carrier}: the version's segment is gone")
    return path


def core_placement(engines: Engines, core_device: str) -> Callable[[EngineId], bool]:
    """Whether an engine serves on the core trainer's CUDA device: cell 0's built-in engine on
    the driver's node when the core runs on a GPU (it trains on cell 0's first GPU)."""
    from tidal.runtime.engines import EngineId

    on_gpu = torch.device(core_device).type == "cuda"
    return lambda eid: (
        on_gpu
        and eid == EngineId.cell(0)
        and not engines.is_server(eid)
        and engines.transport(eid) == "file"
    )


def core_ipc_source(core: Any) -> IpcSource:
    """The core's parameters (name -> its tensor on the device, no copy) while they hold
    ``version``: on a CUDA device, not offloaded, not sharded, no step since; else None."""

    def source(version: int) -> Mapping[str, torch.Tensor] | None:
        if (
            core.device.type != "cuda"
            or core.sharded is not None
            or core.offloaded
            or core.version != version
        ):
            return None
        return {n: p.detach() for n, p in core.model.named_parameters()}

    return source
