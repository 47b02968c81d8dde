"""A sharded core's model and optimizer state on disk through ``torch.distributed.checkpoint``.

In: an FSDP2 model and its optimizer on every rank of a cell (all ranks call together), and a
directory. Out: each rank writes its own shards (never a full copy on rank 0) as a safetensors
file whose JSON header records where its pieces sit in the full tensors
(``HuggingFaceStorageWriter(save_distributed=True)``); loading plans the reads from those
headers (``HuggingFaceStorageReader``), so a cell of another rank count takes its own slices
(DCP reshards). The optimizer's ``param_groups`` (floats, betas, parameter names) are not
tensors: the caller keeps them as JSON.

No pickle anywhere: DCP's default ``FileSystemWriter`` writes ``.metadata`` with ``pickle.dump``
and its ``FileSystemReader.read_metadata`` runs ``pickle.load`` on it, and non-tensor values
would be written with ``torch.save`` and read back by ``torch.load(weights_only=False)``; the
safetensors writer and reader used here write no ``.metadata`` and read headers as JSON and
tensors as raw bytes, and ``_split`` refuses any non-tensor value before DCP sees it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tidal.errors import TidalError


def _split(optim_sd: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The optimizer's per-parameter tensors (to DCP) and its param_groups (JSON)."""
    state = optim_sd.get("state", {})
    for fqn, entries in state.items():
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor):
                raise TidalError(
                    f"checkpoint: optimizer state {fqn}.{key} is a "
                    f"{type(value).__name__}, not a tensor"
                )
    return state, list(optim_sd.get("param_groups", []))


def _tied(model: nn.Module) -> dict[str, str]:
    """Tied parameters (an LM head sharing the embedding): alias name -> first name. One
    tensor is written once (safetensors stores no aliases); the same on every rank."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def save(
    model: nn.Module, optimizer: torch.optim.Optimizer, path: str | Path
) -> list[dict[str, Any]]:
    """Every rank writes its shards of the model and optimizer state under ``path`` (created);
    rank 0 then fsyncs every file there. Returns the param_groups (identical on all ranks)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    for alias in _tied(model):
        model_sd.pop(alias, None)
    state, groups = _split(optim_sd)
    Path(path).mkdir(parents=True, exist_ok=True)
    dcp.save(
        {"model": model_sd, "optimizer": {"state": state}},
        storage_writer=HuggingFaceStorageWriter(str(path), save_distributed=True),
    )
    dist.barrier()  # every rank's file is closed before rank 0 syncs them
    if dist.get_rank() == 0:
        for f in sorted(Path(path).iterdir()):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return groups


def check(path: str | Path, model: nn.Module) -> None:
    """Rank 0, before asking the cell to load: the shard headers parse, and every parameter is
    there and covered; else one ``TidalError`` line naming the directory."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    if not Path(path).is_dir() or not any(Path(path).glob("*.safetensors")):
        raise TidalError(f"{path}: no sharded trainer state (*.safetensors)")
    try:
        meta = HuggingFaceStorageReader(str(path)).read_metadata()
    except Exception as exc:  # safetensors' header errors, a header without sharding info
        raise TidalError(
            f"{path}: a shard file is damaged: {type(exc).__name__}: "
            f"{(str(exc).splitlines() or [''])[0]}"
        ) from None
    for name, p in model.named_parameters():  # tied aliases are not listed
        md = meta.state_dict_metadata.get(f"model.{name}")
        if md is None:
            raise TidalError(f"{path}: parameter {name} is missing (another model?)")
        if tuple(md.size) != tuple(p.shape):
            raise TidalError(
                f"{path}: parameter {name} has shape {tuple(md.size)}, the model "
                f"{tuple(p.shape)} (another model?)"
            )
        covered = sum(int(torch.Size(c.sizes).numel()) for c in md.chunks)
        if covered != p.numel():
            raise TidalError(
                f"{path}: parameter {name}: the shards hold {covered} of "
                f"{p.numel()} values (a shard file is missing)"
            )


def load(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: str | Path,
    groups: list[dict[str, Any]],
) -> None:
    """Every rank reads its own slices of the saved shards (any saved rank count) into its
    model and optimizer; ``groups`` are the saved param_groups."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)  # the targets, sharded like the cell
    state, _ = _split(optim_sd)
    tied = {a: f for a, f in _tied(model).items() if a in model_sd}
    for alias in tied:
        model_sd.pop(alias)
    dcp.load(
        {"model": model_sd, "optimizer": {"state": state}},
        storage_reader=HuggingFaceStorageReader(str(path)),
    )
    for alias, first in tied.items():
        model_sd[alias] = model_sd[first]
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_sd,
        optim_state_dict={"state": state, "param_groups": groups},
    )
