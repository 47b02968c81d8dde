"""CUDA IPC: a weight version handed from the trainer's GPU to an engine on the same GPU.

In: the trainer's CUDA tensors (name -> tensor). Out: JSON-safe handles (``ipc_export``) that
another process on the same machine turns into tensors over the same device memory
(``ipc_import``, no copy; the engine then copies them into its weights device to device). The
exporter keeps its tensors alive and unchanged until every importer copied them. GPU only
(``TransportError`` elsewhere). The runtime's choice of carrier per engine is
``tidal.runtime.handoff``.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping

import torch

from tidal.training.transport import TransportError


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
