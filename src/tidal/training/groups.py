"""Communication groups between the core and its satellites, over torch.distributed.

In: the cell index of this process and the core's TCPStore address. Out: process groups built as
side groups (``TCPStore`` + ``PrefixStore`` + ``ProcessGroupGloo``/``ProcessGroupNCCL``, never the
default group; see ENGINES.md "Ray and torch.distributed"): a two-member **link** per satellite
(snapshot pull and gradient delivery) and one **prefix** group per training prefix (the parameter
broadcast after a non-final update). Each group is created once, the first time it is needed,
and reused for as long as its members live; a joining satellite creates only its own link, so a
join never rebuilds a group the core already has. Group keys carry each member's incarnation, so
a restarted satellite gets fresh groups instead of a dead peer's.

Every operation has a timeout; torch.distributed errors become ``CommError`` here.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading

import torch
import torch.distributed as dist

from tidal.contracts.trainer import Backend
from tidal.errors import TidalError

log = logging.getLogger(__name__)


class CommError(TidalError):
    """A collective failed or timed out (a peer died, hung, or never joined)."""


def _td(seconds: float) -> dt.timedelta:
    return dt.timedelta(seconds=seconds)


def store_on(
    host: str, port: int, world: int | None, is_master: bool, timeout_s: float
) -> dist.TCPStore:
    """A ``TCPStore`` at ``host:port``; its master listens on ``host`` only (a socket bound
    here and handed over), not on every interface as torch's own would: a one-machine run's
    store stays on loopback, a cluster's on its node's address."""
    if not is_master:
        return dist.TCPStore(host, port, world, False, _td(timeout_s), wait_for_workers=False)
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    # the store owns the descriptor from here on (it closes it with the store)
    return dist.TCPStore(
        host,
        sock.getsockname()[1],
        world,
        True,
        _td(timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )


class GroupRegistry:
    """Per-process cache of side groups keyed by (members, incarnations)."""

    def __init__(
        self,
        cell: int,
        host: str,
        port: int,
        incarnation: str,
        backend: Backend = "gloo",
        timeout_s: float = 60.0,
    ) -> None:
        if host in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.cell = cell
        self.incarnation = incarnation
        self.backend = backend
        self.timeout_s = timeout_s
        is_master = cell == 0
        try:
            self.store = store_on(host, port, None, is_master, timeout_s)
        except (RuntimeError, dist.DistStoreError, OSError) as exc:
            raise CommError(
                f"cell {cell}: cannot reach the core's store {host}:{port}: {exc}"
            ) from exc
        self.host, self.port = host, self.store.port
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._lock = threading.Lock()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )

    def _create(self, key: str, rank: int, size: int) -> dist.ProcessGroup:
        with self._lock:
            if key in self._groups:
                return self._groups[key]
        store = dist.PrefixStore(key, self.store)
        try:
            if self.backend == "gloo":
                pg = dist.ProcessGroupGloo(store, rank, size, _td(self.timeout_s))
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = _td(self.timeout_s)
                pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        except RuntimeError as exc:
            raise CommError(f"cell {self.cell}: group {key} not formed: {exc}") from exc
        log.info("cell %d: group %s formed (rank %d of %d)", self.cell, key, rank, size)
        with self._lock:
            self._groups[key] = pg
        return pg

    @staticmethod
    def link_key(cell: int, incarnation: str) -> str:
        return f"link/{cell}/{incarnation}/"

    @staticmethod
    def prefix_key(members: list[tuple[int, str]]) -> str:
        return "prefix/" + ",".join(f"{c}:{i}" for c, i in members) + "/"

    def link(self, satellite: int, incarnation: str) -> dist.ProcessGroup:
        """The core<->satellite group: rank 0 is the core, rank 1 the satellite."""
        rank = 0 if self.cell == 0 else 1
        return self._create(self.link_key(satellite, incarnation), rank, 2)

    def prefix(self, members: list[tuple[int, str]]) -> dist.ProcessGroup:
        """The group of a training prefix; ``members`` are (cell, incarnation), core first."""
        cells = [c for c, _ in members]
        if cells[0] != 0 or cells != sorted(cells):
            raise CommError(f"prefix members must start at the core, in cell order: {cells}")
        return self._create(self.prefix_key(members), cells.index(self.cell), len(cells))

    def forget(self, key_part: str) -> None:
        """Drop cached groups that involve a lost peer (their connections are dead)."""
        with self._lock:
            for key in [k for k in self._groups if key_part in k]:
                del self._groups[key]

    def known_groups(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    def broadcast(self, pg: dist.ProcessGroup, tensor: torch.Tensor, root: int) -> None:
        """Broadcast ``tensor`` (CPU float32) from ``root``; moves through the device on NCCL."""
        buf = tensor if self.backend == "gloo" else tensor.to(self.device)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        opts.timeout = _td(self.timeout_s)
        try:
            pg.broadcast([buf], opts).wait(_td(self.timeout_s))
        except RuntimeError as exc:
            raise CommError(f"cell {self.cell}: broadcast from rank {root} failed: {exc}") from exc
        if buf is not tensor:
            tensor.copy_(buf.cpu())

    def close(self) -> None:
        with self._lock:
            self._groups.clear()
