"""The ranks of one training cell: rank 0 leads, ranks 1..k-1 follow its commands.

In: on rank 0, the calls of the core trainer or the satellite (compute a micro-step, commit or
discard it, gather parameters or gradients, load parameters, apply an update); on ranks 1..k-1,
the same operations received as small tensors over the cell's group (never pickled objects).
Out: one logical gradient worker per cell with ``GradientWorker``'s surface (``ShardedWorker``);
gradient sums held as local shards on every rank; full vectors (snapshots, publications,
deliveries) assembled on rank 0 one parameter at a time.

A micro-step is split by rows over the k ranks (rank r takes rows r, r+k, ...; a rank without a
row runs a fully masked one so the collectives line up); FSDP sums the row gradients, so
committing or discarding stays per micro-step, as the packing buffer requires (invariant 5).
Only a core cell has an optimizer; its state lives on each rank as the shards of its parameters.
Followers are ``python -m tidal.training.cell_ranks CONFIG`` processes started by rank 0.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tidal import malloc
from tidal.errors import TidalError
from tidal.training import dcp_state
from tidal.training.aggregate import Contribution, aggregate
from tidal.training.flat import ParamLayout
from tidal.training.loss import GRPOLossConfig, MicroStepTensors, grpo_loss_sum, target_logprobs
from tidal.training.sharded import (
    JOINED,
    ShardConfig,
    ShardLayout,
    await_followers,
    cell_store,
    close_cell_group,
    init_cell_group,
    shard_model,
)

log = logging.getLogger(__name__)

(
    COMPUTE,
    COMMIT,
    DISCARD,
    RESET,
    GATHER_PARAMS,
    LOAD_PARAMS,
    GATHER_GRADS,
    UPDATE,
    SAVE_DCP,
    LOAD_STATE,
    STOP,
    LOAD_DCP,
) = range(12)
NORMALIZATIONS = ("global", "local_mean")


@dataclass
class OptimizerSpec:
    kind: str
    lr: float
    weight_decay: float


class ShardedCell:
    """This process's rank of a cell: the sharded model, its local gradient sums, and (on a
    core cell) the optimizer over the shards. Rank 0 calls the public methods; they broadcast
    the operation first, so every rank runs the same collectives in the same order."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        cfg: ShardConfig,
        loss: GRPOLossConfig,
        pad_id: int,
        optimizer: OptimizerSpec | None,
    ) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device, self.loss, self.pad_id = device, loss, pad_id
        self.comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
        self.full_layout = ParamLayout.of(model)
        self.model = shard_model(model.to(device), device, cfg)
        self.layout = ShardLayout(self.model, self.full_layout)
        self.optimizer: torch.optim.Optimizer | None = None
        if optimizer is not None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            cls = torch.optim.AdamW if optimizer.kind == "adamw" else torch.optim.SGD
            self.optimizer = cls(params, lr=optimizer.lr, weight_decay=optimizer.weight_decay)
        self.reset_local()

    # -- the wire inside the cell ---------------------------------------------------------
    def _op(self, op: int, *args: int) -> None:
        if self.rank == 0:
            dist.broadcast(torch.tensor([op, *args, *[0] * (4 - len(args))], device=self.comm), 0)

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        moved = t.to(self.comm)
        dist.broadcast(moved, 0)
        return moved

    def serve(self) -> None:
        """Follower loop: run rank 0's operations until STOP."""
        header = torch.zeros(5, dtype=torch.long, device=self.comm)
        while True:
            dist.broadcast(header, 0)
            op, a, b, c, d = (int(x) for x in header)
            if op == STOP:
                return
            self._follow(op, a, b, c, d)

    def _follow(self, op: int, a: int, b: int, c: int, d: int) -> None:
        """One of rank 0's operations, with the header's arguments ``a``..``d``."""
        if op == COMPUTE:
            self._compute(self._recv_step(a, b))
        elif op == COMMIT:
            self._commit()
        elif op == DISCARD:
            self._discard()
        elif op == RESET:
            self.reset_local()
        elif op == GATHER_PARAMS:
            for _ in self.layout.iter_full_params(self.model):
                pass
        elif op == LOAD_PARAMS:
            self._load(torch.empty(self.full_layout.numel))
        elif op == GATHER_GRADS:
            for _ in self.layout.iter_full_grads(self.model, self.grad_sum):
                pass
        elif op == UPDATE:
            self._update(a, b, c, d, None, [])
        elif op == SAVE_DCP:
            dcp_state.save(self.model, self.optimizer, self._recv_path(a))  # type: ignore[arg-type]
        elif op == LOAD_DCP:
            self._follow_load_dcp(a)
        elif op == LOAD_STATE:
            self._load_state({}, {})
        else:
            raise TidalError(f"cell rank {self.rank}: unknown operation {op}")

    # -- operations (run on every rank) ----------------------------------------------------
    def reset_local(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.grad_sum = torch.zeros(self.layout.numel, dtype=torch.float32, device=self.device)
        self._pending_ok, self._pending_stats = False, torch.zeros(4, dtype=torch.float64)

    def _recv_step(self, b: int, length: int) -> MicroStepTensors:
        ints = self._bcast(torch.zeros((3, b, length), dtype=torch.long))
        floats = self._bcast(torch.zeros((3, b, length - 1), dtype=torch.float32))
        return MicroStepTensors(
            ints[0], ints[1, :, 1:].bool(), floats[0], floats[1], floats[2], ints[2, :, 1:]
        )

    def _send_step(self, t: MicroStepTensors) -> None:
        b, length = t.input_ids.shape
        pad = torch.zeros((b, 1), dtype=torch.long)
        ints = torch.stack(
            [t.input_ids, torch.cat([pad, t.mask.long()], 1), torch.cat([pad, t.staleness], 1)]
        )
        self._bcast(ints)
        self._bcast(torch.stack([t.behaviour_logprobs, t.advantages, t.token_weights]))

    def _compute(self, t: MicroStepTensors) -> torch.Tensor:
        """This rank's rows: forward, backward (FSDP sums the row gradients over the cell; the
        shards wait in ``.grad``); returns the cell-wide statistics."""
        from tidal.training.worker import forward_logits

        rows = list(range(self.rank, t.input_ids.shape[0], self.world))
        sub = MicroStepTensors(*(x[rows or [0]].to(self.device) for x in vars(t).values()))
        if not rows:  # nothing for this rank: a masked row keeps the collectives in step
            sub.mask = torch.zeros_like(sub.mask)
        self.model.zero_grad(set_to_none=True)
        logprobs = target_logprobs(forward_logits(self.model, sub.input_ids), sub.input_ids)
        loss, stats = grpo_loss_sum(logprobs, sub, self.loss)
        loss.backward()  # the shards' gradients wait in ``.grad`` until commit or discard
        stale = int((sub.staleness * sub.mask).max()) if bool(sub.mask.any()) else 0
        sums = torch.tensor(
            [
                stats.loss_sum,
                stats.n_tokens,
                stats.clipped_tokens,
                stats.mean_ratio * stats.n_tokens,
            ],
            dtype=torch.float64,
            device=self.comm,
        )
        dist.all_reduce(sums)
        top = torch.tensor([stale], dtype=torch.long, device=self.comm)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        sums, top = sums.cpu(), top.cpu()
        self._pending_ok, self._pending_stats = True, sums
        return torch.cat([sums, top.double()])

    def _commit(self) -> None:
        if not self._pending_ok:
            raise TidalError("commit without compute")
        self.layout.add_grads_(self.model, self.grad_sum)
        self._discard()

    def _discard(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self._pending_ok = False

    def _load(self, full: torch.Tensor) -> None:
        self.layout.load_full_(self.model, self._bcast(full).to(self.device))

    def _update(
        self,
        n_sats: int,
        n_executions: int,
        norm_code: int,
        own_steps: int,
        max_norm: float | None,
        sats: list[Contribution],
    ) -> float:
        """Aggregate this rank's slice of every contribution, clip by the cell-wide norm, step."""
        params = self._bcast(
            torch.tensor([-1.0 if max_norm is None else max_norm], dtype=torch.float64)
        )
        max_norm = None if float(params[0]) < 0 else float(params[0])
        own_exec = self._bcast(torch.tensor([sats[0].n_executions if sats else 0])).cpu()
        counts = torch.zeros((n_sats, 3), dtype=torch.long)
        for i, c in enumerate(sats[1:]):
            counts[i] = torch.tensor([c.cell, c.n_micro_steps, c.n_executions])
        if n_sats:
            counts = self._bcast(counts).cpu()
        contribs = [Contribution(0, self.grad_sum, own_steps, 0, int(own_exec[0]), 0.0)]
        for i in range(n_sats):
            full = sats[i + 1].grad if sats else torch.empty(self.full_layout.numel)
            local = self.layout.local_of(self._bcast(full.float()).to(self.device))
            cell, steps, execs = (int(x) for x in counts[i])
            contribs.append(Contribution(cell, local, steps, 0, execs, 0.0))
        grad = aggregate(contribs, n_executions, NORMALIZATIONS[norm_code])  # type: ignore[arg-type]
        sq = grad.double().pow(2).sum().reshape(1).to(self.comm)
        dist.all_reduce(sq)
        norm = float(sq[0].sqrt())
        if max_norm is not None and norm > max_norm:
            grad.mul_(max_norm / (norm + 1e-6))
        assert self.optimizer is not None, "only a core cell updates"
        self.layout.flat_to_grads_(self.model, grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _send_path(self, op: int, text: str) -> None:
        data = torch.tensor(list(text.encode()), dtype=torch.uint8)
        self._op(op, data.numel())
        self._bcast(data)

    def _recv_path(self, n: int) -> str:
        return bytes(self._bcast(torch.zeros(n, dtype=torch.uint8)).cpu().tolist()).decode()

    def _follow_load_dcp(self, n: int) -> None:
        msg = json.loads(self._recv_path(n))
        try:
            dcp_state.load(self.model, self.optimizer, msg["path"], msg["groups"])  # type: ignore[arg-type]
        except Exception:  # rank 0 raises the same failure (DCP gathers every rank's)
            log.exception("cell rank %d: loading %s failed", self.rank, msg["path"])

    def _load_state(self, model_sd: dict, optim_sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,  # type: ignore[arg-type]
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.world > 1),
        )

    # -- rank 0's API ----------------------------------------------------------------------
    def save_dcp(self, path: str) -> list[dict]:
        """Every rank writes its shards of the model and optimizer state under ``path``
        (``dcp_state.save``); returns the optimizer's param_groups for the JSON part."""
        self._send_path(SAVE_DCP, str(path))
        return dcp_state.save(self.model, self.optimizer, path)  # type: ignore[arg-type]

    def load_dcp(self, path: str, groups: list[dict]) -> None:
        """Every rank reads its slices of ``save_dcp`` output, written by a cell of any rank
        count; a damaged directory is refused on rank 0 before the cell is asked."""
        dcp_state.check(path, self.model)
        msg = json.dumps({"path": str(path), "groups": groups})
        self._send_path(LOAD_DCP, msg)  # every rank takes the same (JSON) param_groups
        groups = json.loads(msg)["groups"]
        try:
            dcp_state.load(self.model, self.optimizer, path, groups)  # type: ignore[arg-type]
        except Exception as exc:  # DCP's CheckpointException (every rank's failure), I/O
            first = (str(exc).splitlines() or [""])[0]
            raise TidalError(
                f"{path}: loading the shards failed: {type(exc).__name__}: {first}"
            ) from None

    def load_full_state(self, model_sd: dict, optim_sd: dict) -> None:
        """Restore a full (unsharded) state, a plain core's checkpoint: rank 0 reads it, every
        rank takes its shards."""
        self._op(LOAD_STATE)
        self._load_state(model_sd, optim_sd)

    def compute(self, t: MicroStepTensors) -> torch.Tensor:
        self._op(COMPUTE, *t.input_ids.shape)
        self._send_step(t)
        return self._compute(t)

    def commit(self) -> None:
        self._op(COMMIT)
        self._commit()

    def discard(self) -> None:
        self._op(DISCARD)
        self._discard()

    def reset(self) -> None:
        self._op(RESET)
        self.reset_local()

    def gather_params(
        self, sink: Callable[[str, torch.Tensor], None] | None = None
    ) -> torch.Tensor:
        """The full parameters: streamed to ``sink`` one at a time, and as a CPU flat vector."""
        self._op(GATHER_PARAMS)
        out = torch.empty(self.full_layout.numel, dtype=torch.float32)
        views = self.full_layout.views(out)
        for name, full in self.layout.iter_full_params(self.model):
            views[name].copy_(full)
            if sink is not None:
                sink(name, full)
        return out

    def stream_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full parameter) one at a time, in layout order, gathered by all ranks while
        the caller consumes them: no full copy of the model beyond one parameter. The caller
        must drain the iterator (the followers run the same gathers)."""
        self._op(GATHER_PARAMS)
        yield from self.layout.iter_full_params(self.model)

    def load_params(self, full: torch.Tensor) -> None:
        self._op(LOAD_PARAMS)
        self._load(full)

    def gather_grad_sum(self) -> torch.Tensor:
        """The cell's committed gradient sum as a full CPU vector (what a satellite delivers)."""
        self._op(GATHER_GRADS)
        out = torch.empty(self.full_layout.numel, dtype=torch.float32)
        views = self.full_layout.views(out)
        for name, full in self.layout.iter_full_grads(self.model, self.grad_sum):
            views[name].copy_(full)
        return out

    def update(
        self,
        own: Contribution,
        satellites: list[Contribution],
        n_executions: int,
        normalization: str,
        max_norm: float | None,
    ) -> float:
        """One optimizer step on every rank from the core's shards and the satellites' full
        vectors; returns the global gradient norm before clipping."""
        self._op(
            UPDATE,
            len(satellites),
            n_executions,
            NORMALIZATIONS.index(normalization),
            own.n_micro_steps,
        )
        return self._update(
            len(satellites),
            n_executions,
            NORMALIZATIONS.index(normalization),
            own.n_micro_steps,
            max_norm,
            [own, *satellites],
        )

    def stop(self) -> None:
        self._op(STOP)
        close_cell_group()


# -- starting a cell -----------------------------------------------------------------------
def start_cell(
    model: nn.Module,
    device: torch.device,
    cfg: ShardConfig,
    loss: GRPOLossConfig,
    pad_id: int,
    optimizer: OptimizerSpec | None,
    host: str = "127.0.0.1",
) -> tuple[ShardedCell, list[subprocess.Popen]]:
    """Rank 0 of a new cell: start ranks 1..k-1 (built from ``model.config``, then loaded with
    ``model``'s weights), shard, return the cell and the follower processes. The cell's group
    is NCCL on CUDA and gloo on the CPU (whatever links the cells to each other)."""
    if device.type == "cuda" and cfg.ranks > 1 and torch.cuda.device_count() < cfg.ranks:
        raise TidalError(f"shard.ranks: {cfg.ranks} ranks, {torch.cuda.device_count()} GPUs seen")
    backend = "nccl" if device.type == "cuda" else "gloo"
    full = ParamLayout.of(model).params_to_flat(model)
    store = cell_store(0, cfg.ranks, host, 0, cfg.timeout_s)
    spec = {
        "host": host,
        "port": store.port,
        "world": cfg.ranks,
        "backend": backend,
        "device": str(device),
        "shard": cfg.model_dump(),
        "loss": loss.model_dump(),
        "pad_id": pad_id,
        "optimizer": vars(optimizer) if optimizer else None,
        "model_config": model.config.to_dict(),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tidal.training.cell_ranks", json.dumps({**spec, "rank": r})]
        )
        for r in range(1, cfg.ranks)
    ]
    try:
        await_followers(store, procs, cfg.join_timeout_s)
        init_cell_group(store, 0, cfg.ranks, backend, cfg.timeout_s)
        cell = ShardedCell(model, device, cfg, loss, pad_id, optimizer)
        cell.load_params(full)
    except BaseException:  # Ctrl-C / SIGTERM too: no follower outlives a failed start
        for p in procs:
            p.kill()
            p.wait(10)
        close_cell_group()
        raise
    return cell, procs


def stop_cell(cell: ShardedCell, procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    cell.stop()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def _exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """A follower outlives no rank 0: it would wait for its next operation until the timeout."""
    while os.getppid() == parent:
        time.sleep(poll_s)
    os._exit(1)


def run_follower(spec: dict) -> None:
    """Ranks 1..k-1: build the architecture, join the cell, serve rank 0 until STOP."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    cfg = ShardConfig.model_validate(spec["shard"])
    device = torch.device(spec["device"])
    if device.type == "cuda":  # rank r takes the r-th GPU after rank 0's
        device = torch.device(
            "cuda", ((device.index or 0) + spec["rank"]) % torch.cuda.device_count()
        )
        torch.cuda.set_device(device)
    store = cell_store(spec["rank"], spec["world"], spec["host"], spec["port"], cfg.timeout_s)
    store.add(JOINED, 1)  # rank 0 waits for every rank in Python (``await_followers``)
    init_cell_group(store, spec["rank"], spec["world"], spec["backend"], cfg.timeout_s)
    mc = dict(spec["model_config"])
    config = AutoConfig.for_model(mc.pop("model_type"), **mc)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    opt = OptimizerSpec(**spec["optimizer"]) if spec["optimizer"] else None
    cell = ShardedCell(
        model, device, cfg, GRPOLossConfig.model_validate(spec["loss"]), spec["pad_id"], opt
    )
    cell.serve()
    close_cell_group()


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("TIDAL_LOG", "WARNING"))
    malloc.tune()
    run_follower(json.loads(sys.argv[1]))
