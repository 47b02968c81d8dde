"""Carriers: how one weight version crosses from the trainer's process to an engine's process.

In: a version as (name, tensor) pairs in layout order (the core's parameters, one at a time), or
a segment another process wrote. Out: the same bytes where the engine reads them. Three layers,
each usable alone (the runtime's per-engine choice is ``tidal.runtime.handoff``; the vLLM KV
connector may share the segment and group helpers):

- **shared memory** (one machine): ``SegmentRing`` writes each version as one segment in
  ``/dev/shm`` (a safetensors image: 8-byte header length, JSON header, data; so every reader
  that loads a safetensors path reads it unchanged: the built-in engine, vLLM's worker
  extension, SGLang). The newest ``keep`` segments exist; an older one's memory is reused for
  the next version (renamed, overwritten: no page is allocated again, so a version is written
  at copy speed). ``map_segment`` maps one, zero-copy, as name -> tensor views.
- **broadcast** (other machines): ``send_segment`` / ``recv_segment`` move a segment's bytes
  over a torch.distributed side group (``join_group``: TCPStore + PrefixStore, gloo on CPU,
  NCCL on GPUs) in fixed-size buckets, straight into the receiver's own segment (the receiver
  then loads it as above). A receiver that did not get every bucket never renames its segment
  into place: a half-received version is never loadable.
- **CUDA IPC** (the trainer's own GPU): ``ipc_export`` describes device tensors as JSON-safe
  handles; ``ipc_import`` in another process maps them (no copy) for a device-to-device copy
  into the engine's weights. GPU only (``TransportError`` elsewhere).

Invariant: a segment under its final name holds one whole version (written under a temporary
name, renamed when complete) and carries its label (``weight_version`` in the header).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import mmap
import os
import shutil
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tidal.models.base import all_finite
from tidal.training.flat import ParamLayout
from tidal.training.transport import TransportError

SHM_ROOT = Path("/dev/shm")
BUCKET_BYTES = 64 * 2**20  # a broadcast bucket: big enough for link speed, small to stage
STAGE_BYTES = 32 * 2**20  # a cast (bfloat16) or device (GPU) piece on its way into a segment
_DTYPE_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
_LABEL_WIDTH = 24  # "v" + digits; the header is padded to this label width (fixed data offset)


def segment_root(tag: str, root: Path = SHM_ROOT) -> Path:
    """This process's directory of segments: ``<root>/tidal-w<tag>-<pid>`` (the pid lets a
    later run remove what a killed one left: ``remove_orphans``)."""
    return root / f"tidal-w{tag}-{os.getpid()}"


def remove_orphans(root: Path = SHM_ROOT) -> int:
    """Remove segment directories whose writer process is gone; returns how many."""
    n = 0
    for d in root.glob("tidal-w*-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if d.is_dir() and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)
            n += 1
    return n


def _header(layout: ParamLayout, dtype: torch.dtype, label: str) -> bytes:
    """The safetensors header of a version, padded (spaces after the JSON, as safetensors
    allows) to a size that does not depend on the label: every version of a layout has its
    data at the same offset, 64-byte aligned."""
    if len(label) > _LABEL_WIDTH:
        raise TransportError(f"version label {label!r} longer than {_LABEL_WIDTH}")
    size = dtype.itemsize
    head: dict[str, object] = {"__metadata__": {"weight_version": label}}
    for name, shape, off in zip(layout.names, layout.shapes, layout.offsets, strict=True):
        n = 1
        for d in shape:
            n *= d
        head[name] = {
            "dtype": _DTYPE_CODES[dtype],
            "shape": list(shape),
            "data_offsets": [off * size, (off + n) * size],
        }
    blob = json.dumps(head, separators=(",", ":")).encode()
    width = len(blob) + _LABEL_WIDTH - len(label)  # as long as the longest label's
    width += -(width + 8) % 64
    return struct.pack("<Q", width) + blob.ljust(width)


def _pwrite(fd: int, data, at: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


class SegmentRing:
    """Versions of one layout as segments ``<dir>/v<version>.safetensors`` in shared memory,
    the newest ``keep`` kept (``keep`` >= 2: the version engines load while the next one is
    written). ``dtype``: what a segment holds (float32, or bfloat16 for engines that serve in
    it: half the bytes). Single writer; readers open the path."""

    def __init__(
        self,
        directory: str | os.PathLike,
        layout: ParamLayout,
        keep: int = 2,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if dtype not in _DTYPE_CODES:
            raise TransportError(f"a segment holds float32, bfloat16 or float16, not {dtype}")
        if keep < 2:
            raise TransportError("a segment ring keeps at least 2 versions")
        self.dir, self.layout, self.keep, self.dtype = Path(directory), layout, keep, dtype
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._head_len = len(_header(layout, dtype, "v0"))
        self.nbytes = self._head_len + layout.numel * dtype.itemsize
        self.published: list[tuple[int, str]] = []

    @property
    def data_bytes(self) -> int:
        """The weights' bytes in a segment (without its header)."""
        return self.layout.numel * self.dtype.itemsize

    def path(self, version: int) -> str:
        return str(self.dir / f"v{version}.safetensors")

    def latest(self) -> str | None:
        return self.published[-1][1] if self.published else None

    def publish(self, version: int, flat: torch.Tensor) -> None:
        self.publish_stream(version, iter(self.layout.views(flat).items()))

    def _slot(self, tmp: Path) -> None:
        """``tmp`` sized for one version: the oldest segment beyond ``keep - 1`` renamed to it
        (its memory reused), else a new one."""
        if len(self.published) >= self.keep:
            _, old = self.published.pop(0)
            with contextlib.suppress(FileNotFoundError):
                os.replace(old, tmp)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != self.nbytes:
                os.ftruncate(fd, self.nbytes)
        finally:
            os.close(fd)

    def publish_stream(self, version: int, params: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Write ``version`` from (name, tensor) pairs in layout order (a tensor may be on a
        GPU, or in another dtype: cast into a staging buffer kept between versions); a
        non-finite value or a name out of order aborts it (no segment of that version
        appears). ``OSError`` (e.g. /dev/shm full) -> TransportError. The bytes go in by
        ``pwrite`` (one copy by the kernel into the segment's pages): writing through a mapping
        costs a page fault per page, which on a virtual machine dominates the copy."""
        final, tmp = Path(self.path(version)), self.dir / f".v{version}.tmp"
        try:
            self._slot(tmp)
            fd = os.open(tmp, os.O_WRONLY)
            try:
                _pwrite(fd, _header(self.layout, self.dtype, f"v{version}"), 0)
                names = iter(zip(self.layout.names, self.layout.offsets, strict=True))
                size = self.dtype.itemsize
                for name, tensor in params:
                    want, off = next(names, (None, 0))
                    if name != want:
                        raise TransportError(f"publication out of layout order at {name}")
                    t = tensor.detach()
                    if not all_finite(t):
                        raise TransportError(
                            f"v{version}: parameter {name} holds NaN or "
                            "infinite values; not published"
                        )
                    self._write(fd, t.reshape(-1), self._head_len + off * size)
                if next(names, None) is not None:
                    raise TransportError(f"publication of v{version} ended early")
            finally:
                os.close(fd)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise TransportError(f"shared memory {tmp}: {exc}") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, final)
        self.published.append((version, str(final)))

    _stage: torch.Tensor | None = None

    def _write(self, fd: int, flat: torch.Tensor, at: int) -> None:
        """``flat``'s values, as ``self.dtype``, at byte ``at``: straight from a contiguous
        CPU tensor of that dtype, else through the staging buffer in pieces."""
        if flat.device.type == "cpu" and flat.dtype == self.dtype and flat.is_contiguous():
            _pwrite(fd, flat.view(torch.uint8).numpy(), at)
            return
        if self._stage is None:
            pin = torch.cuda.is_available() and flat.device.type == "cuda"
            self._stage = torch.empty(
                STAGE_BYTES // self.dtype.itemsize, dtype=self.dtype, pin_memory=pin
            )
        n = self._stage.numel()
        for a in range(0, flat.numel(), n):
            part = flat[a : a + n]
            buf = self._stage[: part.numel()]
            buf.copy_(part)
            _pwrite(fd, buf.view(torch.uint8).numpy(), at + a * self.dtype.itemsize)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.published.clear()


@contextlib.contextmanager
def _mapped(path: Path, nbytes: int, writable: bool) -> Iterator[torch.Tensor]:
    """``path``'s bytes as a uint8 tensor over a shared mapping (unmapped on exit; views of
    it must not outlive the block)."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    try:
        t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0)
        yield t
        del t
    finally:
        mm.close()


def read_header(path: str | os.PathLike) -> tuple[str, dict, int]:
    """(label, tensor entries, data offset) of a segment (or any safetensors file)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
    meta = head.pop("__metadata__", {}) or {}
    return str(meta.get("weight_version", "")), head, 8 + n


class MappedSegment(Mapping[str, torch.Tensor]):
    """A segment mapped copy-on-write: name -> tensor views of its memory (zero-copy; a write
    into one stays private to this process). ``close`` unmaps (views must be gone by then)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.label, entries, start = read_header(self.path)
        size = self.path.stat().st_size
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        self._views: dict[str, torch.Tensor] = {}
        for name, e in entries.items():
            a, b = e["data_offsets"]
            dtype = _CODE_DTYPES.get(e["dtype"])
            if dtype is None or start + b > size:
                self.close()
                raise TransportError(
                    f"{path}: tensor {name} ({e['dtype']}, bytes {a}-{b}) "
                    f"does not fit a segment of {size} bytes"
                )
            n = (b - a) // dtype.itemsize
            t = torch.frombuffer(self._mm, dtype=dtype, count=n, offset=start + a)
            self._views[name] = t.view(e["shape"])

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def close(self) -> None:
        self._views = {}
        with contextlib.suppress(BufferError):
            self._mm.close()


# -- broadcast -------------------------------------------------------------------------------
@dataclass
class SideGroup:
    """A process group of its own (never torch's default group) and the store it met at."""

    pg: dist.ProcessGroup
    store: dist.TCPStore
    backend: str = "gloo"

    @property
    def port(self) -> int:
        return self.store.port


def join_group(
    host: str,
    port: int,
    rank: int,
    world: int,
    key: str,
    backend: str = "gloo",
    timeout_s: float = 60.0,
) -> SideGroup:
    """A side group (not torch's default group) met at the store ``host:port`` (rank 0 hosts
    it: ``store_on`` first to learn a free port, then ``group_on``); every member passes the
    same ``key``."""
    from tidal.training.groups import store_on

    return group_on(
        store_on(host, port, world, rank == 0, timeout_s), rank, world, key, backend, timeout_s
    )


def group_on(
    store: dist.TCPStore,
    rank: int,
    world: int,
    key: str,
    backend: str = "gloo",
    timeout_s: float = 60.0,
) -> SideGroup:
    """The group of ``world`` members under ``key`` at ``store`` (blocks until all joined)."""
    prefixed = dist.PrefixStore(key, store)
    if backend == "nccl":
        pg = dist.ProcessGroupNCCL(prefixed, rank, world, dist.ProcessGroupNCCL.Options())
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, world, dt.timedelta(seconds=timeout_s))
    return SideGroup(pg, store, backend)


def _bcast(g: SideGroup, t: torch.Tensor, timeout_s: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    opts.timeout = dt.timedelta(seconds=timeout_s)
    try:
        g.pg.broadcast([t], opts).wait(dt.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TransportError(f"broadcast failed: {str(exc).splitlines()[0]}") from None


def _staged(g: SideGroup, bucket: torch.Tensor) -> torch.Tensor:
    """What goes on the wire: the bucket itself on gloo, a device copy on NCCL."""
    if g.backend != "nccl":
        return bucket
    return bucket.to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)


def send_segment(
    g: SideGroup,
    path: str | os.PathLike,
    version: int,
    bucket_bytes: int = BUCKET_BYTES,
    timeout_s: float = 60.0,
) -> int:
    """Rank 0: broadcast the segment at ``path`` (size and version first, then its bytes in
    buckets); returns the bytes sent."""
    size = os.path.getsize(path)
    _bcast(g, _staged(g, torch.tensor([size, version, bucket_bytes], dtype=torch.int64)), timeout_s)
    with _mapped(Path(path), size, writable=False) as whole:
        for a in range(0, size, bucket_bytes):
            _bcast(g, _staged(g, whole[a : a + bucket_bytes]), timeout_s)
    return size


def recv_segment(
    g: SideGroup, directory: str | os.PathLike, timeout_s: float = 60.0
) -> tuple[int, str]:
    """Any other rank: receive one segment into ``<directory>/v<version>.safetensors`` (under
    a temporary name until its last bucket arrived); returns (version, path)."""
    nccl = g.backend == "nccl"
    head = torch.zeros(3, dtype=torch.int64)
    head = _staged(g, head)
    _bcast(g, head, timeout_s)
    size, version, bucket = (int(x) for x in head.cpu().tolist())
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp, final = d / f".v{version}.recv", d / f"v{version}.safetensors"
    try:
        with open(tmp, "wb") as f:
            f.truncate(size)
        with _mapped(tmp, size, writable=True) as whole:
            for a in range(0, size, bucket):
                view = whole[a : a + bucket]
                if nccl:
                    buf = _staged(g, torch.empty_like(view))
                    _bcast(g, buf, timeout_s)
                    view.copy_(buf.cpu())
                else:
                    _bcast(g, view, timeout_s)
            del view
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, final)
    return version, str(final)


# -- CUDA IPC --------------------------------------------------------------------------------
def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def ipc_export(named: Mapping[str, torch.Tensor]) -> list[dict]:
    """JSON-safe CUDA IPC handles of ``named`` (CUDA tensors; the caller keeps them alive and
    unchanged until every importer copied them)."""
    from torch.multiprocessing.reductions import reduce_tensor

    out = []
    for name, t in named.items():
        if t.device.type != "cuda":
            raise TransportError(f"CUDA IPC carries CUDA tensors; {name} is on {t.device}")
        _, args = reduce_tensor(t.detach())
        (
            _,
            size,
            stride,
            offset,
            storage_cls,
            dtype,
            dev,
            handle,
            storage_bytes,
            storage_off,
            _,
            ref_handle,
            ref_off,
            event,
            sync,
        ) = args
        out.append(
            {
                "name": name,
                "size": list(size),
                "stride": list(stride),
                "offset": offset,
                "storage": storage_cls.__name__,
                "dtype": str(dtype).removeprefix("torch."),
                "device_uuid": _device_uuid(dev),
                "handle": base64.b64encode(handle).decode(),
                "storage_bytes": storage_bytes,
                "storage_offset": storage_off,
                "ref_handle": base64.b64encode(ref_handle).decode(),
                "ref_offset": ref_off,
                "event": base64.b64encode(event).decode() if event else "",
                "event_sync": bool(sync),
            }
        )
    return out


_STORAGES = {
    "TypedStorage": torch.storage.TypedStorage,
    "UntypedStorage": torch.storage.UntypedStorage,
}


def ipc_import(specs: list[dict]) -> dict[str, torch.Tensor]:
    """The tensors ``ipc_export`` described, mapped in this process (same physical GPU, found
    by its UUID whatever its index here)."""
    if not torch.cuda.is_available():
        raise TransportError("CUDA IPC needs a CUDA device in the receiving process")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    by_uuid = {_device_uuid(i): i for i in range(torch.cuda.device_count())}
    out = {}
    for s in specs:
        dev = by_uuid.get(s["device_uuid"])
        if dev is None:
            raise TransportError(f"CUDA IPC: {s['name']} is on a GPU this process cannot see")
        out[s["name"]] = rebuild_cuda_tensor(
            torch.Tensor,
            tuple(s["size"]),
            tuple(s["stride"]),
            s["offset"],
            _STORAGES[s["storage"]],
            getattr(torch, s["dtype"]),
            dev,
            base64.b64decode(s["handle"]),
            s["storage_bytes"],
            s["storage_offset"],
            False,
            base64.b64decode(s["ref_handle"]),
            s["ref_offset"],
            base64.b64decode(s["event"]) if s["event"] else None,
            s["event_sync"],
        )
    return out
