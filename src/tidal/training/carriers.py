"""Carriers: how one weight version crosses from the trainer's process to an engine's process.

In: a version as (name, tensor) pairs in layout order (the core's parameters, one at a time), or
a segment another process wrote. Out: the same bytes where the engine reads them. Layers,
each usable alone (the runtime's per-engine choice is ``tidal.runtime.handoff``; the vLLM KV
connector may share the segment and group helpers):

- **shared memory** (one machine): ``SegmentRing`` writes each version as one segment in
  ``/dev/shm`` (a safetensors image: 8-byte header length, JSON header, data; so every reader
  that loads a safetensors path reads it unchanged: the built-in engine, vLLM's worker
  extension, SGLang) in one pass: each piece copied into the writer's mapping of the segment
  and checked finite while still in the cache. The newest ``keep`` segments exist; an older
  one's file, pages and mapping are reused for the next version (no page is allocated or
  faulted again, so a version is written at copy speed) unless an engine serves from it (its
  shared ``flock``; then a new file is made). A built-in engine on the CPU serves straight from
  a segment's pages (``tidal.training.segment_maps``: no copy).
- **broadcast** (other machines): ``send_segment`` / ``recv_segment`` move a segment's bytes
  over a torch.distributed side group (``join_group``: TCPStore + PrefixStore, gloo on CPU,
  NCCL on GPUs) in fixed-size buckets, straight into the receiver's own segment (the receiver
  then loads it as above). A receiver that did not get every bucket never renames its segment
  into place: a half-received version is never loadable.
- **CUDA IPC** (the trainer's own GPU): ``tidal.training.cuda_ipc``.

Invariant: a segment under its final name holds one whole version (written under a temporary
name, renamed when complete) and carries its label (``weight_version`` in the header).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import mmap
import os
import shutil
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tidal.models.base import all_finite
from tidal.training.flat import ParamLayout
from tidal.training.transport import TransportError

SHM_ROOT = Path("/dev/shm")
BUCKET_BYTES = 64 * 2**20  # a broadcast bucket: big enough for link speed, small to stage
STAGE_BYTES = 32 * 2**20  # a device (GPU) piece on its way into a segment
CHECK_PIECE = 2**18  # elements copied by one call (see _copy_checked)
CHECK_SPAN = 2**20  # bytes copied, then checked finite by one reduction while in the cache
BATCH_BYTES = 64 * 2**20  # CPU tensors copied together (bounded: a sharded stream's are copies)
_NUMPY_DTYPES = (torch.float32, torch.float16)
CAST_PIECE = 2**15  # a piece cast into a segment: below torch's grain (one thread, no pool)
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
    # ``checked``: every value was found finite as it was written (``SegmentRing._fill``)
    head: dict[str, object] = {"__metadata__": {"weight_version": label, "checked": "finite"}}
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


class SegmentRing:
    """Versions of one layout as segments ``<dir>/v<version>.safetensors`` in shared memory,
    the newest ``keep`` kept (``keep`` >= 2: the version engines load while the next one is
    written). ``dtype``: what a segment holds (float32, or bfloat16 for engines that serve in
    it: half the bytes). Single writer; readers open the path (an engine that serves from a
    segment's pages holds a shared ``flock`` on it: ``tidal.training.segment_maps``)."""

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
        # inode -> this writer's mapping of that segment file, kept across versions: the ring
        # rewrites the same files, so after the first two versions no page is faulted again
        self._maps: dict[int, torch.Tensor] = {}
        self._spares: list[str] = []  # files made ahead, not yet holding a version

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

    def _slot(self, tmp: Path, reuse: bool = True) -> tuple[int, torch.Tensor]:
        """An open descriptor of ``tmp`` (sized for one version, locked exclusively) and this
        writer's mapping of it: the oldest segment beyond ``keep - 1`` renamed to ``tmp`` (its
        pages and mapping reused) unless an engine still serves from it (its shared lock: then
        it is unlinked, its pages stay that engine's until it lets go, and a new file is made)."""
        if not reuse:  # a new file (``prepare``)
            pass
        elif len(self.published) >= self.keep:
            _, old = self.published.pop(0)
            with contextlib.suppress(FileNotFoundError):
                os.replace(old, tmp)
        elif self._spares:  # a file made ahead (``prepare``): its pages and mapping ready
            os.replace(self._spares.pop(), tmp)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # an engine serves from these pages: never rewritten
                self._maps.pop(os.fstat(fd).st_ino, None)
                os.close(fd)
                fd = -1
                tmp.unlink()
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st = os.fstat(fd)
            if st.st_size != self.nbytes:
                os.ftruncate(fd, self.nbytes)
                self._maps.pop(st.st_ino, None)
            whole = self._maps.get(st.st_ino)
            if whole is None:  # every page faulted in by one call, not one fault per page
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                mm = mmap.mmap(fd, self.nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
                whole = self._maps[st.st_ino] = torch.frombuffer(mm, dtype=torch.uint8)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return fd, whole

    def publish_stream(self, version: int, params: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Write ``version`` from (name, tensor) pairs in layout order (a tensor may be on a
        GPU, or in another dtype: cast in the copy); a non-finite value or a name out of order
        aborts it (no segment of that version appears). ``OSError`` (e.g. /dev/shm full) ->
        TransportError. One pass over the parameters: each piece is copied into the segment's
        mapping and checked finite while it is still in the cache (the header says so:
        ``checked``, and an engine need not read the values again)."""
        final, tmp = Path(self.path(version)), self.dir / f".v{version}.tmp"
        try:
            fd, whole = self._slot(tmp)
            try:
                head = _header(self.layout, self.dtype, f"v{version}")
                whole[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
                lay, base = self.layout, whole.numpy()
                names = iter(zip(lay.names, lay.shapes, lay.offsets, strict=True))
                size, batch, held = self.dtype.itemsize, [], 0
                bad: str | None = None
                for name, tensor in params:
                    want, shape, off = next(names, (None, (), 0))
                    if name != want:
                        raise TransportError(f"publication out of layout order at {name}")
                    if tuple(tensor.shape) != tuple(shape):
                        raise TransportError(f"v{version}: {name} has shape {tuple(tensor.shape)}")
                    flat = tensor.detach().reshape(-1)
                    at = self._head_len + off * size
                    dst = whole[at : at + flat.numel() * size].view(self.dtype)
                    if flat.device.type == "cpu" and flat.dtype == dst.dtype in _NUMPY_DTYPES:
                        # copied below by the writer's threads, a batch at a time
                        batch.append((name, at, flat.contiguous().numpy()))
                        held += dst.numel() * size
                        if held >= BATCH_BYTES:
                            bad = bad or self._copy_batch(base, batch)
                            batch, held = [], 0
                    elif not self._fill(dst, flat):
                        bad = bad or name
                    if bad is not None:
                        break
                bad = bad or self._copy_batch(base, batch)
                if bad is not None:
                    raise TransportError(
                        f"v{version}: parameter {bad} holds NaN or infinite values; not published"
                    )
                if next(names, None) is not None:
                    raise TransportError(f"publication of v{version} ended early")
            finally:  # unlocked first: the mapping holds a duplicate of the descriptor
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise TransportError(f"shared memory {tmp}: {exc}") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, final)
        self.published.append((version, str(final)))
        self._forget_unlisted()

    def prepare(self) -> None:
        """Make the ring's ``keep`` files ahead (``.spare-<i>``: sized, their pages entered into
        this writer's mapping), so that no publication pays for allocating a version's pages
        (at the run's start instead: 0.54 GB of SmolLM2 measured 0.3-0.4 s of a version's
        write on a busy machine). ``OSError`` (shared memory full) -> TransportError."""
        try:
            while len(self._spares) + len(self.published) < self.keep:
                spare = self.dir / f".spare-{len(self._spares)}"
                fd, _ = self._slot(spare, reuse=False)
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                self._spares.append(str(spare))
        except OSError as exc:
            raise TransportError(f"shared memory {self.dir}: {exc}") from None

    def _forget_unlisted(self) -> None:
        """Drop this writer's mappings of files no longer in the ring (their pages go)."""
        inodes = set()
        for path in [p for _, p in self.published] + self._spares:
            with contextlib.suppress(FileNotFoundError):
                inodes.add(os.stat(path).st_ino)
        for ino in [i for i in self._maps if i not in inodes]:
            del self._maps[ino]

    _pool: ThreadPoolExecutor | None = None

    def _copy_batch(self, base: np.ndarray, batch: list[tuple[str, int, np.ndarray]]) -> str | None:
        """Each (name, byte offset in ``base``, values) of ``batch`` copied into the segment
        (``base``: its bytes) and checked, in pieces split between as many threads as torch
        uses (the memcpy it is compared with uses them too; numpy lets go of the GIL in its
        copy and its dot product); the name of a non-finite one."""
        size = self.dtype.itemsize
        pieces = [
            (name, at + a * size, v[a : a + CHECK_PIECE])
            for name, at, v in batch
            for a in range(0, v.size, CHECK_PIECE)
        ]
        k = max(1, min(4, torch.get_num_threads(), len(pieces)))
        if k == 1:
            return _copy_checked(base, pieces)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(3, thread_name_prefix="segment-write")
        cut = [len(pieces) * i // k for i in range(k + 1)]
        parts = [pieces[cut[i] : cut[i + 1]] for i in range(k)]
        others = [self._pool.submit(_copy_checked, base, part) for part in parts[1:]]
        first = _copy_checked(base, parts[0])
        return first or next((b for b in (f.result() for f in others) if b), None)

    _stage: torch.Tensor | None = None

    def _fill(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """``src``'s values into ``dst`` (a view of the segment; cast in the copy), piece by
        piece, each piece checked finite right after its copy (it is still in the cache: the
        check costs no second pass over memory); False at a non-finite value. A GPU tensor is
        checked on its device, then comes through a pinned staging buffer."""
        n = src.numel()
        if src.device.type != "cpu":
            if not all_finite(src):
                return False
            if self._stage is None:
                pin = torch.cuda.is_available()
                self._stage = torch.empty(
                    STAGE_BYTES // self.dtype.itemsize, dtype=self.dtype, pin_memory=pin
                )
            k = self._stage.numel()
            for a in range(0, n, k):
                part = src[a : a + k]
                buf = self._stage[: part.numel()]
                buf.copy_(part)
                dst[a : a + k].copy_(buf)
            return True
        for a in range(0, n, CAST_PIECE):  # a cast: torch's copy below its threading grain
            part = src[a : a + CAST_PIECE]
            dst[a : a + CAST_PIECE].copy_(part)
            if not all_finite(part):
                return False
        return True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._maps.clear()
        self._spares.clear()
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


def _copy_checked(base: np.ndarray, pieces: list[tuple[str, int, np.ndarray]]) -> str | None:
    """Each (name, byte offset in ``base``, values) piece copied into ``base``; each run of up
    to ``CHECK_SPAN`` bytes written back to back is then checked finite by one reduction while
    it is in the cache, and on a non-finite result each of its pieces exactly (naming it). The
    name of the first non-finite piece, or None. The reduction of float32 values is
    ``dot(x, x)``: every term is >= 0, so it is NaN or inf whenever a value is (nothing can
    cancel it), and finite otherwise unless a square overflowed (a value above ~1.8e19: the
    exact check decides). float16 values are summed (no BLAS kernel). 1 MiB pieces and runs
    (small tensors share one): each numpy call gives the GIL back and takes it again, each
    retake waiting up to 5 ms for a busy driver loop (docs/weights.md: fewer calls, 2.2x)."""
    span: list[tuple[str, int, int]] = []

    def bad_in(dt: np.dtype) -> str | None:
        s = base[span[0][1] : span[-1][2]].view(dt)
        if np.isfinite(np.dot(s, s) if dt == np.float32 else np.add.reduce(s)):
            return None
        return next((n for n, a, e in span if not np.isfinite(base[a:e].view(dt)).all()), None)

    with np.errstate(over="ignore", invalid="ignore"):
        for name, at, v in pieces:
            if span and (at != span[-1][2] or span[-1][2] - span[0][1] >= CHECK_SPAN):
                bad, span = bad_in(v.dtype), []  # a run ends: not back to back, or full
                if bad is not None:
                    return bad
            np.copyto(base[at : at + v.nbytes].view(v.dtype), v)
            span.append((name, at, at + v.nbytes))
        return bad_in(pieces[-1][2].dtype) if span else None


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
