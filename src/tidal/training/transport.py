"""Weight publication and snapshot transports: a flat float32 weight vector + version in and out.

The core publishes ``(version, flat)``; readers (satellites pulling a snapshot, the built-in
engine loading a new version in place, a vLLM worker extension) obtain the same vector. Two
paths behind one interface (plus ``FilePublisher`` for engines that load from a path):

- ``SharedMemoryTransport``: one machine. A named POSIX shared-memory segment holds a header
  (sequence counter, version, layout fingerprint, layout JSON) and the data. The writer bumps the
  sequence to odd, writes, bumps it to even (a seqlock), so a reader never returns a torn
  vector: it retries until it read a stable even sequence.
- ``BroadcastTransport``: torch.distributed. The publisher is rank 0 of a side group
  (``groups.py``); a header tensor (version, numel) goes first, then the data.

Keeps invariant 6 on the wire: a vector always travels with the version it belongs to, and a
reader asking for ``min_version`` waits (bounded) instead of returning older weights.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import json
import logging
import mmap
import os
import struct
from collections.abc import Iterator
from multiprocessing import shared_memory
from typing import Protocol

import torch
import torch.distributed as dist

from tidal.clock import Clock, WallClock
from tidal.errors import TidalError, TimeoutExpired
from tidal.training.flat import LayoutMismatch, ParamLayout
from tidal.training.groups import GroupRegistry

log = logging.getLogger(__name__)


class TransportError(TidalError):
    """A weight transport could not publish or read."""


class WeightPublisher(Protocol):
    def publish(self, version: int, flat: torch.Tensor) -> None: ...


class WeightReader(Protocol):
    def pull(self, out: torch.Tensor, min_version: int = 0, timeout_s: float = 60.0) -> int:
        """Fill ``out`` with the newest vector (at least ``min_version``); returns its version."""
        ...


# seq u64 | version i64 | numel u64 | meta_len u64 | fingerprint 16s
_HEADER = struct.Struct("<QqQQ16s")
_META_MAX = 1 << 20


def _layout_meta(layout: ParamLayout) -> bytes:
    meta = {"names": layout.names, "shapes": layout.shapes, "offsets": layout.offsets}
    blob = json.dumps(meta).encode()
    if len(blob) > _META_MAX:
        raise TransportError(f"layout metadata of {len(blob)} bytes exceeds {_META_MAX}")
    return blob


class SharedMemoryTransport:
    """Single-writer, many-reader weight vector in ``/dev/shm/<name>``."""

    def __init__(
        self, name: str, layout: ParamLayout, create: bool, clock: Clock | None = None
    ) -> None:
        self.clock: Clock = clock or WallClock()  # pulls wait on it (virtual time in tests)
        self.name, self.layout, self._owner = name, layout, create
        self._data_off = _HEADER.size + _META_MAX
        size = self._data_off + layout.nbytes
        self._shm: shared_memory.SharedMemory | None = None
        self._mmap: mmap.mmap | None = None
        try:
            if create:
                self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
                self._buf = self._shm.buf
            else:
                # Readers map the segment directly: ``SharedMemory`` would register it with a
                # resource tracker that unlinks the writer's segment when the reader exits.
                fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
                try:
                    self._mmap = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
                self._buf = memoryview(self._mmap)
        except (FileExistsError, FileNotFoundError) as exc:
            raise TransportError(f"shared memory {name!r}: {exc}") from exc
        self._data = torch.frombuffer(
            self._buf, dtype=torch.float32, offset=self._data_off, count=layout.numel
        )
        if create:
            meta = _layout_meta(layout)
            self._buf[_HEADER.size : _HEADER.size + len(meta)] = meta
            self._write_header(0, -1, len(meta))

    @classmethod
    def attach(cls, name: str) -> SharedMemoryTransport:
        """A reader for a segment whose layout is not known locally (read from its header)."""
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
        try:
            with mmap.mmap(fd, _HEADER.size + _META_MAX, prot=mmap.PROT_READ) as mm:
                _, _, numel, meta_len, _ = _HEADER.unpack_from(mm, 0)
                meta = json.loads(bytes(mm[_HEADER.size : _HEADER.size + meta_len]))
        finally:
            os.close(fd)
        layout = ParamLayout(
            tuple(meta["names"]),
            tuple(tuple(s) for s in meta["shapes"]),
            tuple(meta["offsets"]),
            numel,
        )
        return cls(name, layout, create=False)

    def named_views(
        self, min_version: int = 0, timeout_s: float = 60.0
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """A stable private copy of the vector, as name -> tensor views (for ``load_weights``)."""
        flat = torch.empty(self.layout.numel, dtype=torch.float32)
        version = self.pull(flat, min_version, timeout_s)
        return version, self.layout.views(flat)

    def _write_header(self, seq: int, version: int, meta_len: int) -> None:
        _HEADER.pack_into(
            self._buf,
            0,
            seq,
            version,
            self.layout.numel,
            meta_len,
            self.layout.fingerprint().encode(),
        )

    def _read_header(self) -> tuple[int, int, int, int, str]:
        seq, version, numel, meta_len, fp = _HEADER.unpack_from(self._buf, 0)
        return seq, version, numel, meta_len, fp.decode()

    def publish(self, version: int, flat: torch.Tensor) -> None:
        if not self._owner:
            raise TransportError("only the creating process publishes")
        seq, _, _, meta_len, _ = self._read_header()
        self._write_header(seq + 1, version, meta_len)
        self._data.copy_(flat)
        self._write_header(seq + 2, version, meta_len)

    def version(self) -> int:
        return self._read_header()[1]

    def layout_from_segment(self) -> dict:
        meta_len = self._read_header()[3]
        return json.loads(bytes(self._buf[_HEADER.size : _HEADER.size + meta_len]))

    def pull(self, out: torch.Tensor, min_version: int = 0, timeout_s: float = 60.0) -> int:
        deadline = self.clock.now() + timeout_s
        while True:
            seq, version, numel, _, fp = self._read_header()
            if fp != self.layout.fingerprint() or numel != self.layout.numel:
                raise LayoutMismatch(f"segment {self.name} holds another model layout ({fp})")
            if seq % 2 == 0 and version >= min_version:
                out.copy_(self._data)
                if self._read_header()[0] == seq:
                    return version
            if self.clock.now() > deadline:
                raise TimeoutExpired(
                    f"no stable weights >= v{min_version} in {self.name} after {timeout_s}s "
                    f"(have v{version})"
                )
            self.clock.sleep(0.001)  # a seqlock across processes: nothing to be notified by

    def close(self) -> None:
        del self._data
        if self._shm is not None:
            self._buf = None
            self._shm.close()
            self._shm.unlink()
        elif self._mmap is not None:
            self._buf.release()
            self._mmap.close()


class BroadcastTransport:
    """Publisher = rank ``root`` of a side group; every other rank calls ``pull``."""

    def __init__(self, registry: GroupRegistry, group: dist.ProcessGroup, root: int = 0) -> None:
        self.registry, self.group, self.root = registry, group, root

    def publish(self, version: int, flat: torch.Tensor) -> None:
        header = torch.tensor([float(version), float(flat.numel())], dtype=torch.float64)
        self.registry.broadcast(self.group, header, self.root)
        self.registry.broadcast(self.group, flat, self.root)

    def pull(self, out: torch.Tensor, min_version: int = 0, timeout_s: float = 60.0) -> int:
        header = torch.zeros(2, dtype=torch.float64)
        self.registry.broadcast(self.group, header, self.root)
        version, numel = int(header[0]), int(header[1])
        if numel != out.numel():
            raise LayoutMismatch(f"broadcast carries {numel} values, expected {out.numel()}")
        self.registry.broadcast(self.group, out, self.root)
        if version < min_version:
            raise TransportError(f"received v{version}, wanted >= v{min_version}")
        return version


# the dtypes a published file may hold: safetensors' name, and the raw integer view written
_FILE_DTYPES = {torch.float32: ("F32", torch.int32), torch.bfloat16: ("BF16", torch.int16)}


class FilePublisher:
    """Writes ``<dir>/v<version>.safetensors`` (atomically: temp file, then rename) for engines
    that load a weight version from a path (the built-in engine's ``update_weights(path,
    "v<version>")``); keeps the newest ``keep`` files. ``dtype``: what the file holds, float32
    (the trainer's own values; the built-in engine reads nothing else) or bfloat16 (half the
    bytes, for engines that serve in bfloat16 and would cast to it anyway:
    ``backends.published_dtype``)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        layout: ParamLayout,
        keep: int = 2,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from pathlib import Path

        if dtype not in _FILE_DTYPES:
            raise TransportError(f"a published file holds float32 or bfloat16, not {dtype}")
        self.dir, self.layout, self.keep, self.dtype = Path(directory), layout, keep, dtype
        self.dir.mkdir(parents=True, exist_ok=True)
        self.published: list[tuple[int, str]] = []

    def path(self, version: int) -> str:
        return str(self.dir / f"v{version}.safetensors")

    def publish(self, version: int, flat: torch.Tensor) -> None:
        self.publish_stream(version, iter(self.layout.views(flat).items()))

    def publish_stream(self, version: int, params: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Write a version from (name, tensor) pairs arriving one at a time in layout order (a
        sharded trainer gathers each parameter as it is written): the safetensors header is
        known from the layout, so no full copy of the model is ever assembled."""
        final = self.path(version)
        tmp = final + ".tmp"
        header: dict[str, object] = {"__metadata__": {"weight_version": f"v{version}"}}
        code, raw = _FILE_DTYPES[self.dtype]
        size = self.dtype.itemsize
        for name, shape, off in zip(
            self.layout.names, self.layout.shapes, self.layout.offsets, strict=True
        ):
            n = 1
            for d in shape:
                n *= d
            header[name] = {
                "dtype": code,
                "shape": list(shape),
                "data_offsets": [off * size, (off + n) * size],
            }
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        with contextlib.ExitStack() as cleanup, open(tmp, "wb") as f:
            cleanup.callback(lambda: os.path.exists(tmp) and os.remove(tmp))
            f.write(struct.pack("<Q", len(head)) + head)
            names = iter(self.layout.names)
            for name, tensor in params:
                if name != next(names, None):
                    raise TransportError(f"publication out of layout order at {name}")
                if not bool(torch.isfinite(tensor).all()):  # no engine is handed it (any backend)
                    raise TransportError(
                        f"v{version}: parameter {name} holds NaN or infinite values; not published"
                    )
                values = tensor.detach().to("cpu", self.dtype).contiguous()
                f.write(values.view(raw).numpy().data)  # numpy has no bfloat16: its bits
            if next(names, None) is not None:
                raise TransportError(f"publication of v{version} ended early")
            f.close()
            os.replace(tmp, final)
        self.published.append((version, final))
        while len(self.published) > self.keep:
            _, old = self.published.pop(0)
            with contextlib.suppress(FileNotFoundError):
                os.remove(old)


def load_into(
    module: torch.nn.Module, reader: WeightReader, min_version: int = 0, timeout_s: float = 60.0
) -> int:
    """Load the newest published weights into ``module`` in place (no restart, no realloc)."""
    layout = ParamLayout.of(module)
    flat = torch.empty(layout.numel, dtype=torch.float32)
    version = reader.pull(flat, min_version, timeout_s)
    layout.flat_to_params_(module, flat)
    return version
