"""FSDP2 inside one cell: the cell's process group, sharding a transformers model, and flat views
of the shards.

In: a ``transformers`` causal LM (fp32 master weights) and this process's rank in its cell. Out:
the model sharded with ``torch.distributed.fsdp.fully_shard`` (each decoder block, then the root)
over the cell's k ranks (gloo on the CPU, NCCL on CUDA; bf16 compute with fp32 reduction on CUDA;
activation checkpointing on request), and a ``ShardLayout`` that maps the wire format every
transport speaks (the full flat fp32 vector of ``ParamLayout``) onto this rank's shards: slice a
full vector into the local part, copy local gradients into a local flat vector and back, gather
full parameters one at a time.

Keeps: gradients are *summed* over the cell's ranks (FSDP's divide factor is set to 1), so a
micro-step split by rows over k ranks yields the gradient of the whole micro-step, and the core
still divides once by the global execution count (invariant 5). One cell per process: the cell's
group is the process's default group (``close_cell_group`` ends it).
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tidal.contracts.trainer import ShardConfig
from tidal.errors import TidalError
from tidal.training.flat import ParamLayout

JOINED = "tidal/ranks-joined"  # the store's count of followers that reached it


def cell_store(rank: int, world: int, host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The cell's rendezvous store; rank 0 hosts it (``port`` 0: any free port, read it back
    from ``store.port`` and hand it to the other ranks before joining)."""
    if host in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from tidal.training.groups import store_on

    return store_on(host, port, world, rank == 0, timeout_s)


def await_followers(
    store: dist.TCPStore, procs: list[subprocess.Popen], timeout_s: float, every_s: float = 0.1
) -> None:
    """Until ranks 1..k-1 have all reached the store (each adds 1 to ``joined``), polled in
    Python: a signal (SIGTERM, Ctrl-C) is handled between polls, where torch's own join would
    hold the thread in C++ for its whole timeout; a rank that exits first, or ``timeout_s``,
    is one ``TidalError`` line naming ``runtime.fsdp_ranks``."""
    deadline = time.monotonic() + timeout_s
    world = len(procs) + 1
    while store.add(JOINED, 0) < len(procs):
        for rank, p in enumerate(procs, start=1):
            if p.poll() is not None:
                raise TidalError(
                    f"runtime.fsdp_ranks: rank {rank} of {world} exited with "
                    f"{p.returncode} before joining its cell (too many ranks "
                    "for this machine's cores or memory?)"
                )
        if time.monotonic() > deadline:
            raise TidalError(
                f"runtime.fsdp_ranks: {store.add(JOINED, 0)} of {len(procs)} "
                f"ranks joined their cell within {timeout_s:g} s"
            )
        time.sleep(every_s)


def init_cell_group(
    store: dist.TCPStore, rank: int, world: int, backend: str, timeout_s: float
) -> None:
    """Make this cell's group the process's default group (blocks until all ranks joined)."""
    if dist.is_initialized():
        raise TidalError("this process already belongs to a cell group (one cell per process)")
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=dt.timedelta(seconds=timeout_s)
    )


def close_cell_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shard_model(model: nn.Module, device: torch.device, cfg: ShardConfig) -> nn.Module:
    """``fully_shard`` every decoder block (transformers' ``_no_split_modules``) and the root,
    over the default group; gradients are reduced as sums. The model must be on ``device``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    bf16 = cfg.mixed_precision == "bf16" or (
        cfg.mixed_precision == "auto" and device.type == "cuda"
    )
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


@dataclass(frozen=True)
class _Piece:
    name: str
    full_off: int  # offset in the full flat vector
    row_numel: int  # elements per dim-0 row
    row0: int  # first global row held here
    rows: int  # rows held here (0 for an empty shard)
    local_off: int  # offset in the local flat vector


class ShardLayout:
    """This rank's shards as one local flat vector, aligned with the full ``ParamLayout``."""

    def __init__(self, model: nn.Module, full: ParamLayout) -> None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        named = dict(model.named_parameters())
        self.full, self.names, pieces, pos = full, full.names, [], 0
        for name, shape, off in zip(full.names, full.shapes, full.offsets, strict=True):
            p = named[name]
            local_shape, offset = compute_local_shape_and_global_offset(
                p.shape, p.device_mesh, p.placements
            )
            row_numel = 1
            for d in shape[1:]:
                row_numel *= d
            rows = local_shape[0] if shape else 1
            row0 = offset[0] if shape else 0
            pieces.append(_Piece(name, off, row_numel, row0, rows, pos))
            pos += rows * row_numel
        self.pieces: tuple[_Piece, ...] = tuple(pieces)
        self.numel = pos

    def local_of(self, full_flat: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The part of a full flat vector this rank holds (a new local vector unless ``out``)."""
        if full_flat.numel() != self.full.numel:
            raise TidalError(f"full vector of {full_flat.numel()} values, model {self.full.numel}")
        if out is None:
            out = torch.empty(self.numel, dtype=full_flat.dtype, device=full_flat.device)
        for pc in self.pieces:
            n = pc.rows * pc.row_numel
            start = pc.full_off + pc.row0 * pc.row_numel
            out[pc.local_off : pc.local_off + n].copy_(full_flat[start : start + n])
        return out

    def _params(self, model: nn.Module) -> list[nn.Parameter]:
        named = dict(model.named_parameters())
        return [named[n] for n in self.names]

    def grads_to_flat(self, model: nn.Module, out: torch.Tensor) -> torch.Tensor:
        """Local gradient shards into ``out`` (a parameter without gradient gives zeros)."""
        for p, pc in zip(self._params(model), self.pieces, strict=True):
            seg = out[pc.local_off : pc.local_off + pc.rows * pc.row_numel]
            if p.grad is None:
                seg.zero_()
            else:
                seg.copy_(p.grad.to_local().reshape(-1))
        return out

    def add_grads_(self, model: nn.Module, flat: torch.Tensor) -> None:
        """Add the local gradient shards into ``flat`` (a parameter without one adds nothing)."""
        for p, pc in zip(self._params(model), self.pieces, strict=True):
            if p.grad is not None:
                flat[pc.local_off : pc.local_off + pc.rows * pc.row_numel] += (
                    p.grad.to_local().reshape(-1)
                )

    def flat_to_grads_(self, model: nn.Module, flat: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor

        for p, pc in zip(self._params(model), self.pieces, strict=True):
            local = p.to_local()
            g = flat[pc.local_off : pc.local_off + local.numel()].view_as(local)
            p.grad = DTensor.from_local(
                g.to(device=local.device, dtype=local.dtype, copy=True),
                p.device_mesh,
                p.placements,
                shape=p.shape,
                stride=p.stride(),
            )

    def load_full_(self, model: nn.Module, full_flat: torch.Tensor) -> None:
        """Copy this rank's part of a full vector into its parameter shards, in place."""
        with torch.no_grad():
            for p, pc in zip(self._params(model), self.pieces, strict=True):
                local = p.to_local()
                start = pc.full_off + pc.row0 * pc.row_numel
                local.copy_(full_flat[start : start + local.numel()].view_as(local))

    def iter_full_params(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full parameter) one at a time: an all-gather per parameter that every rank
        runs in the same order, so at most one full parameter is held beyond the shards."""
        for name, p in zip(self.names, self._params(model), strict=True):
            yield name, p.detach().full_tensor()

    def iter_full_grads(
        self, model: nn.Module, flat: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full gradient) of a local flat gradient vector, one all-gather at a time."""
        from torch.distributed.tensor import DTensor

        for name, p, pc in zip(self.names, self._params(model), self.pieces, strict=True):
            local = flat[pc.local_off : pc.local_off + p.to_local().numel()]
            d = DTensor.from_local(
                local.view(p.to_local().shape).to(p.device),
                p.device_mesh,
                p.placements,
                shape=p.shape,
                stride=p.stride(),
            )
            yield name, d.full_tensor()
