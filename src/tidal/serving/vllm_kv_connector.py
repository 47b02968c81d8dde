"""tidal's KV connector for vLLM: a call drained off one vLLM server keeps its KV at the next
one (on another node its export is first carried into that node's folder). Loaded by
``--kv-transfer-config`` with ``kv_connector_module_path`` ``tidal.serving.vllm_kv_connector``;
``kv_connector_extra_config.tidal_kv_dir`` names the node's shared-memory folder, ``lease_s``
how long an export waits for its adopter.

Runs inside the vLLM server's processes, so it imports only vLLM, torch, the standard library
and ``serving.kv_blocks`` (the block copies, any device and cache layout). Flow (the proxy's
side is ``VLLMAdapter`` through the folder's routes, ``serving.vllm_kv_routes``):

- source: the proxy has ``keep-<engine request id>`` (a nonce) written into the folder, then aborts
  the request. vLLM calls ``request_finished`` before it frees the blocks: with a marker, the
  scheduler keeps the request's computed blocks (``True``: freed after the save), and the
  next step's workers copy them to ``<key>.<rank>.kv`` (``key``: a hash of the computed token
  ids and the nonce); the scheduler then writes ``<key>.json`` (the token ids, the model, the
  ranks) and ``rec-<nonce>.json`` (the key and the token count) for the proxy. Without a
  marker an abort exports nothing; an export nobody adopts is removed after ``lease_s``.
- destination: the continued request carries ``kv_transfer_params: {"tidal_kv": key}``. The
  scheduler (``get_num_new_matched_tokens``) checks the manifest's tokens are a prefix of the
  prompt and the model is its own, and offers them (at most the prompt less its last token),
  and the workers copy the blocks into the request's new blocks before its first step
  (``start_load_kv``), write ``<key>.ack`` (the tokens adopted: the proxy's cached count) and
  delete the files. A failed load reports its blocks, which vLLM recomputes
  (``kv_load_failure_policy: recompute``; the proxy counts the handoff as failed).

Files are plain files in a tmpfs folder (``/dev/shm``), written under a temporary name and
renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from tidal.serving.kv_blocks import cache_layers, load_blocks, save_blocks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

DEFAULT_DIR = "/dev/shm/tidal-kv"
PARAM = "tidal_kv"  # the key in a request's kv_transfer_params


def token_key(token_ids: list[int], nonce: str) -> str:
    """The export's name: a hash of the token ids whose KV it holds and of the abort's nonce
    (two calls of one GRPO group share a prompt and often their first tokens: their exports
    must not share a name, or the first adopter's load deletes the second's blocks)."""
    data = b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids)
    return hashlib.sha256(data + nonce.encode()).hexdigest()[:40]


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


@dataclass
class _Save:
    req_id: str
    key: str
    block_ids: list[int]


@dataclass
class _Load:
    req_id: str
    key: str
    src_first: int  # first block of the export to copy
    block_ids: list[int]  # the request's blocks it fills
    tokens: int = 0  # the prompt tokens the request then need not prefill (its ack)


@dataclass
class TidalKVMetadata(KVConnectorMetadata):
    saves: list[_Save] = field(default_factory=list)
    loads: list[_Load] = field(default_factory=list)


def _rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, RuntimeError):
        return 0


class TidalKVConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self.dir = Path(cfg.get_from_extra_config("tidal_kv_dir", DEFAULT_DIR))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lease_s = float(cfg.get_from_extra_config("lease_s", 120.0))
        self.block_size = vllm_config.cache_config.block_size
        self.model = str(vllm_config.model_config.model)
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        # scheduler side
        self._saves: dict[str, tuple[_Save, dict]] = {}  # req id -> save, its manifest
        self._new_saves: list[_Save] = []
        self._loads: dict[str, tuple[str, int, int]] = {}  # req id -> key, first, end token
        # worker side
        self._kv: dict[str, torch.Tensor] = {}
        self._load_errors: set[int] = set()
        logger.info("tidal KV connector (%s) on %s", role.name, self.dir)

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        key = (request.kv_transfer_params or {}).get(PARAM)
        if not isinstance(key, str) or not key.isalnum():
            return 0, False
        try:
            manifest = json.loads((self.dir / f"{key}.json").read_text())
        except (OSError, ValueError):
            logger.warning("tidal KV %s: no export (expired or on another node)", key)
            return 0, False
        tokens = manifest.get("token_ids") or []
        end = min(len(tokens), request.num_tokens - 1)
        if (
            manifest.get("model") != self.model
            or manifest.get("tp") != self.tp
            or list(request.all_token_ids[:end]) != tokens[:end]
        ):
            logger.warning("tidal KV %s: does not match this request or model", key)
            return 0, False
        ext = end - num_computed_tokens
        if ext <= 0:
            return 0, False
        self._loads[request.request_id] = (key, num_computed_tokens, end)
        return ext, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            self._loads.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TidalKVMetadata(saves=self._new_saves)
        self._new_saves = []
        for new in scheduler_output.scheduled_new_reqs:
            load = self._loads.pop(new.req_id, None)
            if load is None:
                continue
            key, first, end = load
            bs = self.block_size
            first_block, end_block = first // bs, -(-end // bs)
            blocks = list(new.block_ids[0][first_block:end_block])
            meta.loads.append(_Load(new.req_id, key, first_block, blocks, end))
        self._loads.clear()  # requests not scheduled this step ask again
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # the engine's id is the API's id + "-" + 8 random characters (vLLM's input processor)
        marker = self.dir / f"keep-{request.request_id.rsplit('-', 1)[0]}"
        try:
            nonce = marker.read_text().strip()
            marker.unlink()
        except OSError:
            return False, None
        self._expire()
        n = max(0, request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0))
        blocks = list(block_ids[: -(-n // self.block_size)])
        if n == 0 or not nonce.isalnum() or len(blocks) * self.block_size < n:
            write_atomic(self.dir / f"rec-{nonce}.json", json.dumps({"num_tokens": 0}).encode())
            return False, None
        tokens = [int(t) for t in request.all_token_ids[:n]]
        key = token_key(tokens, nonce)
        save = _Save(request.request_id, key, blocks)
        manifest = {
            "token_ids": tokens,
            "model": self.model,
            "tp": self.tp,
            "block_size": self.block_size,
            "nonce": nonce,
        }
        self._saves[request.request_id] = (save, manifest)
        self._new_saves.append(save)
        return True, None

    def update_connector_output(self, connector_output) -> None:
        for req_id in connector_output.finished_sending or ():
            entry = self._saves.pop(req_id, None)
            if entry is None:
                continue
            save, manifest = entry
            write_atomic(self.dir / f"{save.key}.json", json.dumps(manifest).encode())
            rec = {"key": save.key, "num_tokens": len(manifest["token_ids"])}
            write_atomic(self.dir / f"rec-{manifest['nonce']}.json", json.dumps(rec).encode())

    def _expire(self) -> None:
        """Remove exports (and records, markers) older than the lease: nobody adopted them."""
        cutoff = time.time() - self.lease_s
        with contextlib.suppress(OSError):
            for p in self.dir.iterdir():
                with contextlib.suppress(OSError):
                    if p.stat().st_mtime < cutoff:
                        p.unlink()

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = dict(sorted(kv_caches.items()))

    def _layers(self) -> list[tuple[torch.Tensor, int]]:
        return cache_layers(self._kv, getattr(self._kv_cache_config, "num_blocks", None))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TidalKVMetadata)
        for load in meta.loads:
            path = self.dir / f"{load.key}.{_rank()}.kv"
            try:
                size = path.stat().st_size
                raw = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
                load_blocks(self._layers(), raw, load.src_first, load.block_ids)
            except (OSError, RuntimeError, ValueError) as exc:
                logger.warning("tidal KV %s: load failed (%s): recomputed", load.key, exc)
                self._load_errors.update(load.block_ids)
                continue
            with contextlib.suppress(OSError):
                path.unlink()
            if _rank() == 0:  # acknowledged once loaded: a failed load acknowledges nothing
                with contextlib.suppress(OSError):
                    write_atomic(self.dir / f"{load.key}.ack", str(load.tokens).encode())
                    (self.dir / f"{load.key}.json").unlink()

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        if not self.has_connector_metadata():
            return None, None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TidalKVMetadata)
        done = set()
        for save in meta.saves:
            data = save_blocks(self._layers(), save.block_ids)
            path = self.dir / f"{save.key}.{_rank()}.kv"
            try:
                write_atomic(path, data.numpy().tobytes())
            except OSError as exc:  # the blocks are freed all the same; the record says 0
                logger.warning("tidal KV %s: export failed (%s)", save.key, exc)
            done.add(save.req_id)
        return (done or None), None
