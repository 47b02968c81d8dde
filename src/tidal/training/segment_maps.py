"""An engine's end of the shared-memory carrier: a segment's tensors as views of its pages.

In: the path of a segment ``SegmentRing`` wrote (``tidal.training.carriers``) in shared memory
and the label the engine is to serve. Out: a ``Mapped`` version (name -> read-only tensor
views of the segment, checked whole: its label, every tensor inside the file, a lock held),
which the engine either adopts as its weights (``adopt``: no copy; a CPU engine serving the
segment's dtype) or copies in (one ``copy_`` per tensor: another device or dtype).

Each segment file is mapped once (``MAP_POPULATE``: its pages entered by one call instead of a
fault per page) and the mapping kept while the file exists: the ring rewrites the same two
files, so a later version in a file mapped before costs no new mapping. An engine holds a
shared ``flock`` on the segment it serves from; the writer takes an exclusive one before it
rewrites a file and, finding it held, makes a new file instead (the served pages stay as they
are until the engine lets go). A segment being rewritten (its exclusive lock held, or a label
that is not the one asked for) is refused: an engine never serves a half-written version.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import struct
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tidal.training.transport import TransportError

_CODE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def on_tmpfs(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies on a memory file system (tmpfs: /dev/shm): only there is a segment
    served from its pages (a file on disk is read into the engine's own memory)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, parts[2]
    except OSError:
        return False
    return kind == "tmpfs"


@dataclass
class Mapped(Mapping[str, torch.Tensor]):
    """One version in a segment: name -> read-only view (valid while the mapping lives), the
    descriptor holding its shared lock (``close`` lets go), whether its writer checked every
    value finite."""

    path: str
    label: str
    checked: bool
    views: dict[str, torch.Tensor]
    fd: int = field(repr=False)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]

    def __iter__(self):
        return iter(self.views)

    def __len__(self) -> int:
        return len(self.views)

    def close(self) -> None:
        if self.fd >= 0:  # unlocked first: the mapping holds a duplicate of the descriptor
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1
        self.views = {}


class SegmentMaps:
    """One engine's mappings of the segments it loaded (see the module docstring) and the one it
    serves from (``serving``)."""

    def __init__(self) -> None:
        # (device, inode, size) -> (a descriptor kept to see the file unlinked, its mapping)
        self._maps: dict[tuple[int, int, int], tuple[int, mmap.mmap]] = {}
        self._lock = threading.Lock()  # ``premap`` runs in a thread of its own
        self.serving: Mapped | None = None

    def open(self, path: str | os.PathLike, label: str) -> Mapped | None:
        """``path``'s version, locked, as views; None when it is no segment in shared memory
        (then it is read as a file). A segment being rewritten, torn, or of another label
        raises ``TransportError`` before anything is served."""
        path = str(path)
        if not (path.endswith(".safetensors") and on_tmpfs(path)):
            return None
        fd = os.open(path, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise TransportError(f"{path}: being rewritten by its writer") from None
            st = os.fstat(fd)
            mm = self._mapping(fd, st)
            got, views, checked = _views(mm, path, st.st_size)
            if got is None:  # a safetensors file of another kind: read as a file
                kept = self._maps.pop((st.st_dev, st.st_ino, st.st_size), None)
                if kept is not None:
                    os.close(kept[0])
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                return None
            if got != label:
                raise TransportError(f"{path}: holds {got or 'no label'}, not {label}")
        except BaseException:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            raise
        self._prune()
        return Mapped(path, label, checked, views, fd)

    def _mapping(self, fd: int, st: os.stat_result) -> mmap.mmap:
        key = (st.st_dev, st.st_ino, st.st_size)
        with self._lock:
            kept = self._maps.get(key)
            if kept is not None:
                return kept[1]
            if st.st_size < 8:
                raise TransportError(f"segment of {st.st_size} bytes: torn")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(fd, st.st_size, flags, mmap.PROT_READ)
            self._maps[key] = (os.dup(fd), mm)
            return mm

    def premap(self, path: str | os.PathLike) -> int:
        """Map ahead the other files of ``path``'s ring of the same size (its writer's spares
        and published segments): a later version written into one of them then needs no new
        mapping (entering 0.54 GB of pages measured 0.05-0.15 s). Once per file, off the
        load's path (the engine runs it after its reply). Returns how many it mapped."""
        here, n = os.path.realpath(path), 0
        try:
            size, names = os.path.getsize(here), os.listdir(os.path.dirname(here))
        except OSError:  # renamed or gone meanwhile: nothing ahead this time
            return 0
        for name in names:
            if not (name.endswith(".safetensors") or name.startswith(".spare-")):
                continue
            try:
                fd = os.open(os.path.join(os.path.dirname(here), name), os.O_RDONLY)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if st.st_size == size and (st.st_dev, st.st_ino, size) not in self._maps:
                    self._mapping(fd, st)
                    n += 1
            except (OSError, ValueError):
                pass
            finally:
                os.close(fd)
        return n

    def _prune(self) -> None:
        """Mappings of files that are gone (unlinked by their writer) are dropped, except the
        one served from (its views keep it mapped anyway)."""
        with self._lock:
            for key, (fd, _) in list(self._maps.items()):
                if os.fstat(fd).st_nlink == 0:
                    os.close(fd)
                    del self._maps[key]  # unmapped once no view of it is left

    def serve(self, seg: Mapped | None) -> None:
        """``seg`` is what the engine now serves from (None: its own memory); the previous one's
        lock goes."""
        if self.serving is not None and self.serving is not seg:
            self.serving.close()
        self.serving = seg

    def close(self) -> None:
        self.serve(None)
        with self._lock:
            for fd, _ in self._maps.values():
                os.close(fd)
            self._maps.clear()


def _views(mm: mmap.mmap, path: str, size: int) -> tuple[str | None, dict[str, torch.Tensor], bool]:
    """(label, name -> view, checked) of a segment's mapping; label None: not a segment."""
    (n,) = struct.unpack_from("<Q", mm, 0)
    if 8 + n > size:
        raise TransportError(f"{path}: header of {n} bytes in a file of {size}: torn")
    try:
        head = json.loads(mm[8 : 8 + n])
    except ValueError:
        raise TransportError(f"{path}: unreadable header: torn") from None
    meta = head.pop("__metadata__", None) or {}
    if "weight_version" not in meta:
        return None, {}, False
    start, views = 8 + n, {}
    with warnings.catch_warnings():  # read-only pages: the engine never writes its weights
        warnings.simplefilter("ignore", UserWarning)
        for name, e in head.items():
            a, b = e["data_offsets"]
            dtype = _CODE_DTYPES.get(e["dtype"])
            if dtype is None or start + b > size or b < a:
                raise TransportError(
                    f"{path}: tensor {name} ({e['dtype']}, bytes {a}-{b}) does not fit a "
                    f"segment of {size} bytes: torn"
                )
            n = (b - a) // dtype.itemsize
            flat = torch.frombuffer(mm, dtype=dtype, count=n, offset=start + a)
            views[name] = flat.view(e["shape"])
    return str(meta["weight_version"]), views, meta.get("checked") == "finite"


def adoptable(model: torch.nn.Module, seg: Mapped, device: torch.device) -> bool:
    """Whether ``model`` (serving on ``device``; its parameters may be freed) can serve
    straight from ``seg``'s pages: on the CPU, in the dtype the segment holds."""
    if device.type != "cpu":
        return False
    return all(
        v is None or v.dtype == p.dtype
        for v, p in ((seg.views.get(n), p) for n, p in model.named_parameters())
    )


@torch.no_grad()
def adopt(model: torch.nn.Module, seg: Mapped) -> None:
    """``model``'s parameters become ``seg``'s views (names and shapes checked before: the
    model's ``check_weights``); its own memory for them goes."""
    for name, p in list(model.named_parameters()):
        v = seg.views.get(name)
        if v is None:
            continue
        if torch._has_compatible_shallow_copy_type(p, v):
            p.data = v
        else:  # a freed (meta) parameter: a new one in its place
            owner, _, attr = name.rpartition(".")
            mod = model.get_submodule(owner) if owner else model
            mod._parameters[attr] = torch.nn.Parameter(v, requires_grad=p.requires_grad)
    retie = getattr(model, "_retie", None)
    if retie is not None:
        retie()
