"""The GPU check's weight carriers, at the big shape (bf16), each beside a device-to-device copy
of the same tensors (``weight_update`` is the file baseline):

- ``weight_carriers``: the trainer's version into a built-in engine on the same GPU by
  ``tidal run``'s shared-memory carrier (``SegmentRing``: the trainer's device tensors into a
  /dev/shm segment through a pinned staging buffer, the engine's ``update_weights`` from it;
  the second version reuses the segment's pages) and by CUDA IPC (the trainer's tensors mapped
  in the engine's own process, copied device to device: ``Engine.update_weights_from``); each
  load checked bit for bit;
- ``weight_broadcast``: the segment's bytes between two processes over a side group in buckets
  (``carriers.send_segment`` / ``recv_segment``): NCCL with two GPUs, gloo on the CPU dry run;
  skipped with the reason on one GPU.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import shutil
import socket
import time
from pathlib import Path

import torch
from kit import GiB, Skip, engine_model, free_bytes, sync, trainer_model

SHM = Path("/dev/shm")


def _segment_dir(ctx, nbytes: int) -> Path:
    """Shared memory when it has room for two versions, else the step's scratch directory."""
    if SHM.is_dir() and free_bytes(SHM) > 2 * nbytes + GiB:
        return SHM / f"tidal-wcheck-{os.getpid()}"
    if free_bytes(ctx.tmp) < 2 * nbytes + GiB:
        raise Skip(
            f"two versions need {2 * nbytes / GiB:.0f} GiB; neither /dev/shm nor {ctx.tmp} has it"
        )
    return ctx.tmp / "segments"


def _d2d_s(engine_m, own: dict, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for n, p in engine_m.named_parameters():
            p.copy_(own[n])
    sync(device)
    return time.perf_counter() - t0


def weight_carriers(ctx, figs) -> None:
    from engine_steps import new_engine

    from tidal.training.carriers import SegmentRing
    from tidal.training.flat import ParamLayout

    trained = trainer_model(ctx.big, ctx.device, torch.bfloat16, seed=1)
    own = {n: p.detach() for n, p in trained.named_parameters()}
    engine_m = engine_model(ctx.big, ctx.device, torch.bfloat16, seed=0)
    nbytes = engine_m.weights_nbytes()
    figs.add("weights (one version)", nbytes / GiB, "GiB", note="bf16")
    d2d = min(_d2d_s(engine_m, own, ctx.device) for _ in range(2))
    figs.add("plain device-to-device copy", nbytes / d2d / 1e9, "GB/s", note=f"{d2d * 1e3:.1f} ms")
    root = _segment_dir(ctx, nbytes)
    ring = SegmentRing(root, ParamLayout.of(trained), keep=2, dtype=torch.bfloat16)
    engine = new_engine(engine_m, ctx.device, 4)
    try:
        for version in (1, 2, 3):  # 3 reuses 1's pages: what every later version costs
            t0 = time.perf_counter()
            ring.publish_stream(version, iter(own.items()))
            write_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            asyncio.run(engine.update_weights(ring.path(version), f"v{version}"))
            sync(ctx.device)
            load_s = time.perf_counter() - t0
        figs.check(
            all(torch.equal(p, own[n]) for n, p in engine_m.named_parameters()),
            "the engine's weights differ from the trainer's after the shm load",
        )
        total = write_s + load_s
        figs.add(
            "shm: segment write (trainer -> /dev/shm)",
            write_s,
            "s",
            note=f"{nbytes / write_s / 1e9:.1f} GB/s, pages reused"
            + ("" if str(root).startswith(str(SHM)) else f"; not shm: {root}"),
        )
        figs.add(
            "shm: engine load (update_weights)",
            load_s,
            "s",
            note=f"pause {engine.last_pause_s:.3f} s",
        )
        figs.add(
            "tidal run: trainer -> engine",
            nbytes / total / 1e9,
            "GB/s",
            note=f"shm carrier: {nbytes / GiB:.1f} GiB bf16 in {total:.2f} s; "
            f"{total / d2d:.0f}x the device copy",
        )
    finally:
        ring.close()
        shutil.rmtree(root, ignore_errors=True)
    del engine, engine_m
    if ctx.device.type != "cuda":
        figs.add("ipc: trainer -> engine (same GPU)", "n/a", note="CUDA IPC needs CUDA")
        return
    torch.cuda.empty_cache()
    _ipc(ctx, figs, own, nbytes, d2d)


def _ipc_engine(shape: dict, handles: list[dict], out) -> None:
    """The engine's process: its model on the GPU, then the trainer's tensors by IPC."""
    try:
        from engine_steps import new_engine

        from tidal.training.cuda_ipc import ipc_import

        device = torch.device("cuda", torch.cuda.current_device())
        engine = new_engine(engine_model(shape, device, torch.bfloat16, seed=0), device, 4)
        t0 = time.perf_counter()
        named = ipc_import(handles)
        map_s = time.perf_counter() - t0
        asyncio.run(engine.update_weights_from(named, "v1"))
        total = time.perf_counter() - t0
        same = all(torch.equal(p, named[n]) for n, p in engine.model.named_parameters())
        out.put(("ok", map_s, total, engine.last_pause_s, same))
    except BaseException as exc:  # reported by the step
        out.put(("error", f"{type(exc).__name__}: {exc}", 0.0, 0.0, False))


def _ipc(ctx, figs, own: dict, nbytes: int, d2d: float) -> None:
    from tidal.training.cuda_ipc import ipc_export

    t0 = time.perf_counter()
    handles = ipc_export(own)
    export_s = time.perf_counter() - t0
    spawn = mp.get_context("spawn")
    out = spawn.Queue()
    child = spawn.Process(target=_ipc_engine, args=(ctx.big, handles, out))
    child.start()
    status, map_s, total, pause_s, same = out.get(timeout=600)
    child.join(60)
    if status != "ok":
        raise RuntimeError(f"IPC engine: {map_s}")
    figs.check(same, "the engine's weights differ from the trainer's after the IPC load")
    figs.add("ipc: export + map handles", export_s + map_s, "s")
    figs.add(
        "ipc: trainer -> engine (same GPU)",
        nbytes / (export_s + total) / 1e9,
        "GB/s",
        note=f"{export_s + total:.3f} s, pause {pause_s:.3f} s; "
        f"{(export_s + total) / d2d:.0f}x the device copy",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receiver(port: int, backend: str, directory: str, out) -> None:
    try:
        from tidal.training.carriers import join_group, recv_segment

        if backend == "nccl":
            torch.cuda.set_device(1)
        g = join_group("127.0.0.1", port, 1, 2, "check/", backend, 120)
        t0 = time.perf_counter()
        _, path = recv_segment(g, directory, 120)
        out.put(("ok", time.perf_counter() - t0, path))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}", ""))


def weight_broadcast(ctx, figs) -> None:
    from tidal.training.carriers import SegmentRing, join_group, send_segment
    from tidal.training.flat import ParamLayout

    cuda = ctx.device.type == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        raise Skip("NCCL needs one GPU per rank: this machine has 1 GPU")
    backend = "nccl" if cuda else "gloo"
    trained = trainer_model(ctx.big, ctx.device, torch.bfloat16, seed=1)
    layout = ParamLayout.of(trained)
    nbytes = layout.numel * 2
    root = _segment_dir(ctx, nbytes)
    ring = SegmentRing(root / "send", layout, dtype=torch.bfloat16)
    ring.publish_stream(1, ((n, p.detach()) for n, p in trained.named_parameters()))
    del trained
    port = _free_port()
    spawn = mp.get_context("spawn")
    out = spawn.Queue()
    child = spawn.Process(target=_receiver, args=(port, backend, str(root / "recv"), out))
    child.start()
    try:
        g = join_group("127.0.0.1", port, 0, 2, "check/", backend, 120)
        t0 = time.perf_counter()
        sent = send_segment(g, ring.path(1), 1, timeout_s=120)
        send_s = time.perf_counter() - t0
        status, recv_s, path = out.get(timeout=300)
        child.join(60)
        if status != "ok":
            raise RuntimeError(f"receiver: {recv_s}")
        same = Path(path).read_bytes() == Path(ring.path(1)).read_bytes()
        figs.check(same, "the received segment differs from the sent one")
        figs.add(
            f"broadcast ({backend}, 2 processes): segment",
            sent / max(send_s, recv_s) / 1e9,
            "GB/s",
            note=f"{sent / GiB:.2f} GiB in {max(send_s, recv_s):.3f} s, 64 MiB buckets",
        )
    finally:
        ring.close()
        shutil.rmtree(root, ignore_errors=True)
