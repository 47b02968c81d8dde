"""Which torch device a model runs on: names in, a checked ``torch.device`` out.

In: a device name from a config or a flag (``"cpu"``, ``"cuda"``, ``"cuda:N"``). Out: a
``torch.device`` that this process can really use, or one readable ``DeviceError`` (CUDA asked
for but not seen, an index past the visible devices, an unknown name). Also what a process
reports about the devices torch sees (``tidal check``), and the one place that hands freed
CUDA memory back to the driver (engine sleep, trainer offload), so ``nvidia-smi`` and the
other process sharing the GPU see it free, and the pinned host buffers state is offloaded into.
"""

from __future__ import annotations

import re

import torch

from tidal.contracts.trainer import DEVICE_PATTERN
from tidal.errors import TidalError

_NAME = re.compile(DEVICE_PATTERN)


class DeviceError(TidalError):
    """A device was named that this process cannot use."""


def resolve_device(name: str | torch.device) -> torch.device:
    """``name`` as a usable device; ``cuda`` means the first visible GPU (``cuda:0``)."""
    text = str(name)
    if not _NAME.match(text):
        raise DeviceError(f"device {text!r}: use 'cpu', 'cuda' or 'cuda:N'")
    if text == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {text!r}: torch {torch.__version__} sees no CUDA device "
            f"(a CPU-only build, or CUDA_VISIBLE_DEVICES hides every GPU)"
        )
    dev = torch.device(text)
    index = 0 if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise DeviceError(
            f"device {text!r}: only {torch.cuda.device_count()} CUDA device(s) visible"
        )
    return torch.device("cuda", index)


class HostStash:
    """Pinned host memory for state moved off a GPU and back (trainer offload and onload).

    A copy into freshly allocated pageable memory runs at a few GB/s: the trainer's offload of
    the 7B shape ran at 1.2 GB/s on an H200 (benchmarks/README.md, GPU check of 2026-12-04),
    against a host link of tens of GB/s. ``to_host`` copies into a pinned buffer kept per key:
    the first offload allocates and pins (once), later ones copy into the same buffers
    asynchronously and ``settle`` waits for them together. The buffers stay allocated while the
    state is back on the device, so a process that offloads once holds its state's size of
    pinned host memory from then on (the memory an offloaded trainer needs anyway).
    Off CUDA it moves nothing: CPU tensors are returned as they are."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending: set[torch.device] = set()

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def to_host(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in this key's pinned buffer (valid after ``settle``)."""
        if tensor.device.type != "cuda":
            return tensor.to("cpu")
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._buffers[key] = buf
        buf.copy_(tensor, non_blocking=True)
        self._pending.add(tensor.device)
        return buf

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` on ``device``; from a pinned buffer the copy is asynchronous (ordered
        before any later work on the device's stream, so nothing needs to wait for it)."""
        if device.type != "cuda":
            return tensor.to(device)
        return tensor.to(device, non_blocking=tensor.is_pinned())

    def move(self, key: str, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` moved to ``device``: into this key's pinned buffer when ``device`` is
        the host, else onto the device (``settle`` before reading host values)."""
        if device.type == "cpu":
            return self.to_host(key, tensor)
        return self.to_device(tensor, device)

    def settle(self) -> None:
        """Wait until every ``to_host`` copy has landed (before the values are read on the
        host or the device memory is handed back)."""
        for device in self._pending:
            torch.cuda.synchronize(device)
        self._pending.clear()


def release_cached(device: torch.device) -> None:
    """Return the caching allocator's free blocks to the driver (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def device_peak_mb(device: torch.device | str) -> float | None:
    """The most memory torch's allocator held on ``device`` since the process started (MB;
    ``torch.cuda.max_memory_allocated``), or None off CUDA (a CPU process's peak is its
    resident memory, which ``runtime.footprint`` samples from outside)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(dev) / 2**20, 1)


def describe_devices() -> str:
    """One line: what torch in this process sees (``tidal check``)."""
    if not torch.cuda.is_available():
        return f"torch {torch.__version__}: cpu only (no CUDA device visible)"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return (
        f"torch {torch.__version__}: cuda, {len(names)} device(s): {', '.join(names)} "
        f"({gib:.0f} GiB on cuda:0)"
    )
